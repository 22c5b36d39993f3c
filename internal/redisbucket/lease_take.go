package redisbucket

import (
	"context"
	"fmt"
	"math"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// A request decided from the lease table (lease.go): from the tokens this
// node holds, by a lease call it makes or joins, or refused from memory;
// and the answer it reports.

// take decides one request from this node's lease on the bucket at key,
// on every limit and quota of its tier at once, fetching a lease when the
// tokens held do not cover it. With max_wait, a request the leases refuse
// takes its tokens in the shared bucket as strict mode does, waiting, or
// is refused by it. It writes each limit's and quota's result into out
// (room for tr.Parts()), and returns the binding one.
func (t *leaseTable) take(ctx context.Context, key []byte, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, error) {
	return t.takeNamed(ctx, key, 0, tr, cost, out)
}

// takeNamed is take for a request that also gives the bucket's id, the
// caller's 64-bit hash of its name, one to one with key: the entry is
// found by it next time (takeByID). 0 gives none.
func (t *leaseTable) takeNamed(ctx context.Context, key []byte, id uint64, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, error) {
	res, err := t.takeHeld(ctx, key, id, tr, cost, out)
	if err != nil || res.Allowed || tr.First().MaxWait == 0 || res.Banned {
		return res, err
	}
	// The refusal may be this node's hold-off, which spaces its calls,
	// not the shared bucket's level: ask the shared bucket, as strict
	// mode does; the deny cache keeps a flood of refusals off Redis.
	// A give-back of tokens a ban voided, which the call that found the
	// ban sent, lands first: until it does, their record caps the level,
	// and the refusal would say retry when it expires. The wait and the
	// call after it share one timeout, as a strict decision has
	// (TestARefusedRequestWaitingOnAGiveBackEndsWhileRedisIsStopped).
	if done := t.returningOf(key); done != nil {
		if t.timeout > 0 {
			within, cancel := context.WithTimeout(ctx, t.timeout)
			defer cancel()
			ctx = within
		}
		if err := awaitReturning(ctx, done); err != nil {
			return bucket.Result{}, err
		}
	}
	res, each, err := t.store.reserve(ctx, string(key), tr, cost)
	if len(out) == 1 {
		out[0] = res
	} else {
		copy(out, each)
	}
	if err == nil && res.Allowed {
		t.reserved(key, cost)
	}
	return res, err
}

// returningOf is the give-back of the bucket at key that this node has
// in flight, if any: nil when none, or when it has been answered.
func (t *leaseTable) returningOf(key []byte) chan struct{} {
	sh := t.shard(key)
	sh.mu.Lock()
	var done chan struct{}
	if e := sh.m[string(key)]; e != nil {
		done = e.returning
	}
	sh.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	default:
		return done
	}
}

// awaitReturning waits for the give-back done, within ctx.
func awaitReturning(ctx context.Context, done chan struct{}) error {
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("redis store: lease: waiting for a give-back: %w", ctx.Err())
	}
}

// reserved notes that a request took cost tokens of the bucket at key in
// the shared bucket, not from this node's lease: their give-back goes
// back there (giveBackHeld).
func (t *leaseTable) reserved(key []byte, cost int64) {
	sh := t.shard(key)
	sh.mu.Lock()
	if e := sh.m[string(key)]; e != nil {
		e.reserved += cost
	}
	sh.mu.Unlock()
}

