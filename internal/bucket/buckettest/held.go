package buckettest

import "github.com/bramsley/caddy-ratelimit/internal/bucket"

// The steps of a shared bucket beside the tokens out on lease (held): the
// model of what the Redis script does (internal/redisbucket/script.go),
// written to be read beside the Lua. Package bucket takes, waits and gives
// back in a bucket no lease draws on; where the tokens out change nothing
// (no record, no wait), these steps are its own, and where they do, they
// repeat its arithmetic with the cap that the tokens out put on the
// level: takeAll is bucket.TakeAll with its ban reckoning with the tokens
// out, takeWaiting and goTogether are bucket's with the level so capped,
// giveBack is bucket.GiveBack above a floor.

// take decides a request against one limit as if there were no ban
// setting, as package bucket does; a request that waits (max_wait)
// reckons with the tokens out on lease (takeWaiting).
func take(s bucket.State, now int64, l bucket.Limit, cost int64, held []Held) (bucket.State, bucket.Result) {
	s = s.Read(now, l)
	if l.MaxWait > 0 && len(held) > 0 && !(s.Banned && s.Overdrawn(now, l)) {
		return takeWaiting(s, now, l, cost, held)
	}
	l.Ban = 0 // the caller bans, when the tokens out leave the bucket short
	next, r := bucket.Take(s, now, l, cost)
	banRetry(s, now, l, cost, held, &r)
	return next, r
}

// banRetry sets the retry of a request of cost that a ban refuses, on a
// limit with MaxWait, to when it goes on within MaxWait once the ban is
// over on the level as the tokens out on lease cap it (waitSettled):
// bucket's retryBanned reckons with no cap, and a request whose cost needs
// tokens a record still holds out waits for it to go as well.
func banRetry(s bucket.State, now int64, l bucket.Limit, cost int64, held []Held, r *bucket.Result) {
	if r.Allowed || l.MaxWait == 0 || len(held) == 0 || !(s.Banned && s.Overdrawn(now, l)) {
		return
	}
	need := cost * l.Rate.Interval
	w := waitSettled(s, now, l, need, held, untilHolds(s, now, l, need))
	r.RetryAfter = max(r.RetryAfter, w-l.MaxWait)
}

// takeAll is bucket.TakeAll for a shared bucket of which nodes hold
// tokens on lease: a denial starts a ban only when a limit lacks the cost
// even with those tokens counted, so that only a request one bucket would
// deny starts one.
func takeAll(states []bucket.State, now int64, ls []bucket.Limit, cost int64, out []bucket.Result, held []Held) bool {
	var next [bucket.MaxLimits]bucket.State
	allowed := true
	for i, l := range ls {
		states[i] = states[i].Read(now, l)
		next[i], out[i] = take(states[i], now, l, cost, held)
		allowed = allowed && out[i].Allowed
	}
	if !allowed {
		// One bucket would refuse too, and ban, only when a limit lacks
		// the cost even with the tokens out counted.
		bucket.Refuse(states, now, ls, cost, out, ls[0].Ban > 0 && short(states, now, ls, cost, outOf(held)))
		for i, l := range ls {
			banRetry(states[i], now, l, cost, held, &out[i])
		}
		return false
	}
	goTogether(states, next[:len(ls)], now, ls, cost, out, held)
	copy(states, next[:len(ls)])
	return true
}

// short reports whether some limit lacks cost tokens at now even with held
// more: banned or in debt, or its level and held short of the cost. With
// MaxWait, short of it by more than MaxWait refills: what take refuses.
// Without tokens out, it is what a refusal means.
func short(states []bucket.State, now int64, ls []bucket.Limit, cost, held int64) bool {
	for i, l := range ls {
		s, extra := states[i], min(held, l.Capacity)*l.Rate.Interval
		if l.MaxWait > 0 {
			if s.Banned && s.Overdrawn(now, l) || s.RawDeficit(now, l)+cost*l.Rate.Interval-l.Units()-extra > l.MaxWait*l.Rate.Tokens {
				return true
			}
			continue
		}
		level := l.Units() - s.Deficit(now, l)
		if s.Overdrawn(now, l) || level+extra < cost*l.Rate.Interval {
			return true
		}
	}
	return false
}

