// Package buckettest holds the models every store is tested against: the
// reference bucket (the formula, in exact rationals) with its random
// traces, and the shared bucket a fleet leases from, which the Redis
// script (internal/redisbucket) is held to step for step. Only tests
// import it (TestOnlyTestsImportBuckettest).
package buckettest

import (
	"slices"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// A shared bucket: the bucket of a store that a fleet of nodes shares and
// leases from (docs/fleet.md). It is the plain bucket of package bucket,
// one State per limit, plus the tokens each node holds on lease. The Redis
// script applies these same steps, and the tests hold the two to each
// other.
//
// Tokens a node holds are out of the shared level but not spent yet. Were
// the level free to refill to the capacity meanwhile, the holders could
// spend the capacity plus what they hold in one instant, which a single
// bucket never allows. So the level never exceeds the capacity minus the
// tokens out on lease: the refill while it sits at that cap is lost, as it
// is when a bucket is full. A lease's record expires a while after the node
// stopped spending it (lease_ttl + timeout); its tokens then count as spent.
// A give-back names the lease it returns and only ever returns tokens that
// lease took, never into a bucket that a ban emptied since.

// Shared is a shared bucket.
type Shared struct {
	// Levels is each limit's state, as a single bucket keeps it.
	Levels []bucket.State
	// Held is what each node holds on lease, at most one record a node.
	Held []Held
	// Quotas are the counts of the bucket's calendar quotas.
	Quotas []bucket.QuotaState
}

// Held is what one node holds of a shared bucket.
type Held struct {
	Node string
	// Tokens are the tokens out: leased, and not given back or reported
	// spent.
	Tokens int64
	// Expires is when the tokens count as spent (µs).
	Expires int64
	// Seq is the node's number for the lease call that wrote the record;
	// a give-back must name it.
	Seq int64
	// Void is set when a ban starts: the tokens stay out until they expire
	// or the node reports them spent, but a give-back returns nothing.
	Void bool
	// QStop is, when the bucket's quotas counted the tokens, the end of
	// the earliest of their periods: the node may not spend them past it,
	// and only before it does a give-back return them to the quotas that
	// Mask names (a bit 1<<Period each). 0 when no quota counted them.
	QStop int64
	Mask  uint8
}

// Out is the tokens out on lease.
func (sh *Shared) Out() int64 { return outOf(sh.Held) }

// find is the index of node's record, or -1.
func (sh *Shared) find(node string) int {
	return slices.IndexFunc(sh.Held, func(h Held) bool { return h.Node == node })
}

// settle brings the bucket to now: records that expired since count as
// spent, and each level refills, up to its capacity less the tokens then
// out, across those expiries in order.
func (sh *Shared) settle(now int64, ls []bucket.Limit) {
	for i, l := range ls {
		sh.Levels[i] = sh.Levels[i].Read(now, l)
	}
	for {
		j := -1
		for i, h := range sh.Held {
			if h.Expires <= now && (j < 0 || h.Expires < sh.Held[j].Expires) {
				j = i
			}
		}
		if j < 0 {
			break
		}
		sh.capAt(sh.Held[j].Expires, ls)
		sh.Held = slices.Delete(sh.Held, j, j+1)
	}
	sh.capAt(now, ls)
}

// capAt holds every level at or under its capacity less the tokens out, at
// time t.
func (sh *Shared) capAt(t int64, ls []bucket.Limit) {
	out := sh.Out()
	if out == 0 {
		return
	}
	for i, l := range ls {
		floor := min(out, l.Capacity) * l.Rate.Interval
		if sh.Levels[i].Deficit(t, l) < floor {
			banned := bannedSince(sh.Levels[i], t)
			sh.Levels[i] = bucket.StateAt(t, floor, l)
			sh.Levels[i].Banned = banned
		}
	}
}

// Life is how long after now the bucket must be kept: until every lease
// has expired and every limit is full again, refilling from the cap each
// expiry leaves. Past it, no bucket is the same as this one.
func (sh Shared) Life(now int64, ls []bucket.Limit) int64 {
	sh.Levels = slices.Clone(sh.Levels)
	sh.Held = slices.Clone(sh.Held)
	var last int64
	for _, h := range sh.Held {
		last = max(last, h.Expires)
	}
	sh.settle(max(now, last), ls)
	for _, s := range sh.Levels {
		last = max(last, s.FullAt)
	}
	return max(0, last-now)
}

// floor is, for a limit, the units it must lack: the tokens out.
func (sh *Shared) floor(l bucket.Limit) int64 {
	return min(sh.Out(), l.Capacity) * l.Rate.Interval
}

// voidAll marks every record: a ban started.
func (sh *Shared) voidAll() {
	for i := range sh.Held {
		sh.Held[i].Void = true
	}
}

// banHolds reports whether a ban holds some limit empty at now: its
// refill has not begun.
func (sh *Shared) banHolds(now int64, ls []bucket.Limit) bool {
	for i, l := range ls {
		if s := sh.Levels[i]; s.Banned && s.Overdrawn(now, l) {
			return true
		}
	}
	return false
}

// Banned reports whether a ban emptied the bucket since a request was last
// allowed.
func (sh *Shared) Banned(now int64) bool {
	return slices.ContainsFunc(sh.Levels, func(s bucket.State) bool { return bannedSince(s, now) })
}

// Take applies a request of one node that holds no lease for it: TakeAll on
// the levels. It starts a ban only when the bucket lacks the cost even
// with the tokens out on lease, as one bucket would then deny too; a ban
// voids every lease's give-back.
func (sh *Shared) Take(now int64, ls []bucket.Limit, cost int64, out []bucket.Result) bool {
	sh.settle(now, ls)
	allowed := takeAll(sh.Levels, now, ls, cost, out, sh.Held)
	if slices.ContainsFunc(out[:len(ls)], func(r bucket.Result) bool { return r.Banned }) {
		sh.voidAll()
	}
	return allowed
}

// Peek reports each limit as it stands at now, changing nothing stored.
func (sh Shared) Peek(now int64, ls []bucket.Limit, out []bucket.Result) {
	sh.Levels = slices.Clone(sh.Levels)
	sh.Held = slices.Clone(sh.Held)
	sh.settle(now, ls)
	for i, l := range ls {
		out[i] = bucket.Peek(sh.Levels[i], now, l)
	}
}

// Lease takes tokens for a node to spend on its own. The node first says
// what it still holds of its earlier leases, so that the record tracks
// what is really out. When every limit holds the cost, the node gets
// min(want, the least level), but never so many that the tokens out pass
// half the smallest capacity (tokens idle on some nodes must not starve a
// client under its limit on another), and never fewer than the cost. When
// a limit is short, nothing is granted; with a ban, the bucket is emptied
// for it when it lacks the cost even with the tokens out counted, since
// one bucket would then refuse the request too (otherwise the nodes still
// hold tokens, and a client under its limit would be banned). A short or refused lease says how long until the
// bucket holds what was asked.
func (sh *Shared) Lease(now int64, ls []bucket.Limit, a bucket.LeaseAsk) bucket.LeaseResult {
	return sh.LeaseQuotas(now, ls, nil, a)
}

// LeaseQuotas is Lease on a bucket with calendar quotas too: each counts
// the tokens granted when they are granted, and bounds the grant by what
// it has left. A quota that lacks the cost refuses the lease, starting no
// ban, and holds the node off until its period ends. Leased tokens may be
// spent until the end of the quota period that counted them (Until): a
// node's tokens of a period that has ended are dropped.
func (sh *Shared) LeaseQuotas(now int64, ls []bucket.Limit, qs []bucket.Quota, a bucket.LeaseAsk) bucket.LeaseResult {
	sh.settle(now, ls)
	sh.quotas(qs)
	var res bucket.LeaseResult
	qstop, mask := QuotaStop(now, qs)
	mine := sh.find(a.Node)
	if mine >= 0 {
		h := &sh.Held[mine]
		h.Tokens = min(h.Tokens, max(a.Held, 0))
		switch {
		case h.Mask != 0 && h.QStop <= now:
			// Counted in a period that has ended: the node may not spend
			// them, and drops them. A longer quota's period that goes on
			// gets them back.
			sh.refundHeld(now, qs, *h, h.Tokens)
			res.Drop, h.Tokens = true, 0
		case h.Void:
			// A ban voided them: the node drops them, and gives back what
			// it did not spend (it may spend some while this call is out).
			res.Drop, res.Void = true, h.Tokens > 0
		}
	}
	if len(qs) > 0 {
		res.Until = qstop - now
	}
	quotaWait := sh.quotaWait(now, qs, a.Cost, a.Node)
	allowed := quotaWait == 0
	for i, l := range ls {
		l.MaxWait = 0 // a lease takes only tokens that are there
		_, r := take(sh.Levels[i], now, l, a.Cost, nil)
		allowed = allowed && r.Allowed
	}
	if !allowed {
		want := a.Want
		if quotaWait == 0 && ls[0].Ban > 0 && !a.Prefetch && short(sh.Levels, now, ls, a.Cost, sh.Out()) {
			for i, l := range ls {
				var r bucket.Result
				sh.Levels[i], r = bucket.Ban(sh.Levels[i], now, l, a.Cost*l.Rate.Interval)
				res.Banned = res.Banned || r.Banned
			}
			if res.Banned {
				sh.voidAll()
			}
			// The node drops what it holds, gives back what it did not
			// spend (Void), and starts again after the ban from one
			// request's cost.
			res.Drop, want = true, a.Cost
			res.Void = mine >= 0 && sh.Held[mine].Tokens > 0
		}
		if mine >= 0 && sh.Held[mine].Tokens == 0 {
			sh.Held = slices.Delete(sh.Held, mine, mine+1)
		} else if mine >= 0 {
			// The node's next give-back names this call.
			sh.Held[mine].Seq = a.Seq
		}
		limitWait := sh.wait(now, ls, a.Cost)
		if ls[0].MaxWait > 0 && sh.banHolds(now, ls) {
			skip := ""
			if res.Drop {
				skip = a.Node // its tokens go: it drops them, giving back what it did not spend
			}
			limitWait = sh.retryWaiting(now, ls, a.Cost, skip)
		}
		res.LimitRetry = limitWait
		res.RetryAfter = max(limitWait, quotaWait)
		res.HoldOff = max(limitWait, sh.wait(now, ls, want))
		res.QuotaHold = quotaWait
		sh.report(now, ls, qs, &res)
		return res
	}
	if res.Void {
		// The node gives back what the ban left it first: its record
		// names this call, and nothing is granted beside it.
		sh.Held[mine].Seq = a.Seq
		sh.report(now, ls, qs, &res)
		return res
	}
	grant := min(a.Want, sh.room(ls)-sh.Out())
	for i, l := range ls {
		grant = min(grant, (l.Units()-sh.Levels[i].Deficit(now, l))/l.Rate.Interval)
	}
	for i, q := range qs {
		// Half of what a quota has left at most, so that the last of it
		// is never idle on one node while another's client is refused.
		grant = min(grant, max(a.Cost, bucket.PeekQuota(sh.Quotas[i], now, q).Remaining/2))
	}
	grant = max(grant, a.Cost)
	for i, l := range ls {
		sh.Levels[i] = bucket.StateAt(now, sh.Levels[i].Deficit(now, l)+grant*l.Rate.Interval, l)
	}
	for i, q := range qs {
		sh.Quotas[i], _ = bucket.TakeQuota(sh.Quotas[i], now, q, grant)
	}
	if mine < 0 {
		sh.Held = append(sh.Held, Held{Node: a.Node})
		mine = len(sh.Held) - 1
	}
	h := &sh.Held[mine]
	h.Tokens += grant - min(a.Spend, grant)
	h.Expires, h.Seq, h.Void = now+a.Hold, a.Seq, false
	h.QStop, h.Mask = qstop, mask
	if h.Tokens == 0 {
		// All spent at once: nothing is out.
		sh.Held = slices.Delete(sh.Held, mine, mine+1)
	}
	res.Granted = grant
	if grant < a.Want && sh.wait(now, ls, a.Cost) > 0 {
		// The shared bucket cannot cover a request now: no call before it
		// covers the node's next lease. While it can, a grant cut short by
		// the tokens out on lease or a quota's half holds nobody off.
		res.HoldOff = sh.wait(now, ls, a.Want)
	}
	// A quota the grant used up refuses the next request until its
	// period ends, as a limit's refill does.
	res.QuotaHold = sh.quotaWait(now, qs, a.Cost, a.Node)
	res.LimitRetry = sh.wait(now, ls, a.Cost)
	res.RetryAfter = max(res.LimitRetry, res.QuotaHold)
	sh.report(now, ls, qs, &res)
	return res
}

// room is the most tokens that may be out on lease at once: half the
// smallest capacity.
func (sh *Shared) room(ls []bucket.Limit) int64 {
	c := ls[0].Capacity
	for _, l := range ls[1:] {
		c = min(c, l.Capacity)
	}
	return c / 2
}

// wait is the microseconds until every limit holds x tokens: 0 when they
// do now. The cap that leases put on the level may make it longer; a node
// that asks too early is answered with a new wait.
func (sh *Shared) wait(now int64, ls []bucket.Limit, x int64) int64 {
	var w int64
	for i, l := range ls {
		w = max(w, untilHolds(sh.Levels[i], now, l, x*l.Rate.Interval))
	}
	return w
}

// retryWaiting is, on a tier with max_wait that a ban holds, when a
// request of cost may come back: when every limit lets it go on within
// max_wait once the ban is over (take's RetryAfter, which strict mode
// answers), not when each holds the cost, up to max_wait later. The
// tokens out on lease cap the level meanwhile, save skip's, which its
// node drops.
func (sh *Shared) retryWaiting(now int64, ls []bucket.Limit, cost int64, skip string) int64 {
	held := sh.Held
	if skip != "" {
		held = slices.DeleteFunc(slices.Clone(held), func(h Held) bool { return h.Node == skip })
	}
	var w int64
	for i, l := range ls {
		if _, r := take(sh.Levels[i], now, l, cost, held); !r.Allowed {
			w = max(w, r.RetryAfter)
		}
	}
	return w
}

// report fills in the levels a lease result tells the node: the least
// remaining, of limits and quotas, and the latest reset of a limit.
func (sh *Shared) report(now int64, ls []bucket.Limit, qs []bucket.Quota, res *bucket.LeaseResult) {
	res.BanHolds = sh.banHolds(now, ls)
	for i, l := range ls {
		r := bucket.Peek(sh.Levels[i], now, l)
		if i == 0 || r.Remaining < res.Remaining {
			res.Remaining = r.Remaining
		}
		res.ResetAfter = max(res.ResetAfter, r.ResetAfter)
	}
	for i, q := range qs {
		res.Remaining = min(res.Remaining, bucket.PeekQuota(sh.Quotas[i], now, q).Remaining)
	}
}

// Return is a node's give-back of the unused tokens of its lease: the lease
// call seq wrote its record. The record goes; up to n of its tokens go back
// to the levels, unless a ban started since. A record that a later call
// rewrote, or that expired, returns nothing: those tokens are lost, which
// only ever admits less. It reports the tokens returned.
func (sh *Shared) Return(now int64, ls []bucket.Limit, node string, seq, n int64) int64 {
	return sh.ReturnQuotas(now, ls, nil, node, seq, n)
}

// ReturnQuotas is Return on a bucket with quotas too: the tokens go back
// to each quota that counted them, ban or not, while the period that
// counted them lasts (a quota counts what was admitted).
func (sh *Shared) ReturnQuotas(now int64, ls []bucket.Limit, qs []bucket.Quota, node string, seq, n int64) int64 {
	sh.settle(now, ls)
	sh.quotas(qs)
	j := sh.find(node)
	if j < 0 || sh.Held[j].Seq != seq {
		return 0
	}
	h := sh.Held[j]
	sh.Held = slices.Delete(sh.Held, j, j+1)
	n = min(n, h.Tokens)
	sh.refundHeld(now, qs, h, n)
	if h.Void || n <= 0 || sh.Banned(now) {
		return 0
	}
	for i, l := range ls {
		sh.Levels[i] = giveBack(sh.Levels[i], now, l, n, sh.floor(l))
	}
	return n
}

// GiveBack returns n tokens a request took outside any lease (count_status),
// as GiveBack does, and never past the cap that the tokens out set.
func (sh *Shared) GiveBack(now int64, ls []bucket.Limit, n int64) {
	sh.settle(now, ls)
	if sh.Banned(now) {
		return
	}
	for i, l := range ls {
		sh.Levels[i] = giveBack(sh.Levels[i], now, l, n, sh.floor(l))
	}
}

// Charge takes n more tokens from every limit after the fact, as Charge
// does. It returns how long until every limit is out of debt again (holds
// no fewer than 0 tokens; a ban counts as debt until it ends), 0 when none
// is in debt: a node that admitted requests on credit keeps the key that
// long (internal/redisbucket/lease_credit.go).
func (sh *Shared) Charge(now int64, ls []bucket.Limit, n int64) int64 {
	sh.settle(now, ls)
	var debt int64
	for i, l := range ls {
		sh.Levels[i] = bucket.Charge(sh.Levels[i], now, l, n)
		debt = max(debt, debtLeft(sh.Levels[i], now, l))
	}
	return debt
}

// debtLeft is how long until the bucket in state s holds 0 tokens or
// more, 0 when it does (bucket.State's Overdrawn, timed).
func debtLeft(s bucket.State, now int64, l bucket.Limit) int64 {
	s = s.Read(now, l)
	return max(0, s.FullAt-now-(l.Units()+s.Slack)/l.Rate.Tokens)
}