// takeHeld is take without max_wait: from the tokens held, or refused.
func (t *leaseTable) takeHeld(ctx context.Context, key []byte, id uint64, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, error) {
	sh := t.shard(key)
	sh.mu.Lock()
	if t.closed.Load() {
		// A request still in flight through an unloaded config: it starts
		// no lease, whose tokens no one would give back.
		sh.mu.Unlock()
		return bucket.Result{}, errLeasesClosed
	}
	now := t.now()
	e := t.entry(sh, key, tr, now)
	if id != 0 {
		t.hint(e, id)
	}
	if res, ok := t.credited(e, cost, now, out); ok {
		sh.mu.Unlock()
		return res, nil
	}
	ban := tr.First().Ban
	waited := false
	// backlog is what the requests that waited on the last call cost
	// together: the next call asks for them all (up to a lease), not for
	// one request's cost.
	backlog := int64(0)
	for {
		if e.tokens >= cost && !t.lapsed(e, now) {
			res := t.spend(e, cost, now)
			e.fill(out, res, now, cost)
			sh.mu.Unlock()
			return res, nil
		}
		if t.refuses(e, ban, cost, now, waited) {
			if ban == 0 && !waited && e.call == nil && now >= e.holdUntil && now >= e.quotaUntil && now >= e.banUntil && now >= e.quietUntil {
				// Refused by emptyUntil alone: the next lease comes in
				// the background, for the requests after this one, unless
				// such a call failed (quietUntil,
				// TestAFailedBackgroundCallBesideAnEmptyLevelIsNotRetriedAtEveryRequest).
				t.fetch(e, cost, now, true)
			}
			res := e.result(now, false, cost)
			e.fill(out, res, now, cost)
			sh.mu.Unlock()
			return res, nil
		}
		c, mine := e.call, e.call == nil
		if mine {
			e.backlog = backlog
			c = t.fetch(e, cost, now, false)
		} else {
			c.joined++
		}
		sh.mu.Unlock()
		if err := t.await(ctx, sh, c, mine); err != nil {
			return bucket.Result{}, err
		}
		sh.mu.Lock()
		if mine && (c.spent || c.banned) {
			res := e.result(t.now(), c.spent, cost)
			res.Banned = c.banned
			e.fill(out, res, t.now(), cost)
			sh.mu.Unlock()
			return res, nil
		}
		if t.closed.Load() {
			sh.mu.Unlock()
			return bucket.Result{}, errLeasesClosed
		}
		// An answer that shows the shared bucket empty refuses the
		// requests it did not cover, with no second round trip. One that
		// others spent first (a small early lease) leaves the shared
		// bucket holding more: the requests it left uncovered ask again,
		// as strict mode would, in one call for them all. An entry
		// evicted meanwhile gave its tokens back: start again on a new one.
		// Under a ban setting, a request refused by a call made for
		// another (a prefetch, another request's cost) asks the shared
		// store itself, which bans if one bucket would.
		short := c.shortFor(cost)
		backlog = cost * int64(c.joined+1)
		now, waited = t.now(), short && (ban == 0 || mine)
		if next := t.entry(sh, key, tr, now); next != e {
			e, waited = next, false
		}
	}
}

// hintSlots is how many entries the hints find by id: a table of a few
// thousand keys in use finds most of them, at 64 KiB a table.
const hintSlots = 1 << 13

// hint lets the next request for e, of id, find it by id (takeByID). An
// entry keeps the first id given: two ids for one key (which a 64-bit
// collision of two names would take) leave the later one the long way.
func (t *leaseTable) hint(e *lease, id uint64) {
	if e.id == 0 {
		// Before the entry is published: takeByID reads it unlocked.
		e.id = id
	}
	if e.id == id && t.hints[id%hintSlots].Load() != e {
		t.hints[id%hintSlots].Store(e)
	}
}

// takeByID decides a request from the tokens this node holds on the
// bucket of id (takeNamed), without its key: what take does for a request
// that finds its lease live and its cost covered, as most do. Anything
// else (no entry found by id, one dropped since, tokens short or lapsed,
// credit, a closed table) reports false, and the request takes the long
// way, with its key: a request's answer never depends on which way it
// went (TestALeasedRequestFoundByIDIsDecidedAsByKey).
func (t *leaseTable) takeByID(id uint64, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, bool) {
	e := t.hints[id%hintSlots].Load()
	if e == nil || e.id != id {
		return bucket.Result{}, false
	}
	sh := e.shard
	sh.mu.Lock()
	now := t.now()
	if e.gone || t.closed.Load() || e.credit > 0 || e.tokens < cost || t.lapsed(e, now) {
		sh.mu.Unlock()
		return bucket.Result{}, false
	}
	// As entry does; its expire has nothing to give back while the lease
	// has not lapsed.
	e.tier, e.lastUsed = tr, now
	res := t.spend(e, cost, now)
	e.fill(out, res, now, cost)
	sh.mu.Unlock()
	return res, true
}

// spend takes cost from the tokens e holds, and fetches the next lease in
// the background when they fall to half, or when the lease is due for
// renewal (renewAt), so that its requests never find the tokens lapsed and
// wait on a call; under a ban setting, a lease spent is said so at once,
// so that a refusal on another node does not take these tokens for held,
// and bans when one bucket would. A request that needs neither costs two
// comparisons here: the round trip and the quota period are read only
// when a prefetch is due.
func (t *leaseTable) spend(e *lease, cost, now int64) bucket.Result {
	e.tokens -= cost
	switch {
	case (e.tokens*2 < e.size || now >= e.renewAt) && t.prefetches(e, cost, now):
		t.fetch(e, cost, now, true)
	case e.tokens == 0 && e.recorded > 0 && e.tier.First().Ban > 0 && e.call == nil:
		t.giveBackLater([]leaseReturn{e.takeBack()})
	}
	return e.result(now, true, cost)
}