// takeWaiting is bucket's take with MaxWait in a shared bucket: the level
// never refills over the tokens out on lease (held) while the request
// waits, so it goes on when the level, so capped, holds its cost
// (waitSettled), and its cost is taken then, from the level as it will
// be, so that the refill the cap loses meanwhile is not counted twice.
func takeWaiting(s bucket.State, now int64, l bucket.Limit, cost int64, held []Held) (bucket.State, bucket.Result) {
	raw := s.RawDeficit(now, l)
	need := cost * l.Rate.Interval
	var w int64
	if lack := raw + need - l.Units(); lack > 0 {
		w = bucket.CeilDiv(lack, l.Rate.Tokens)
	}
	w = waitSettled(s, now, l, need, held, w)
	if w > l.MaxWait {
		return s, bucket.Result{
			Remaining:  max(0, l.Units()-raw) / l.Rate.Interval,
			RetryAfter: w - l.MaxWait,
			ResetAfter: bucket.CeilDiv(raw, l.Rate.Tokens),
		}
	}
	if cost == 0 {
		return s, bucket.Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-raw) / l.Rate.Interval, ResetAfter: bucket.CeilDiv(raw, l.Rate.Tokens)}
	}
	next := bucket.StateAt(now+w, settledDeficit(s, now, now+w, l, held)+need, l)
	return next, bucket.Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-raw-need) / l.Rate.Interval, ResetAfter: next.FullAt - now}
}

// settledDeficit is the deficit of limit l of a shared bucket, in state s
// at now, at t (not before now) as the bucket will have it if nothing
// else happens: refilling, but never over the tokens out on lease (held),
// each record's counted until it expires (Shared's settle).
func settledDeficit(s bucket.State, now, t int64, l bucket.Limit, held []Held) int64 {
	d := max(s.RawDeficit(t, l), floorAt(held, t, l, false))
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
func floorAt(held []Held, t int64, l bucket.Limit, at bool) int64 {
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
func waitSettled(s bucket.State, now int64, l bucket.Limit, need int64, held []Held, w int64) int64 {
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
		w += bucket.CeilDiv(lack, l.Rate.Tokens)
	}
	return w
}

// goTogether is bucket's: a request of several limits that waits takes
// its cost from every limit when the slowest lets it go on, here from the
// level as the tokens out on lease will have capped it by then. It
// rewrites next, the states after the take, from states, those before.
func goTogether(states, next []bucket.State, now int64, ls []bucket.Limit, cost int64, out []bucket.Result, held []Held) {
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
			out[i].Wait = w
			out[i].Remaining = max(0, l.Units()-d) / l.Rate.Interval
			continue
		}
		next[i] = bucket.StateAt(now+w, d+need, l)
		out[i] = bucket.Result{Allowed: true, Wait: w, Remaining: max(0, l.Units()-d-need) / l.Rate.Interval, ResetAfter: next[i].FullAt - now}
	}
}

// peekRefused reports the limits of a request a quota refused, taking
// nothing, as package bucket does: as they stand, and, for a limit that
// would refuse too, when it would not.
func peekRefused(states []bucket.State, now int64, ls []bucket.Limit, cost int64, held []Held, out []bucket.Result) {
	for i, l := range ls {
		_, r := take(states[i], now, l, cost, held)
		out[i] = bucket.Peek(states[i], now, l)
		if !r.Allowed {
			out[i].RetryAfter = r.RetryAfter
		}
		out[i].Allowed = false
	}
}

// giveBack is bucket.GiveBack for a bucket that must go on lacking at
// least floor units: the tokens out on lease.
func giveBack(s bucket.State, now int64, l bucket.Limit, n, floor int64) bucket.State {
	s = s.Read(now, l)
	if n <= 0 || bannedSince(s, now) {
		return s
	}
	raw := s.RawDeficit(now, l)
	d := max(raw-min(n, l.Capacity)*l.Rate.Interval, min(floor, raw))
	if d <= 0 {
		return bucket.State{}
	}
	return bucket.StateAt(now, d, l)
}

// untilHolds is the microseconds until the bucket in state s holds x
// units: 0 when it does now, else at least 1.
func untilHolds(s bucket.State, now int64, l bucket.Limit, x int64) int64 {
	if !s.Overdrawn(now, l) && l.Units()-s.Deficit(now, l) >= x {
		return 0
	}
	return max(1, s.FullAt-now-(l.Units()-x+s.Slack)/l.Rate.Tokens)
}

// bannedSince reports whether a ban emptied the bucket since a request was
// last allowed, as package bucket reads the mark: a bucket full again is
// no bucket, ban or not.
func bannedSince(s bucket.State, now int64) bool { return s.Banned && s.FullAt > now }

// outOf is the tokens the records hold.
func outOf(held []Held) int64 {
	var n int64
	for _, h := range held {
		n += h.Tokens
	}
	return n
}
