package buckettest

import "github.com/bramsley/caddy-ratelimit/internal/bucket"

// A shared bucket's calendar quotas (package bucket's quota.go): counted
// in the same step as its limits, leases included.

// TakeWithQuotas applies a request to every limit and every quota of a
// bucket at once: it takes cost from each, or from none. A quota that
// lacks the cost refuses the request, taking nothing and starting no ban;
// a limit that refuses it leaves the quotas as they were.
func (sh *Shared) TakeWithQuotas(now int64, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) bool {
	sh.quotas(qs)
	next := make([]bucket.QuotaState, len(qs))
	fits := true
	for i, q := range qs {
		next[i], qout[i] = bucket.TakeQuota(sh.Quotas[i], now, q, cost)
		fits = fits && qout[i].Allowed
	}
	if !fits {
		sh.settle(now, ls)
		peekRefused(sh.Levels, now, ls, cost, sh.Held, out)
		for i := range qs {
			if qout[i].Allowed {
				qout[i] = bucket.PeekQuota(sh.Quotas[i], now, qs[i])
				qout[i].Allowed = false
			}
		}
		return false
	}
	if !sh.Take(now, ls, cost, out) {
		for i := range qs {
			qout[i] = bucket.PeekQuota(sh.Quotas[i], now, qs[i])
			qout[i].Allowed = false
		}
		return false
	}
	copy(sh.Quotas, next)
	return true
}

// refundHeld returns n tokens of the lease h that its node never spent to
// each quota that counted them while the period that did lasts: the one
// that holds the end of the earliest of their periods (QStop) holds now.
// A quota counts what was admitted, ban or not.
func (sh *Shared) refundHeld(now int64, qs []bucket.Quota, h Held, n int64) {
	if n <= 0 || h.QStop == 0 {
		return
	}
	for i, q := range qs {
		if h.Mask&(1<<q.Period) != 0 {
			sh.Quotas[i] = bucket.GiveBackQuota(sh.Quotas[i], now, h.QStop-1, q, n)
		}
	}
}

// quotas makes room for the counts of qs.
func (sh *Shared) quotas(qs []bucket.Quota) {
	for len(sh.Quotas) < len(qs) {
		sh.Quotas = append(sh.Quotas, bucket.QuotaState{})
	}
}

// PeekQuotas reports each quota as it stands at now.
func (sh *Shared) PeekQuotas(now int64, qs []bucket.Quota, qout []bucket.Result) {
	sh.quotas(qs)
	for i, q := range qs {
		qout[i] = bucket.PeekQuota(sh.Quotas[i], now, q)
	}
}

// GiveBackQuotas returns n tokens a request took at the moment at to each
// quota's count, while that period lasts: a quota counts what was
// admitted, so a give-back returns there, ban or not.
func (sh *Shared) GiveBackQuotas(now, at int64, qs []bucket.Quota, n int64) {
	sh.quotas(qs)
	for i, q := range qs {
		sh.Quotas[i] = bucket.GiveBackQuota(sh.Quotas[i], now, at, q, n)
	}
}

// ChargeQuotas counts n more tokens in each quota, after the fact.
func (sh *Shared) ChargeQuotas(now int64, qs []bucket.Quota, n int64) {
	sh.quotas(qs)
	for i, q := range qs {
		sh.Quotas[i] = bucket.ChargeQuota(sh.Quotas[i], now, q, n)
	}
}

// QuotaStop is the end of the earliest of the quotas' periods at now, and
// the quotas as a mask of their periods' bits; 0, 0 for none.
func QuotaStop(now int64, qs []bucket.Quota) (stop int64, mask uint8) {
	for i, q := range qs {
		_, end := q.Bounds(now)
		if i == 0 || end < stop {
			stop = end
		}
		mask |= 1 << q.Period
	}
	return stop, mask
}

// Next is, after an allowed take of cost, the microseconds until every
// limit and quota holds cost again: 0 when they do now. Until then the
// same request is denied, which a node's deny cache may remember.
func (sh *Shared) Next(now int64, ls []bucket.Limit, qs []bucket.Quota, cost int64) int64 {
	sh.quotas(qs)
	return max(sh.wait(now, ls, cost), sh.quotaWait(now, qs, cost, ""))
}

// quotaWait is the microseconds until every quota has x tokens left: 0
// when they do, else the end of the period of one that has not.
//
// Tokens out on lease that a quota counted come back to it by the time
// their records expire, or count as spent then: when they would cover x,
// the wait ends then, not at the period's end. Those of the node that asks
// (node) are its own to spend, and do not count.
func (sh *Shared) quotaWait(now int64, qs []bucket.Quota, x int64, node string) int64 {
	var w int64
	for i, q := range qs {
		_, r := bucket.TakeQuota(sh.Quotas[i], now, q, x)
		if r.Allowed {
			continue
		}
		wait := r.RetryAfter
		if out, last := sh.outIn(now, q, node); out > 0 && r.Remaining+out >= x {
			wait = min(wait, max(1, last-now))
		}
		w = max(w, wait)
	}
	return w
}

// outIn is the tokens out on lease, on nodes other than node, that q
// counted in its period at now, and the latest expiry of their records.
func (sh *Shared) outIn(now int64, q bucket.Quota, node string) (out, last int64) {
	start, end := q.Bounds(now)
	for _, h := range sh.Held {
		if h.Tokens > 0 && h.Node != node && h.Mask&(1<<q.Period) != 0 && h.QStop > start && h.QStop <= end {
			out += h.Tokens
			last = max(last, h.Expires)
		}
	}
	return out, last
}

// ReportEach writes what a lease call tells the node of each limit and
// then each quota: its remaining (0 for a banned limit) and reset after.
func (sh *Shared) ReportEach(now int64, ls []bucket.Limit, qs []bucket.Quota, out []bucket.Result) {
	sh.quotas(qs)
	for i, l := range ls {
		r := bucket.Peek(sh.Levels[i], now, l)
		out[i] = bucket.Result{Remaining: r.Remaining, ResetAfter: r.ResetAfter}
	}
	for j, q := range qs {
		r := bucket.PeekQuota(sh.Quotas[j], now, q)
		out[len(ls)+j] = bucket.Result{Remaining: r.Remaining, ResetAfter: r.ResetAfter}
	}
}