// prefetches says whether a prefetch that is due for e goes now: the lease
// is larger than a request (a first lease of one request's cost is not
// prefetched), no call is out, no hold-off holds, no background call for
// the lease failed (quietUntil: its failure does not count toward the
// breaker, so retrying at every request would pile calls on a Redis that
// cannot answer them, TestAFailedRenewalIsNotRetriedInTheBackground; once
// the lease lapses a request calls itself, and that call counts), and the
// quota period that counted the tokens does not end within two round trips.
func (t *leaseTable) prefetches(e *lease, cost, now int64) bool {
	return e.size > cost && e.call == nil && now >= e.holdUntil && now >= e.quotaUntil && now >= e.quietUntil && !t.periodEndsWithin(e, now, 2*t.roundTripOf(e))
}

// refuses says whether a request that e's tokens do not cover is refused
// from memory, with no call. Under a ban setting it asks the shared store,
// unless a ban is known to hold: one bucket would start the ban at this
// refusal, and so must the shared one. A bucket the fleet oversubscribes
// (the last answer showed the shared level empty) has its refill shared
// out by calls: when a call takes longer than the bucket takes to refill a
// token (a store far away), a request that finds the tokens all
// spent is refused at once rather than wait that round trip on a call
// (takeHeld makes one in the background if none is out), until an answer
// shows the shared level holding a request's cost again, or lease_ttl has
// passed; what the call brings stays for the next requests, so nothing is
// lost, and allowed requests do not wait. With a store close by, the
// request waits on the call, so that a client that comes back at its
// Retry-After is not refused again beside a bucket that holds its cost.
func (t *leaseTable) refuses(e *lease, ban, cost, now int64, waited bool) bool {
	return waited || now < e.banUntil || now < e.quotaUntil || ban == 0 && (now < e.holdUntil || e.emptyFor(cost, now) && t.far(e))
}

// emptyFor says whether the last answer showed the shared level unable to
// cover a request of cost, and still counts (emptyUntil): for the cost of
// the request its call was made for or more, as emptyUntil says; for a
// cheaper one, only when the level it showed is under that cost.
func (e *lease) emptyFor(cost, now int64) bool {
	return now < e.emptyUntil && (cost >= e.retryCost || e.level < cost)
}

// far says whether a call for e takes longer than its bucket takes to
// refill a token: a store far away, where a request that finds the tokens
// spent beside an empty shared level is refused at once rather than wait
// on a call (refuses).
func (t *leaseTable) far(e *lease) bool { return t.roundTripOf(e) > e.tier.Refill(1) }

// roundTripOf is how long a call for e takes (µs): the store's measured
// round trip (rtt.go), or, before it has one or on a store that measures
// none, how long e's last call took.
func (t *leaseTable) roundTripOf(e *lease) int64 {
	if rt := t.roundTrip(); rt > 0 {
		return rt
	}
	return e.rtt
}

// renewFrom is when a request renews the lease granted by a call sent at
// sent (renewAt): a part of lease_ttl before it lapses, from an eighth to
// three eighths, keyed on the bucket, so that keys whose leases were taken
// together renew spread out in time rather than in one wave of calls
// (TestKeysInSteadyUseRenewTheirLeasesSpreadOut), and never later than two
// round trips before it lapses, so that the renewal lands in time (R4 of
// docs/regions.md, TestANodeFetchesItsNextLeaseWhenItsLeaseEndsWithinTwoRoundTrips).
// Never when the quota period that counted the tokens ends first: a call
// that lands before it brings tokens of the same period, which lapse with
// them, and one that lands after it has the shared store drop what the
// node holds, which the limits never get back
// (TestNoLeasedTokenIsLostAcrossAQuotaPeriodsEnd); the give-back of
// lapsed tokens returns them.
func (t *leaseTable) renewFrom(e *lease, sent int64) int64 {
	end := sent + t.ttl
	if e.spendBy != 0 && e.spendBy <= end {
		return never
	}
	return end - max(2*t.roundTripOf(e), t.ttl/8+t.ttl/4*spreadOf(e.key)/1024)
}

