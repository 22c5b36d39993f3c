package bucket

// Tier is a tier's shape, which every store call takes: its limits, every
// one of which a request takes from (one at least; the first carries the
// tier's ban and max_wait), then its calendar quotas. A store reports a
// request on it limit by limit, then quota by quota, in that order.
//
// Callers pass the slices their tier already holds, so that a call
// allocates nothing.
type Tier struct {
	Limits []Limit
	Quotas []Quota
}

// First is the tier's first limit, which carries its ban and max_wait.
func (tr Tier) First() Limit { return tr.Limits[0] }

// Lone reports whether the tier is one limit and no quota: the shape that
// stores decide on their fastest path.
func (tr Tier) Lone() bool { return len(tr.Limits) == 1 && len(tr.Quotas) == 0 }

// Parts is how many limits and quotas the tier has: the results a request
// on it reports.
func (tr Tier) Parts() int { return len(tr.Limits) + len(tr.Quotas) }

// Refill is how long the slowest of the tier's limits takes to refill n
// tokens (µs); below 0 for n below 0.
func (tr Tier) Refill(n int64) int64 {
	first := tr.Limits[0]
	w := CeilDiv(n*first.Rate.Interval, first.Rate.Tokens)
	for _, l := range tr.Limits[1:] {
		w = max(w, CeilDiv(n*l.Rate.Interval, l.Rate.Tokens))
	}
	return w
}

// Binding is which of several limits' and quotas' results stands for them
// all, the one the X- headers report: when allowed, the one with the
// least remaining; when refused, the one that makes the client wait
// longest; the first of equals.
func Binding(all []Result, allowed bool) int {
	j := 0
	for i, r := range all {
		if allowed && r.Remaining < all[j].Remaining || !allowed && r.RetryAfter > all[j].RetryAfter {
			j = i
		}
	}
	return j
}
