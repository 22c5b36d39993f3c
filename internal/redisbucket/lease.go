package redisbucket

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
// fall to half, or, a part of lease_ttl before the lease lapses, renewed
// (renewFrom). Requests that find no tokens share one call in flight per
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
	// ctx is no request's: it may end the call sooner than the timeout.
	lease(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error)
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
	// timeout is the store's: how long one decision may wait on Redis.
	timeout time.Duration
	now     func() int64
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

	// hints find an entry by its id (lease.id) without its key
	// (takeByID), a slot per id modulo hintSlots; a stale one (the entry
	// dropped, or another id's) only sends the request the long way.
	hints *[hintSlots]atomic.Pointer[lease]

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
	// id is the caller's 64-bit id of the bucket's name (takeByID), set
	// once, by the first request that gave one; 0 before. shard holds the
	// entry, and gone says it was dropped from it, so that a hint to it
	// no longer stands.
	id    uint64
	shard *leaseShard
	gone  bool
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
	// renewAt is when a request that spends from the lease renews it in
	// the background, before it lapses (renewFrom); never once a call
	// granted nothing, until one grants tokens again.
	renewAt int64
	// quietUntil: a call in the background for this lease failed; no other
	// goes before it lapses (prefetches), unless a call is answered first.
	quietUntil int64
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
	// back, or with max_wait due within it): until then every request is
	// refused here, with no call.
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
	// held is the tokens the call names (LeaseAsk.Held): its answer keeps
	// no more of what the node holds (apply).
	held int64
	// reset: an admin reset of the bucket came while the call was out
	// (leaseTable.reset), so its answer may be the deleted bucket's.
	reset bool
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
		timeout:  timeout,
		now:      now,
		node:     newNodeID(),
		seed:     maphash.MakeSeed(),
		perShard: max(1, maxEntries/leaseShards),
		logger:   logger,
		jitter:   mathrand.Int64N,
		stop:     make(chan struct{}),
		hints:    new([hintSlots]atomic.Pointer[lease]),
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

// insert adds an entry for key, first making room in a full shard.
func (t *leaseTable) insert(sh *leaseShard, key string, tr bucket.Tier, now int64) *lease {
	if len(sh.m) >= t.perShard {
		t.evict(sh, now)
	}
	e := &lease{key: key, tier: tr, shard: sh, credit: t.creditFor(len(sh.m))}
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
	e.gone = true
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