// spreadOf is a number from 0 to 1023 that the bucket's key picks, the
// same on every node and in every run.
func spreadOf(key string) int64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(key); i++ {
		h = (h ^ uint64(key[i])) * 1099511628211
	}
	// FNV's high bits barely move with the last bytes: mix them in
	// (murmur3's finalizer).
	h ^= h >> 33
	h *= 0xff51afd7ed558ccd
	h ^= h >> 33
	return int64(h >> 54)
}

// never is a time that never comes.
const never = math.MaxInt64

// periodEndsWithin says whether the quota period that counted the tokens
// e holds ends within d of now. A prefetch then, at half as well as near
// the lease's end, would land after it and have the shared store drop what
// the node holds, which the limits never get back
// (TestNoLeasedTokenIsLostWhenALeaseFallsToHalfJustBeforeItsQuotaPeriodEnds);
// the tokens lapse at the period's end and go back instead.
func (t *leaseTable) periodEndsWithin(e *lease, now, d int64) bool {
	return e.spendBy != 0 && e.spendBy-now <= d
}

// lapsed says whether the tokens e holds may no longer be spent: lease_ttl
// has passed since they were leased, or the quota period that counted
// them has ended.
func (t *leaseTable) lapsed(e *lease, now int64) bool {
	return now-e.leasedAt >= t.ttl || e.spendBy != 0 && now >= e.spendBy
}

// await waits for the call c, or for the request's end. A request that made
// the call and goes away leaves a ban the call starts to be counted
// without it.
func (t *leaseTable) await(ctx context.Context, sh *leaseShard, c *leaseCall, mine bool) error {
	select {
	case <-c.done:
	case <-ctx.Done():
		sh.mu.Lock()
		finished := c.finished
		if !finished {
			c.abandoned = c.abandoned || mine
			if !mine {
				// No longer waiting: the next call, sized for the
				// requests this one left uncovered (backlog), is not
				// for this one.
				c.joined--
			}
		}
		sh.mu.Unlock()
		if !finished {
			return fmt.Errorf("redis store: lease: %w", ctx.Err())
		}
	}
	return c.err
}

// result is the answer for a request decided from e at now. A refused
// request is told to retry when the shared bucket holds its cost, as the
// last call saw it, or, past that, when this node calls again.
func (e *lease) result(now int64, allowed bool, cost int64) bucket.Result {
	res := bucket.Result{Allowed: allowed, Remaining: e.tokens + e.level, ResetAfter: max(0, e.resetAt-now)}
	if allowed {
		return res
	}
	res.Remaining = e.tokens
	res.RetryAfter = max(e.retryAt-now+e.tier.Refill(cost-e.retryCost), e.banUntil-now)
	if e.tier.First().Ban == 0 {
		// No call before the hold-off ends: a retry before then would
		// be refused again.
		res.RetryAfter = max(res.RetryAfter, e.holdUntil-now)
	}
	if res.RetryAfter <= 0 {
		// The call in flight gave too little for every request that
		// waited on it: the shared bucket is empty for now.
		res.RetryAfter = e.tier.Refill(cost)
	}
	return res
}

// fill writes into out each limit's and quota's result for a request of
// cost decided from e at now as res: the same decision, each with its own
// level (beside the tokens held) and reset, as the last call saw them,
// refused or not. On a refusal, as in strict mode, one that holds the
// cost has no retry: a quota with room left is not said used up because a
// limit refused, nor does it bind (bucket.Binding). A lone limit's is res.
func (e *lease) fill(out []bucket.Result, res bucket.Result, now, cost int64) {
	if len(out) == 1 {
		out[0] = res
		return
	}
	short := false
	for i := range out {
		r := &out[i]
		*r = res
		if i < len(e.each) {
			x := e.each[i]
			r.ResetAfter = max(0, x.resetAt-now)
			r.Remaining = e.tokens + max(0, x.level)
			if !res.Allowed && r.Remaining >= cost {
				r.RetryAfter = 0
			} else {
				short = short || !res.Allowed
			}
		}
	}
	if !res.Allowed && !short {
		// Every one held the cost when the last call saw them (a
		// hold-off): each keeps the refusal's retry.
		for i := range out {
			out[i].RetryAfter = res.RetryAfter
		}
	}
}
