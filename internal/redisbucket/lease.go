package redisbucket

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"hash/maphash"
	mathrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"go.uber.org/zap"
)

// Fleet leases (docs/fleet.md): a node takes
// several tokens of a shared bucket at once, in one script call, and
// decides the requests they cover in memory. The shared store counts what
// is out on lease (buckettest.Shared models it), so the fleet never admits
// more than one bucket would: a token is in the shared bucket, held by one
// node, or spent, and the level never refills over what the nodes hold.
//
// A node's first lease for a bucket is the request's cost, so a client seen
// once costs one call, as in strict mode. Each later lease doubles, up to
// the lease size (at most half the capacity), when the node spent the last
// one within lease_ttl (half of it for a prefetch). Once leases are larger
// than the cost, the next is fetched in the background when the tokens held
// fall to half. Requests that find no tokens share one call in flight per
// bucket. A lease that is refused, or partly granted, says how long until
// the shared bucket covers the node's next lease; until then, and a random
// 0 to 50% more, the node answers from memory and makes no call for that
// bucket. A node spends a lease for lease_ttl from when it sent the call,
// then gives what is left back, naming the lease; all of it goes back when
// the config is unloaded.

// leaseShards spreads the lease table over locks.
const leaseShards = 64

// leaseRemote is the shared store as leases see it: the Redis store, or
// a model of it in tests.
type leaseRemote interface {
	// lease writes each limit's and quota's remaining and reset into
	// each, when given.
	lease(key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error)
	giveBack(node string, back []leaseReturn) (int64, error)
	// reserve decides a request in the shared bucket as strict mode
	// does, waiting included: for max_wait, when leases do not cover it.
	// Its result is the binding one's; on a tier of several limits or
	// quotas, each is each one's, limits first.
	reserve(ctx context.Context, key string, tr bucket.Tier, cost int64) (res bucket.Result, each []bucket.Result, err error)
	// charge takes n more tokens from every limit and quota, into debt if
	// need be, and says how long until every limit is out of debt (0: none
	// is): requests admitted on credit (lease_credit.go).
	charge(key string, tr bucket.Tier, n int64) (debt int64, err error)
}

// leaseTable is one store's leases, by Redis key.
type leaseTable struct {
	store leaseRemote
	size  LeaseSize
	ttl   int64 // µs
	// hold is how long the shared store keeps a lease's record (µs): past
	// lease_ttl, one sweep period and the store's timeout, so that the
	// give-back of what is left, sent by the next sweep, arrives first.
	hold int64
	now  func() int64
	// node names this table's leases in the shared store; seq numbers its
	// calls.
	node   string
	seq    atomic.Int64
	seed   maphash.Seed
	shards [leaseShards]leaseShard
	// perShard bounds each shard's entries.
	perShard int
	logger   *zap.Logger
	// jitter draws the random part of a hold-off, from 0 to n-1.
	jitter func(n int64) int64
	// after, when set, runs f in the background after d, unless the stop
	// it returns is called first: the prefetch at the end of a hold-off.
	// Tests on an injected clock leave it unset.
	after func(d time.Duration, f func()) (stop func() bool)
	// onBan, when set, hears of each ban a lease call started, by key.
	onBan func(key string)
	// current, when set, says what the running config's limit is for the
	// bucket at key, whose lease was taken under l; false when the bucket's
	// tier is gone. A table closed by a reload gives back under it.
	current func(key string, tr bucket.Tier) (bucket.Tier, bool)
	// credit is how many requests of a key with no entry are admitted at
	// once, before any call (lease_credit.go); 0 for none. failing, when
	// set, says that calls to the store fail: credit is off meanwhile.
	credit  int64
	failing func() bool
	// debts, when set, are the keys in debt that the tables of every
	// config on this connection keep apart from credit (debtBook).
	debts *debtBook

	stop    chan struct{}
	closed  atomic.Bool
	calls   sync.WaitGroup // fetches and give-backs in flight
	janitor sync.WaitGroup
}

type leaseShard struct {
	mu sync.Mutex
	m  map[string]*lease
	// returning holds, by key, the give-backs of evicted entries still in
	// flight, so that a new entry's first call waits for them too.
	returning map[string]chan struct{}
}

