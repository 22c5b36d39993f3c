package bucket

// Waiting (max_wait) in a bucket and in a shared bucket: a request that
// the level does not cover now may wait until it does, within max_wait.

// takeWaiting is take with MaxWait, for a bucket no ban holds: the request
// is allowed when the level, less its cost, is at least -MaxWait's refill,
// and waits until the level would have held the cost. A debt
// (cost_from_response) is waited out the same way.
//
// In a shared bucket, the level never refills over the tokens out on
// lease (held; shared.go) while the request waits: it goes on when the
// level, so capped, holds its cost (waitSettled), and its cost is taken
// then, from the level as it will be, so that the refill the cap loses
// meanwhile is not counted twice.
func takeWaiting(s State, now int64, l Limit, cost int64, held []Held) (State, Result) {
	raw := s.rawDeficit(now, l)
	need := cost * l.Rate.Interval
	var w int64
	if lack := raw + need - l.Units(); lack > 0 {
		w = CeilDiv(lack, l.Rate.Tokens)
	}
	if len(held) > 0 {
		w = waitSettled(s, now, l, need, held, w)
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
	next := stateAt(now, raw+need, l)
	if len(held) > 0 {
		next = stateAt(now+w, settledDeficit(s, now, now+w, l, held)+need, l)
	}
	return next, Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-raw-need) / l.Rate.Interval, ResetAfter: next.FullAt - now}
}

// settledDeficit is the deficit of limit l of a shared bucket, in state s
// at now, at t (not before now) as the bucket will have it if nothing
// else happens: refilling, but never over the tokens out on lease (held),
// each record's counted until it expires (shared.go's settle).
func settledDeficit(s State, now, t int64, l Limit, held []Held) int64 {
	d := max(s.rawDeficit(t, l), floorAt(held, t, l, false))
	for _, h := range held {
		if h.Expires > now && h.Expires <= t {
			// The cap at the expiry, then the refill since.
			d = max(d, floorAt(held, h.Expires, l, true)-(t-h.Expires)*l.Rate.Tokens)
		}
	}
	return d
}

// floorAt is the units limit l must lack at t for the tokens out on
// lease then: the records that expire after t, or, with at, at t too.
func floorAt(held []Held, t int64, l Limit, at bool) int64 {
	var out int64
	for _, h := range held {
		if h.Expires > t || at && h.Expires == t {
			out += h.Tokens
		}
	}
	return min(out, l.Capacity) * l.Rate.Interval
}

// waitSettled is the least wait, from w on, after which the settled level
// holds need units. The settled deficit only falls: each step either
// solves a refilling term or passes the next expiry, so it ends within
// twice the records' steps.
func waitSettled(s State, now int64, l Limit, need int64, held []Held, w int64) int64 {
	for range 2*len(held) + 2 {
		t := now + w
		d := settledDeficit(s, now, t, l, held)
		lack := d + need - l.Units()
		if lack <= 0 {
			return w
		}
		if d == floorAt(held, t, l, false) {
			// Held at the cap: nothing refills until a record expires.
			next := int64(-1)
			for _, h := range held {
				if h.Expires > t && (next < 0 || h.Expires < next) {
					next = h.Expires
				}
			}
			if next > 0 {
				w = next - now
				continue
			}
		}
		w += CeilDiv(lack, l.Rate.Tokens)
	}
	return w
}

// goTogether, for a request of several limits that waits (max_wait),
// takes its cost from every limit when it goes on: when the slowest limit
// lets it, not when each would. A limit that would let it go sooner would
// otherwise count it earlier than it reaches the origin, and the requests
// the slowest limit holds back would reach it together, more than that
// limit allows over the window. Taken later, the limit is never lower than
// it would have been, so the request fits it then too.
// It rewrites next, the states after the take, from states, those before.
func goTogether(states, next []State, now int64, ls []Limit, cost int64, out []Result, held []Held) {
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
		d, need := settledDeficit(states[i], now, now+w, l, held), cost*l.Rate.Interval
		if cost == 0 {
			// Nothing to take: its level when the request goes on.
			out[i].Wait = w
			out[i].Remaining = max(0, l.Units()-d) / l.Rate.Interval
			continue
		}
		next[i] = stateAt(now+w, d+need, l)
		// Its answer speaks of that take, as the slowest limit's does.
		out[i] = Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-d-need) / l.Rate.Interval, ResetAfter: next[i].FullAt - now}
	}
}
