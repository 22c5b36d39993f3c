package redisbucket

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/redis/go-redis/v9"
)

// fetch starts a lease call for e, which the caller holds the shard's
// lock for. The call runs apart from any request's context, so that a
// client that hangs up does not fail the others waiting on it.
func (t *leaseTable) fetch(e *lease, cost, now int64, prefetch bool) *leaseCall {
	want := max(cost, e.size)
	if e.size > 0 {
		share := t.ttl
		if prefetch {
			share /= 2
		}
		if now-e.leasedAt <= share {
			want = max(cost, min(2*e.size, t.size.ofTier(e.tier)))
		}
	}
	if e.backlog > 0 {
		// Requests the last call left uncovered, in the shared store's
		// level still: one call for them all, not one each.
		want = max(want, min(e.backlog, t.size.ofTier(e.tier)))
		e.backlog = 0
	}
	size := want
	if prefetch && e.tokens*2 >= e.size {
		// A renewal, not at half: the call renews the tokens held (it
		// names them) and adds a lease, but never past two, so that a key
		// spending less than a lease a lease_ttl does not pile tokens up,
		// and one spending about a lease renews with no prefetch at half
		// between (TestKeysInSteadyUseRenewTheirLeasesSpreadOut).
		want = max(cost, min(size, 2*size-e.tokens))
	}
	c := &leaseCall{done: make(chan struct{})}
	e.call = c
	e.seq = t.seq.Add(1)
	ask := bucket.LeaseAsk{Node: t.node, Seq: e.seq, Held: e.tokens, Cost: cost, Want: want, Hold: t.hold, Prefetch: prefetch}
	c.held = ask.Held
	if !prefetch {
		// The request that makes the call spends its cost from the grant
		// at once, so the shared store need not count it as held.
		ask.Spend = cost
	}
	t.calls.Add(1)
	returning := e.returning
	var since time.Time
	if returning != nil {
		since = time.Now()
	}
	go func(key string, tr bucket.Tier) {
		defer t.calls.Done()
		// A give-back of the bucket still out lands first, and the wait
		// for it and the call share one store timeout, counted from when
		// the call was made (since), as a strict decision has
		// (TestALeaseCallWaitingOnAGiveBackEndsWhileRedisIsStopped).
		ctx := context.Background()
		var err error
		if returning != nil {
			select {
			case <-returning:
			default:
				if t.timeout > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithDeadline(ctx, since.Add(t.timeout))
					defer cancel()
				}
				err = awaitReturning(ctx, returning)
			}
		}
		var each []bucket.Result
		if !tr.Lone() {
			each = make([]bucket.Result, tr.Parts())
		}
		var lr bucket.LeaseResult
		if err == nil {
			lr, err = t.store.lease(ctx, key, tr, ask, each)
		}
		sh := t.shard([]byte(key))
		sh.mu.Lock()
		e.rtt = t.now() - now
		if err == nil && c.reset {
			// An admin reset came while the call was out: the answer may
			// be the deleted bucket's. It puts no tokens in the table and
			// holds no request off: the request that made the call keeps
			// its cost if it was granted, and the others ask the fresh
			// bucket. Tokens the fresh bucket granted beyond that stay out
			// until their lease ends (admits less, never more).
			// The level it reports is a fresh bucket's after that cost.
			granted := min(lr.Granted, ask.Spend)
			lr = bucket.LeaseResult{Granted: granted, Remaining: freshLevel(tr) - granted}
			each = each[:0]
		}
		if err == nil {
			// Redis answered: a failed background call's quiet ends with
			// it (TestANewLeaseAfterAFailedRenewalPrefetchesAgain).
			e.quietUntil = 0
			t.apply(e, lr, ask, size, now)
			e.each = e.each[:0]
			for _, r := range each {
				e.each = append(e.each, levelAt{r.Remaining, now + r.ResetAfter})
			}
			if lr.Granted == 0 && e.tokens == 0 && e.recorded > 0 && tr.First().Ban > 0 {
				// Spent while the call was out: say so, as take does.
				t.giveBackLater([]leaseReturn{e.takeBack()})
			}
		} else if ask.Prefetch {
			// Quiet while the lease lasts, and, for the background call of
			// a request refused beside an empty shared level, while that
			// refuses (takeHeld): after it, a request calls itself.
			e.quietUntil = max(e.leasedAt+t.ttl, e.emptyUntil)
		}
		e.call = nil
		// A refusal says when the cost is back; an answer that grants
		// nothing and says no such time asks the node to give back what
		// a ban voided first, and to ask again (LeaseResult.Void).
		c.err, c.short = err, lr.Remaining < cost || lr.Granted == 0 && lr.RetryAfter > 0
		c.cost, c.level = cost, lr.Remaining
		c.spent = err == nil && lr.Granted > 0 && ask.Spend > 0
		if lr.Banned {
			if c.abandoned || ask.Prefetch {
				if t.onBan != nil {
					t.onBan(key)
				}
			} else {
				c.banned = true
			}
		}
		c.finished = true
		sh.mu.Unlock()
		close(c.done)
	}(e.key, e.tier)
	return c
}

