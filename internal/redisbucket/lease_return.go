package redisbucket

import (
	"context"
	"errors"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"go.uber.org/zap"
)

// expire gives back the tokens of a lease whose lease_ttl has passed: the
// shared store counts them as spent soon after, and they may not be spent
// here any more. With a call in flight they stay, unspendable, until it
// says whether they were leased anew.
func (t *leaseTable) expire(e *lease, now int64) {
	if e.tokens > 0 && t.lapsed(e, now) && e.call == nil {
		t.giveBackLater([]leaseReturn{e.takeBack()})
	}
}

// takeBack empties the entry into a give-back that names its last call,
// which the caller sends.
func (e *lease) takeBack() leaseReturn {
	back := leaseReturn{key: e.key, tier: e.tier, tokens: e.tokens, seq: e.seq, done: make(chan struct{})}
	e.tokens, e.recorded, e.returning = 0, 0, back.done
	return back
}

// giveBackHeld returns n tokens that a request took to this node's lease on
// the bucket at key, if it holds one, up to what the shared store's record
// counts. Tokens requests took in the shared bucket (reserved) are not
// the lease's: those go back there first. It reports how many it could
// not take, which go to the shared bucket instead.
func (t *leaseTable) giveBackHeld(key []byte, n int64) int64 {
	return t.giveBackHeldSince(key, n, 0)
}

// giveBackHeldSince is giveBackHeld for a request taken at took (the
// table's clock), on a tier with quotas: its tokens go into the lease
// only if they were taken in the quota period of the tokens the lease
// holds, or the quotas would admit them twice.
func (t *leaseTable) giveBackHeldSince(key []byte, n, took int64) int64 {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil || t.closed.Load() {
		return n
	}
	shared := min(n, e.reserved)
	e.reserved -= shared
	var put int64
	if !t.lapsed(e, t.now()) && (e.spendBy == 0 || took >= e.periodFrom) {
		put = min(n-shared, e.recorded-e.tokens)
		if e.call != nil {
			// The call's answer keeps no more than it names: tokens
			// taken before it was sent go to the shared bucket
			// (TestAGiveBackWhileARenewalIsOutLosesNoToken).
			put = min(put, max(0, e.call.held-e.tokens))
		}
		e.tokens += put
	}
	if n > put {
		// The rest goes to the shared bucket: it may cover a request
		// there now, so the node's hold-offs no longer hold (as strict
		// mode's give-back forgets a cached denial).
		e.holdUntil, e.quotaUntil, e.emptyUntil = 0, 0, 0
	}
	return n - put
}

// chargeHeld spends up to n of the tokens this node holds on lease for
// the bucket at key, for a cost reported after the fact, as a request
// spends them. It reports how many it could not spend, which the shared
// bucket is charged instead.
func (t *leaseTable) chargeHeld(key []byte, n int64) int64 {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil || t.closed.Load() || t.lapsed(e, t.now()) {
		return n
	}
	spent := min(n, e.tokens)
	e.tokens -= spent
	if e.tokens == 0 && e.recorded > 0 && e.tier.First().Ban > 0 && e.call == nil {
		// As spend does: under a ban setting, a lease spent is said so at
		// once, so that a refusal elsewhere does not count these tokens
		// as held.
		t.giveBackLater([]leaseReturn{e.takeBack()})
	}
	return n - spent
}

// reset drops this node's lease on the bucket at key: its tokens are not
// given back, since the shared bucket is reset too.
func (t *leaseTable) reset(key []byte) {
	sh := t.shard(key)
	sh.mu.Lock()
	if e := sh.m[string(key)]; e != nil && e.call == nil {
		delete(sh.m, e.key)
		e.gone = true
	} else if e != nil {
		e.tokens, e.recorded, e.holdUntil, e.retryAt, e.banUntil, e.quotaUntil = 0, 0, 0, 0, 0, 0
		e.emptyUntil, e.quietUntil = 0, 0
		e.call.reset = true
	}
	sh.mu.Unlock()
}

