package redisbucket

import "github.com/bramsley/caddy-ratelimit/internal/bucket"

// results are where a request on a tier of several limits or quotas
// reports each one's result: the limits' in out, the quotas' in qout.
type results struct{ out, qout []bucket.Result }

// len is how many results there are room for.
func (rs results) len() int { return len(rs.out) + len(rs.qout) }

// at is the i-th result, the limits' first.
func (rs results) at(i int) *bucket.Result {
	if i < len(rs.out) {
		return &rs.out[i]
	}
	return &rs.qout[i-len(rs.out)]
}

// Tier is what one bucket's key holds: a tier's limits, every one of
// which a request takes from (one at least; the first names the ban and
// max_wait, which are the tier's), and its calendar quotas. A lease takes
// from them all at once, and its size is bounded by the smallest.
type Tier struct {
	Limits []bucket.Limit
	Quotas []bucket.Quota
	// lone is the limit of a tier of one limit and no slice (Limits nil),
	// which a lease entry keeps with no allocation.
	lone bucket.Limit
}

// loneLimit is the tier of one limit l.
func loneLimit(l bucket.Limit) Tier { return Tier{lone: l} }

// first is the tier's first limit, which carries its ban and max_wait.
func (tr Tier) first() bucket.Limit {
	if tr.Limits == nil {
		return tr.lone
	}
	return tr.Limits[0]
}

// all is the tier's limits, as a slice.
func (tr Tier) all() []bucket.Limit {
	if tr.Limits == nil {
		return []bucket.Limit{tr.lone}
	}
	return tr.Limits
}

// parts is how many limits and quotas the tier has, when more than one:
// the results a request on it reports; 0 for a tier of one limit.
func (tr Tier) parts() int {
	if n := len(tr.Limits) + len(tr.Quotas); n > 1 {
		return n
	}
	return 0
}

// leaseSize is the lease size for the tier: the least of its limits'.
func (tr Tier) leaseSize(z LeaseSize) int64 {
	n := z.Of(tr.first())
	for _, l := range tr.Limits {
		n = min(n, z.Of(l))
	}
	return n
}

// refill is how long the slowest of the tier's limits takes to refill n
// tokens (µs).
func (tr Tier) refill(n int64) int64 {
	l := tr.first()
	w := bucket.CeilDiv(n*l.Rate.Interval, l.Rate.Tokens)
	for _, l := range tr.Limits {
		w = max(w, bucket.CeilDiv(n*l.Rate.Interval, l.Rate.Tokens))
	}
	return w
}