// freshLevel is what a fresh bucket of tr holds: its smallest limit's
// capacity or quota's count.
func freshLevel(tr bucket.Tier) int64 {
	level := int64(math.MaxInt64)
	for _, l := range tr.Limits {
		level = min(level, l.Capacity)
	}
	for _, q := range tr.Quotas {
		level = min(level, q.N)
	}
	return level
}

// apply records in e the answer to the lease call ask, sent at sent, for a
// lease of size tokens.
func (t *leaseTable) apply(e *lease, lr bucket.LeaseResult, ask bucket.LeaseAsk, size, sent int64) {
	e.size = size
	if lr.Drop {
		// A ban started since the last call, or the quota period of what
		// the node holds ended: it is void, and the node starts again from
		// one request's cost. What a ban voided and the node did not
		// spend goes back, so that the quotas count only what was
		// admitted.
		if lr.Void && e.tokens > 0 {
			t.giveBackLater([]leaseReturn{e.takeBack()})
		}
		e.tokens, e.recorded, e.size = 0, 0, 0
	} else {
		e.tokens, e.recorded = min(e.tokens, ask.Held), min(e.recorded, ask.Held)
	}
	if lr.Granted > 0 {
		e.tokens += lr.Granted - ask.Spend
		e.recorded += lr.Granted - ask.Spend
		e.leasedAt = sent
		t.periodOf(e, lr, sent)
		e.renewAt = t.renewFrom(e, sent)
		leasesTotal.WithLabelValues(leaseOutcome(lr.Granted, ask.Want)).Inc()
	} else {
		e.renewAt = never
		leasesTotal.WithLabelValues("refused").Inc()
	}
	e.level, e.resetAt = lr.Remaining, sent+lr.ResetAfter
	e.retryAt, e.retryCost = sent+lr.RetryAfter, ask.Cost
	if e.stopTimer != nil {
		e.stopTimer()
		e.stopTimer = nil
	}
	e.holdUntil, e.banUntil, e.quotaUntil = 0, 0, 0
	e.emptyUntil = 0
	if lr.Remaining < ask.Cost || lr.Granted == 0 && lr.RetryAfter > 0 {
		// Remaining is the level after the grant: it cannot cover
		// another request of this cost.
		e.emptyUntil = sent + t.ttl
	}
	if lr.BanHolds && lr.Granted == 0 {
		// Refused under a ban: the requests until it is over are refused
		// here, and start no other (a refusal during a ban does not). A
		// quota that is short too holds them off no longer than below.
		e.banUntil = sent + lr.LimitRetry
	}
	if lr.QuotaHold > 0 {
		// A used-up quota: no call before its period ends, but for no
		// longer than strict mode's deny cache keeps a quota's refusal,
		// so that a give-back or a reset elsewhere is seen as soon.
		e.quotaUntil = sent + min(lr.QuotaHold, quotaDenyFor.Microseconds())
	}
	if lr.HoldOff > 0 {
		// From when the call was sent, so that nodes far from the store
		// are not always last to the refilled tokens, with jitter; but
		// never past when the requests refused meanwhile were told to
		// retry.
		until := sent + lr.HoldOff + t.jitter(lr.HoldOff/2+1)
		if lr.RetryAfter > 0 {
			until = min(until, sent+bucket.CeilDiv(lr.RetryAfter, 1_000_000)*1_000_000)
		}
		e.holdUntil = until
		if t.after != nil && e.banUntil == 0 {
			// Sent a round trip early, so that its tokens are here when
			// the hold-off ends and refused clients come back (a request
			// then waits on no call: TestLeaseTierOfTwoLimitsOnFourNodes).
			// Far from the store, half a round trip early, so that it
			// reaches the store as the hold-off ends there (it counts from
			// when this call was sent): a round trip early, a far region's
			// calls reached the store first and the near region fell under
			// its share; sent at the end, the far one did (the region
			// model, TestLeasesWithRegionsKeepTheConnectedBounds).
			early := t.roundTripOf(e)
			if t.far(e) {
				early /= 2
			}
			at := max(0, until-early-t.now())
			e.stopTimer = t.after(time.Duration(at)*time.Microsecond, func() { t.prefetchAfterHoldOff(e, until) })
		}
	}
}

// prefetchAfterHoldOff fetches the next lease of a bucket still in use
// when its hold-off ends, in the background, so that its requests find
// tokens rather than wait on a call: an oversubscribed bucket's steady
// traffic then waits no more than the rest. In use is more than refused
// during the hold-off: a node whose tokens fell under half while the
// hold-off kept it from the prefetch at half fetches too, or a region far
// from the store, whose grants come a round trip later, falls behind (the
// region model, TestLeasesWithRegionsKeepTheConnectedBounds).
func (t *leaseTable) prefetchAfterHoldOff(e *lease, until int64) {
	sh := t.shard([]byte(e.key))
	sh.mu.Lock()
	defer sh.mu.Unlock()
	now := t.now()
	if t.closed.Load() || sh.m[e.key] != e || e.call != nil || e.holdUntil != until || now-e.lastUsed >= t.ttl || e.tokens*2 >= e.size {
		return
	}
	t.expire(e, now)
	t.fetch(e, max(1, e.retryCost), now, true)
}