// lease is what this node holds of one shared bucket.
type lease struct {
	key  string
	tier bucket.Tier
	// tokens are the leased tokens not yet spent, and recorded what the
	// shared store's record of them says at least: tokens never exceed it.
	tokens, recorded int64
	// seq is the number of the last call, which a give-back names.
	seq int64
	// size is the size of the last lease asked for, 0 before the first.
	size int64
	// leasedAt is when the call that last granted tokens was sent: they
	// may be spent until lease_ttl after it, and, with quotas, before
	// spendBy, when the quota period that counted them ends (0: no end).
	leasedAt, spendBy int64
	// periodFrom is when the call that first granted tokens of the
	// current quota period was sent (periodOf).
	periodFrom int64
	// level and resetAt are the shared bucket as the last call saw it;
	// each, on a tier of several limits or quotas, each one's.
	level   int64
	resetAt int64
	each    []levelAt
	// retryAt is when the shared bucket holds retryCost, as the last call
	// saw it; holdUntil: no call for this bucket before then.
	retryAt, retryCost int64
	holdUntil          int64
	// emptyUntil: the last answer showed the shared level empty (it could
	// not cover another request of this cost); until an answer shows it
	// holding one again, and no longer than lease_ttl after the call, a
	// request that finds no tokens here, and whose cost that level did
	// not cover (emptyFor), is refused at once rather than wait a long
	// round trip on a call (refuses).
	emptyUntil int64
	// banUntil is when a ban the last call found ends (and the cost is
	// back): until then every request is refused here, with no call.
	banUntil int64
	// quotaUntil: the last call found a quota used up; no call for this
	// bucket before then, ban setting or not (a quota starts no ban).
	quotaUntil int64
	// reserved is the tokens requests took in the shared bucket, not from
	// the lease (max_wait): a give-back returns those there first.
	reserved int64
	lastUsed int64
	call     *leaseCall
	// rtt is how long the last call took, by the node's clock.
	rtt int64
	// stopTimer stops the prefetch due at the end of the hold-off.
	stopTimer func() bool
	// returning is closed once the last give-back naming this lease has
	// been answered: the next lease call waits for it, so that it cannot
	// overtake the give-back and leave it naming a lease no longer there.
	returning chan struct{}
	// backlog is what the requests a call left uncovered cost together,
	// for the next call, which they all wait on, to ask (fetch).
	backlog int64
	// credit is how many more requests the entry admits on credit; owed,
	// the tokens they took that no charge has carried yet; charging, that
	// a charge is out; debtUntil, until when its answer said the bucket is
	// in debt. The debt rule keeps the entry meanwhile (lease_credit.go).
	credit, owed int64
	charging     bool
	debtUntil    int64
}

// levelAt is one limit's or quota's level, and when it is full again or
// starts over.
type levelAt struct{ level, resetAt int64 }

// leaseCall is one lease call in flight, which requests share.
type leaseCall struct {
	done chan struct{}
	err  error
	// short: the answer showed the shared level empty, so strict mode
	// would refuse too; or the shared store refused the requests that
	// waited on it.
	short bool
	// spent: the call took the cost of the request that made it, which
	// is allowed without taking from what the node holds.
	spent bool
	// banned: the call's refusal started a ban, for the request that made
	// it to report; abandoned: that request went away first, so onBan
	// counts it. finished: the answer is in. All under the shard's lock.
	banned, abandoned, finished bool
	// joined counts the requests that wait on the call besides its own,
	// less those that went away before its answer (await).
	joined int
	// cost is the cost of the request the call was made for, and level
	// the shared level its answer showed: short is for that cost
	// (shortFor).
	cost, level int64
}

// shortFor says whether c's answer showed the shared level unable to
// cover a request of cost: when the level is under that cost, whatever
// the call's, since one bucket would refuse it too
// (TestACostlyWaiterIsRefusedByAnAnswerThatShowedTheLevelUnderItsCost);
// else as short says, for the call's cost or more, but not for a cheaper
// request, which one bucket would admit.
func (c *leaseCall) shortFor(cost int64) bool {
	return c.level < cost || c.short && cost >= c.cost
}

// newLeaseTable makes the lease table of a store whose calls take up to
// timeout.
func newLeaseTable(remote leaseRemote, now func() int64, size LeaseSize, ttl, timeout time.Duration, maxEntries int, logger *zap.Logger) *leaseTable {
	every := sweepPeriod(ttl)
	t := &leaseTable{
		store:    remote,
		size:     size,
		ttl:      ttl.Microseconds(),
		hold:     (ttl + every + timeout).Microseconds(),
		now:      now,
		node:     newNodeID(),
		seed:     maphash.MakeSeed(),
		perShard: max(1, maxEntries/leaseShards),
		logger:   logger,
		jitter:   mathrand.Int64N,
		stop:     make(chan struct{}),
	}
	for i := range t.shards {
		t.shards[i].m = make(map[string]*lease)
		t.shards[i].returning = make(map[string]chan struct{})
	}
	t.janitor.Add(1)
	go t.sweepEvery(every)
	return t
}

// sweepPeriod is how often a table gives back what went unused for
// lease_ttl.
func sweepPeriod(ttl time.Duration) time.Duration { return max(ttl/4, 10*time.Millisecond) }

// newNodeID is a random name for a lease table: each config a node loads
// leases apart from the one before it.
func newNodeID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func (t *leaseTable) shard(key []byte) *leaseShard {
	return &t.shards[maphash.Bytes(t.seed, key)%leaseShards]
}

// entry finds or adds the entry for key, under its shard's lock.
func (t *leaseTable) entry(sh *leaseShard, key []byte, tr bucket.Tier, now int64) *lease {
	e := sh.m[string(key)]
	if e == nil {
		e = t.insert(sh, string(key), tr, now)
	}
	e.tier, e.lastUsed = tr, now
	t.expire(e, now)
	return e
}