// held is how many buckets this node holds leased tokens of.
func (t *leaseTable) held() int {
	n := 0
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			if e.tokens > 0 {
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}

// settle waits, within ctx, for this node's lease call on the bucket at
// key, if one is out: until its answer is in, the shared level counts its
// grant as leased out and the table does not hold it yet.
func (t *leaseTable) settle(ctx context.Context, key []byte) {
	sh := t.shard(key)
	sh.mu.Lock()
	var done chan struct{}
	if e := sh.m[string(key)]; e != nil && e.call != nil {
		done = e.call.done
	}
	sh.mu.Unlock()
	if done != nil {
		select {
		case <-done:
		case <-ctx.Done():
		}
	}
}

// heldNow is the tokens this node holds on lease for the bucket at key
// and may spend now: none once lease_ttl has passed since they were
// leased, or the quota period that counted them has ended.
func (t *leaseTable) heldNow(key []byte) int64 {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil || t.closed.Load() || t.lapsed(e, t.now()) {
		return 0
	}
	return e.tokens
}

// leaseReturn is unused leased tokens on their way back to a shared bucket,
// naming the call that wrote the lease's record.
type leaseReturn struct {
	key    string
	tier   bucket.Tier
	tokens int64
	seq    int64
	// done is closed once the shared store has answered.
	done chan struct{}
}

// sweepEvery gives back the tokens that went unused for lease_ttl, and
// forgets idle entries, until the table stops.
func (t *leaseTable) sweepEvery(every time.Duration) {
	defer t.janitor.Done()
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case <-tick.C:
			if back := t.sweep(t.now(), false); len(back) > 0 {
				t.giveBackNow(back)
			}
		}
	}
}

// sweep takes the tokens to give back: those leased lease_ttl ago or more,
// or, with all, every one. It forgets entries idle for lease_ttl, unless
// the debt rule keeps them (lease_credit.go).
func (t *leaseTable) sweep(now int64, all bool) []leaseReturn {
	var back []leaseReturn
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			if e.call != nil {
				continue
			}
			if e.tokens > 0 && (all || t.lapsed(e, now)) {
				back = append(back, e.takeBack())
			}
			if e.tokens == 0 && now-e.lastUsed >= t.ttl && now >= e.holdUntil && !t.keeps(e, now) {
				sh.forget(e, t.perShard)
			}
		}
		sh.pruneReturning()
		sh.mu.Unlock()
	}
	return back
}

// giveBackLater gives tokens back in the background.
func (t *leaseTable) giveBackLater(back []leaseReturn) {
	t.calls.Add(1)
	go func() {
		defer t.calls.Done()
		t.giveBackNow(back)
	}()
}

// giveBackNow returns tokens to their shared buckets, in one pipeline. A
// give-back that fails loses its tokens, which only ever admits less.
func (t *leaseTable) giveBackNow(back []leaseReturn) {
	defer func() {
		for _, b := range back {
			close(b.done)
		}
	}()
	n, err := t.store.giveBack(t.node, back)
	leaseTokensReturned.Add(float64(n))
	if err != nil {
		t.logger.Warn("redis store: giving leased tokens back failed; they are lost until the buckets refill", zap.Int("buckets", len(back)), zap.Error(err))
	}
}

// errLeasesClosed fails a lease call asked of an unloaded config's table;
// the store then decides in strict mode.
var errLeasesClosed = errors.New("redis store: the config's leases were given back")

// close stops the table and gives every token it holds back.
func (t *leaseTable) close() {
	if t.closed.Swap(true) {
		return
	}
	// A fetch or an eviction starts under its shard's lock: once every
	// lock has been held since closed was set, none can start, so the
	// waits below see them all.
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		for _, e := range sh.m {
			if e.stopTimer != nil {
				e.stopTimer()
			}
		}
		sh.mu.Unlock()
	}
	close(t.stop)
	t.janitor.Wait()
	t.calls.Wait()
	back := t.sweep(t.now(), true)
	if t.current != nil {
		// A reload: what was leased under the old config goes back as
		// the new one counts it, or not at all if its tier is gone.
		kept := back[:0]
		for _, b := range back {
			old := b.tier
			if cur, ok := t.current(b.key, old); ok && len(cur.Limits) == len(old.Limits) {
				// In the new limits' tokens, the fewest any of them
				// would count: no limit gets back more than it lent.
				n := b.tokens
				for i, l := range cur.Limits {
					n = min(n, l.Converted(b.tokens, old.Limits[i]))
				}
				b.tokens, b.tier = n, cur
				kept = append(kept, b)
			} else {
				// The tier is gone, or its limits are others: giving
				// back could lift a limit that never lent them.
				close(b.done)
			}
		}
		back = kept
	}
	if len(back) > 0 {
		t.giveBackNow(back)
	}
}
