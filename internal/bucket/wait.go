package bucket

// Waiting (max_wait): a request that the level does not cover now may
// wait until it does, within max_wait.

// takeWaiting is take with MaxWait, for a bucket no ban holds: the request
// is allowed when the level, less its cost, is at least -MaxWait's refill,
// and waits until the level would have held the cost. A debt
// (cost_from_response) is waited out the same way.
func takeWaiting(s State, now int64, l Limit, cost int64) (State, Result) {
	raw := s.RawDeficit(now, l)
	need := cost * l.Rate.Interval
	var w int64
	if lack := raw + need - l.Units(); lack > 0 {
		w = CeilDiv(lack, l.Rate.Tokens)
	}
	if w > l.MaxWait {
		return s, Result{
			Remaining:  max(0, l.Units()-raw) / l.Rate.Interval,
			RetryAfter: w - l.MaxWait,
			ResetAfter: CeilDiv(raw, l.Rate.Tokens),
		}
	}
	if cost == 0 {
		return s, Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-raw) / l.Rate.Interval, ResetAfter: CeilDiv(raw, l.Rate.Tokens)}
	}
	next := StateAt(now, raw+need, l)
	return next, Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-raw-need) / l.Rate.Interval, ResetAfter: next.FullAt - now}
}

// goTogether, for a request of several limits that waits (max_wait),
// takes its cost from every limit when it goes on: when the slowest limit
// lets it, not when each would. A limit that would let it go sooner would
// otherwise count it earlier than it reaches the origin, and the requests
// the slowest limit holds back would reach it together, more than that
// limit allows over the window. Taken later, the limit is never lower than
// it would have been, so the request fits it then too.
// It rewrites next, the states after the take, from states, those before.
func goTogether(states, next []State, now int64, ls []Limit, cost int64, out []Result) {
	var w int64
	for i := range ls {
		w = max(w, out[i].Wait)
	}
	if w == 0 {
		return
	}
	for i, l := range ls {
		if out[i].Wait == w {
			continue
		}
		d, need := states[i].RawDeficit(now+w, l), cost*l.Rate.Interval
		if cost == 0 {
			// Nothing to take: its level when the request goes on.
			out[i].Wait = w
			out[i].Remaining = max(0, l.Units()-d) / l.Rate.Interval
			continue
		}
		next[i] = StateAt(now+w, d+need, l)
		// Its answer speaks of that take, as the slowest limit's does.
		out[i] = Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-d-need) / l.Rate.Interval, ResetAfter: next[i].FullAt - now}
	}
}