// take decides one request from this node's lease on the bucket at key,
// on every limit and quota of its tier at once, fetching a lease when the
// tokens held do not cover it. With max_wait, a request the leases refuse
// takes its tokens in the shared bucket as strict mode does, waiting, or
// is refused by it. It writes each limit's and quota's result into out
// (room for tr.Parts()), and returns the binding one.
func (t *leaseTable) take(ctx context.Context, key []byte, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, error) {
	res, err := t.takeHeld(ctx, key, tr, cost, out)
	if err != nil || res.Allowed || tr.First().MaxWait == 0 || res.Banned {
		return res, err
	}
	// The refusal may be this node's hold-off, which spaces its calls,
	// not the shared bucket's level: ask the shared bucket, as strict
	// mode does; the deny cache keeps a flood of refusals off Redis.
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
func (t *leaseTable) takeHeld(ctx context.Context, key []byte, tr bucket.Tier, cost int64, out []bucket.Result) (bucket.Result, error) {
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
			if ban == 0 && !waited && e.call == nil && now >= e.holdUntil && now >= e.quotaUntil && now >= e.banUntil {
				// Refused by emptyUntil alone: the next lease comes in
				// the background, for the requests after this one.
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

// spend takes cost from the tokens e holds, and fetches the next lease in
// the background when they fall to half, or when the lease ends within
// two round trips, so that its requests never find the tokens lapsed and
// wait on a call; under a ban setting, a lease spent is said so at once,
// so that a refusal on another node does not take these tokens for held,
// and bans when one bucket would.
func (t *leaseTable) spend(e *lease, cost, now int64) bucket.Result {
	e.tokens -= cost
	switch {
	case (e.tokens*2 < e.size || t.endsWithin(e, now, 2*t.roundTripOf(e))) && e.size > cost && e.call == nil && now >= e.holdUntil && now >= e.quotaUntil && !t.periodEndsWithin(e, now, 2*t.roundTripOf(e)):
		t.fetch(e, cost, now, true)
	case e.tokens == 0 && e.recorded > 0 && e.tier.First().Ban > 0 && e.call == nil:
		t.giveBackLater([]leaseReturn{e.takeBack()})
	}
	return e.result(now, true, cost)
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

// endsWithin says whether the tokens e holds lapse within d of now, at
// the end of their lease_ttl. Not when the quota period that counted them
// ends first: a call that lands before it brings tokens of the same
// period, which lapse with them, and one that lands after it has the
// shared store drop what the node holds, which the limits never get back
// (TestNoLeasedTokenIsLostAcrossAQuotaPeriodsEnd); the give-back of
// lapsed tokens returns them.
func (t *leaseTable) endsWithin(e *lease, now, d int64) bool {
	end := e.leasedAt + t.ttl
	if e.spendBy != 0 && e.spendBy <= end {
		return false
	}
	return end-now <= d
}

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

// insert adds an entry for key, first making room in a full shard.
func (t *leaseTable) insert(sh *leaseShard, key string, tr bucket.Tier, now int64) *lease {
	if len(sh.m) >= t.perShard {
		t.evict(sh, now)
	}
	e := &lease{key: key, tier: tr, credit: t.creditFor(len(sh.m))}
	if e.credit > 0 && t.debts != nil {
		e.credit, e.debtUntil = t.debts.creditFor(key, e.credit, now)
	}
	if done, ok := sh.returning[key]; ok {
		e.returning = done
		delete(sh.returning, key)
	}
	sh.m[key] = e
	return e
}

// evict drops one entry of a full shard: an idle one if it can, giving
// back any tokens it holds. An entry with a call in flight stays, and so
// does one the debt rule keeps (lease_credit.go).
func (t *leaseTable) evict(sh *leaseShard, now int64) {
	var victim *lease
	for _, e := range sh.m {
		if e.call != nil || t.keeps(e, now) {
			continue
		}
		if victim == nil || e.tokens == 0 && victim.tokens != 0 || e.lastUsed < victim.lastUsed {
			victim = e
		}
	}
	if victim == nil {
		return
	}
	if victim.tokens > 0 || victim.recorded > 0 {
		t.giveBackLater([]leaseReturn{victim.takeBack()})
	}
	sh.forget(victim, t.perShard)
	leaseEvictions.Inc()
}

// forget drops e from the shard. A give-back of it still in flight is kept
// by key, for the first call of the next entry to wait for.
func (sh *leaseShard) forget(e *lease, bound int) {
	delete(sh.m, e.key)
	if e.stopTimer != nil {
		e.stopTimer()
	}
	if e.returning == nil {
		return
	}
	select {
	case <-e.returning:
		return
	default:
	}
	if len(sh.returning) >= bound {
		sh.pruneReturning()
	}
	if len(sh.returning) < bound {
		// Past the bound the order is not kept: at worst the give-back
		// finds its lease renamed, and its tokens are lost.
		sh.returning[e.key] = e.returning
	}
}

// pruneReturning forgets the give-backs that have been answered.
func (sh *leaseShard) pruneReturning() {
	for key, done := range sh.returning {
		select {
		case <-done:
			delete(sh.returning, key)
		default:
		}
	}
}