// periodOf records the quota period of tokens granted by a call sent at
// sent: they may be spent until it ends (spendBy). A grant whose period
// ends later than the last one's by more than any round trip is of the
// next period, whose tokens this node holds from now (periodFrom): a
// give-back of a request taken before then, from the last period's
// tokens (spendable while the call was out), may not go into this lease,
// whose tokens the quotas counted in another period.
func (t *leaseTable) periodOf(e *lease, lr bucket.LeaseResult, sent int64) {
	if lr.Until <= 0 {
		e.spendBy, e.periodFrom = 0, 0
		return
	}
	end := sent + lr.Until
	if e.spendBy == 0 || lr.Drop || end > e.spendBy+time.Minute.Microseconds() {
		e.periodFrom = t.now()
	}
	e.spendBy = end
}

func leaseOutcome(granted, want int64) string {
	if granted < want {
		return "partial"
	}
	return "granted"
}

// lease is a lease call on the bucket at key, within the timeout and
// ctx, and through the breaker. ctx is no request's: it ends the call
// earlier than the timeout when a wait before it took part of it (fetch).
// It writes each limit's and quota's remaining and reset into each, when
// given.
func (s *Store) lease(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error) {
	lr, _, err := s.leaseAt(ctx, key, tr, a, each)
	return lr, err
}

// leaseAt is lease, and also returns the server's time of the call. A
// prefetch is a call no request waits on (doAside).
func (s *Store) leaseAt(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, int64, error) {
	var v []int64
	var err error
	if a.Prefetch {
		v, err = s.callAside(ctx, key, s.leaseArgs(tr, a), leaseAnswer+2*tr.Parts())
	} else {
		v, err = s.call(ctx, key, s.leaseArgs(tr, a), false, leaseAnswer+2*tr.Parts())
	}
	if err != nil {
		return bucket.LeaseResult{}, 0, err
	}
	for i := range each {
		each[i] = bucket.Result{Remaining: v[leaseAnswer+2*i], ResetAfter: v[leaseAnswer+1+2*i]}
	}
	return bucket.LeaseResult{Granted: v[0], Remaining: v[1], RetryAfter: v[2], HoldOff: v[3], ResetAfter: v[4], Banned: v[5] == 1, Drop: v[6] == 1,
		Until: v[8], QuotaHold: v[9], Void: v[10] == 1, BanHolds: v[11] == 1, LimitRetry: v[12]}, v[7], nil
}

// callAside is Store.call, unbatched, for a call no request waits on: its
// failure does not count toward the breaker (doAside).
func (s *Store) callAside(ctx context.Context, key string, args []any, want int) ([]int64, error) {
	var vals []int64
	err := s.doAside(ctx, func(ctx context.Context, set *clientSet) (err error) {
		deadline, _ := ctx.Deadline()
		vals, err = s.runChecked(ctx, set, deadline, scriptArgs(key, args), false, want, want)
		return err
	})
	if err != nil {
		return nil, err
	}
	return vals, nil
}

// leaseAnswer is how many values a lease's answer has before each limit's
// and quota's level.
const leaseAnswer = 13

// giveBack returns the unused tokens of node's leases to their buckets in
// one pipeline, and reports how many went back; no request waits on it
// (doAside). After a MOVED, only the
// give-backs that were redirected go again (do).
func (s *Store) giveBack(node string, back []leaseReturn) (int64, error) {
	args := func(g leaseReturn) []any {
		return s.returnArgs(g.tier, g.tokens, node, g.seq)
	}
	var returned int64
	answered := make([]bool, len(back))
	var failed error
	err := s.doAside(context.Background(), func(ctx context.Context, set *clientSet) error {
		cmds := make([]*redis.Cmd, len(back))
		_, err := set.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for i, g := range back {
				if !answered[i] {
					cmds[i] = bucketScript.EvalSha(ctx, pipe, []string{g.key}, args(g)...)
				}
			}
			return nil
		})
		var redirect error
		for i, cmd := range cmds {
			if cmd == nil {
				continue
			}
			if isNoScript(cmd.Err()) {
				// Redis lost its scripts (a restart, a failover): EVAL loads it.
				cmd = bucketScript.Run(ctx, set.client, []string{back[i].key}, args(back[i])...)
			}
			vals, err := cmd.Int64Slice()
			switch {
			case isRedirect(err):
				redirect = err
				continue
			case err == nil && len(vals) == 2:
				returned += vals[0]
			case failed != nil:
			case err != nil:
				failed = err
			default:
				failed = fmt.Errorf("script answered %d values, want 2", len(vals))
			}
			answered[i] = true
		}
		if redirect != nil {
			return redirect
		}
		if failed == nil && err != nil && !isNoScript(err) {
			failed = err
		}
		return failed
	})
	return returned, err
}
