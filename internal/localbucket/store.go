// Package localbucket is the local engine: the buckets of one policy in
// this process's memory, in a sharded open-addressing table with a bound
// on its keys, beside their calendar quotas' counts and their requests in
// flight. It applies the math of internal/bucket, and knows neither Caddy
// nor Redis.
//
// A bucket is named by a 64-bit id, a keyed hash its caller computes, whose
// bits are uniform: the top ones pick the shard, and the bucket's limits
// and quotas keep their states under the id mixed with their place. Every
// call takes the tier's shape (bucket.Tier), as the Redis engine's do.
// The clocks and counters a Store reads come through its constructor.
package localbucket

import (
	"math/bits"
	"sync"
	"sync/atomic"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Options set up a Store.
type Options struct {
	// MaxKeys bounds the states the store holds; at least 1.
	MaxKeys int
	// Now is the monotonic clock, in microseconds, at least 1: the zero
	// State is a full bucket at every time it gives.
	Now func() int64
	// Wall is the wall clock, Unix microseconds, which quotas' calendars
	// read.
	Wall func() int64
	// CallersClocks says that Now and Wall are the clocks the store's
	// callers read too (the process's): TakeAt then decides at the moment
	// its caller read, which saves a request a clock read, instead of
	// reading its own.
	CallersClocks bool
	// Evictions, when set, counts the live states every store drops to
	// stay within its bound, for a process-wide metric.
	Evictions *atomic.Uint64
}

// Store is a sharded table of bucket states keyed by the bucket's id. Each
// shard has its own lock. The bound on keys is kept over the whole table,
// so that shards that happen to draw more clients than others do not evict
// early.
type Store struct {
	now  func() int64
	wall func() int64
	// callersClocks is Options.CallersClocks.
	callersClocks bool

	shards  []shard
	shift   uint
	maxKeys atomic.Int64
	count   atomic.Int64 // states held, over all shards

	fullDrops atomic.Uint64 // full states dropped: nothing lost
	evictions atomic.Uint64 // live states dropped to respect MaxKeys
	// allEvictions is Options.Evictions, or nil.
	allEvictions *atomic.Uint64
	// spare is the bits of a slot's slack that keep its live state from
	// eviction while the shard holds live ones without (makeRoom):
	// bannedBit, but in the mutation check of
	// TestEvictionLiftsABanOnlyWhenItsShardHoldsNothingElseLive.
	spare uint32

	// load is the config load that last started the table (StartLoad).
	loadMu sync.Mutex
	load   any
}

type shard struct {
	mu     sync.Mutex
	states stateTable
	// slots counts the requests in flight of each bucket that has some
	// (concurrency), by the bucket's id.
	slots map[uint64]int32
	_     [64]byte // keep shards' locks on separate cache lines
}

// New makes a store: up to 64 shards, fewer for a small bound, so that
// each holds a few hundred states at least.
func New(o Options) *Store {
	n := 1
	for n < 64 && n*2*256 <= o.MaxKeys {
		n *= 2
	}
	s := &Store{now: o.Now, wall: o.Wall, callersClocks: o.CallersClocks, allEvictions: o.Evictions, shards: make([]shard, n), shift: uint(64 - bits.TrailingZeros(uint(n))), spare: bannedBit}
	s.SetMaxKeys(o.MaxKeys)
	return s
}

// SetMaxKeys changes the bound. A table over its new bound shrinks as new
// clients arrive.
func (s *Store) SetMaxKeys(maxKeys int) { s.maxKeys.Store(int64(max(maxKeys, 1))) }

// Destruct lets a caddy.UsagePool hold the store; it has nothing to free.
func (s *Store) Destruct() error { return nil }

func (s *Store) shard(id uint64) *shard {
	if s.shift == 64 {
		return &s.shards[0]
	}
	return &s.shards[id>>s.shift]
}

// limitID is the table id of a bucket's limit i.
func limitID(id uint64, i int) uint64 {
	if i == 0 {
		return id
	}
	return id ^ uint64(i)*0x9e3779b97f4a7c15
}

// Take applies a request costing cost to every limit and quota of the
// tier tr of bucket id, all or none, and writes each one's result into
// out, limits first (room for tr.Parts()). It reports whether the request
// was allowed. A cost of 0 only reads.
func (s *Store) Take(id uint64, tr bucket.Tier, cost int64, out []bucket.Result) bool {
	if tr.Lone() {
		out[0] = s.take(id, tr.Limits[0], cost, s.now())
		return out[0].Allowed
	}
	if len(tr.Quotas) == 0 {
		return s.takeAll(id, tr.Limits, cost, out, s.now())
	}
	return s.takeQuotas(id, tr, cost, out, s.now(), s.wall())
}

// TakeAt is Take at the moment now, by the store's monotonic clock, and
// wall, by its wall clock, which the caller read, when the store reads
// its callers' clocks (Options.CallersClocks); otherwise it reads its own,
// as Take does. A moment read before the call only makes the buckets look
// emptier, as take's early read does; a quota's count that another take
// has moved into the next period counts this one there too (racedPast).
func (s *Store) TakeAt(id uint64, tr bucket.Tier, cost int64, out []bucket.Result, now, wall int64) bool {
	if !s.callersClocks {
		return s.Take(id, tr, cost, out)
	}
	if tr.Lone() {
		out[0] = s.take(id, tr.Limits[0], cost, now)
		return out[0].Allowed
	}
	if len(tr.Quotas) == 0 {
		return s.takeAll(id, tr.Limits, cost, out, now)
	}
	return s.takeQuotas(id, tr, cost, out, now, wall)
}

// CallersClocks reports Options.CallersClocks.
func (s *Store) CallersClocks() bool { return s.callersClocks }

// take is Take on a lone limit at now, the fast path.
func (s *Store) take(id uint64, l bucket.Limit, cost, now int64) bucket.Result {
	sh := s.shard(id)
	// The clock is read before the lock (by Take, or TakeAt's caller), to
	// keep the lock short (a clock read is a third of a take on some VMs).
	// Another take may then store
	// a later time first; an earlier now only makes the bucket look
	// emptier, and leaves its FullAt as it would have been, so it can deny
	// early, by the time between the two reads, and never admits more.
	sh.mu.Lock()
	// One probe: a state found is written back in its slot.
	var old bucket.State
	i, ok := sh.states.find(tableKey(id))
	if ok {
		old = sh.states.at(i)
	}
	st, res := bucket.Take(old, now, l, cost)
	switch {
	case st == old:
	case ok:
		sh.states.set(i, st)
	default:
		if s.count.Load() >= s.maxKeys.Load() {
			s.makeRoom(sh, now, id)
		}
		s.count.Add(1)
		sh.states.put(id, st)
	}
	sh.mu.Unlock()
	return res
}

// takeAll is take over several limits under one shard lock, all or none.
// Limit i keeps its state under the bucket's id mixed with i, in the same
// shard; limit 0's is the bucket's own, as with one limit.
func (s *Store) takeAll(id uint64, ls []bucket.Limit, cost int64, out []bucket.Result, now int64) bool {
	sh := s.shard(id)
	var states, olds [bucket.MaxLimits]bucket.State
	var found [bucket.MaxLimits]bool
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i := range ls {
		states[i], found[i] = sh.states.get(limitID(id, i))
	}
	olds = states
	allowed := bucket.TakeAll(states[:len(ls)], now, ls, cost, out)
	swept := false
	for i := range ls {
		if states[i] == olds[i] {
			continue
		}
		if swept {
			// The sweep may have dropped this limit's state (a full one
			// goes first): writing it back is a new state to count.
			_, found[i] = sh.states.get(limitID(id, i))
		}
		if !found[i] {
			if s.count.Load() >= s.maxKeys.Load() {
				s.makeRoom(sh, now, limitID(id, i))
				swept = true
			}
			s.count.Add(1)
		}
		sh.states.put(limitID(id, i), states[i])
	}
	return allowed
}

// Peek writes each limit's and quota's result into out, as Take does,
// changing nothing and starting no ban.
func (s *Store) Peek(id uint64, tr bucket.Tier, out []bucket.Result) {
	sh := s.shard(id)
	now, wall := s.now(), s.wall()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i, l := range tr.Limits {
		st, _ := sh.states.get(limitID(id, i))
		out[i] = bucket.Peek(st, now, l)
	}
	for j, q := range tr.Quotas {
		st, _ := sh.states.get(quotaID(id, q.Period))
		start, _ := q.Bounds(wall)
		out[len(tr.Limits)+j] = bucket.PeekQuota(quotaState(st, start), wall, q)
	}
}

// GiveBack returns limitsN tokens to every limit of the tier tr of bucket
// id, up to each one's capacity, and n, which a request took at the moment
// at (Unix µs), to every quota while the period that counted them lasts.
// A limit the table no longer holds is full: it takes nothing back.
func (s *Store) GiveBack(id uint64, tr bucket.Tier, limitsN, n, at int64) {
	if len(tr.Quotas) > 0 {
		s.updateQuotas(id, tr.Limits, tr.Quotas, func(st bucket.State, now int64, l bucket.Limit) bucket.State {
			return bucket.GiveBack(st, now, l, limitsN)
		},
			func(qs bucket.QuotaState, now int64, q bucket.Quota) bucket.QuotaState {
				return bucket.GiveBackQuota(qs, now, at, q, n)
			})
		return
	}
	sh := s.shard(id)
	now := s.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i, l := range tr.Limits {
		if st, ok := sh.states.get(limitID(id, i)); ok {
			sh.states.put(limitID(id, i), bucket.GiveBack(st, now, l, limitsN))
		}
	}
}

// Charge takes n more tokens from every limit and quota of the tier tr of
// bucket id, after the fact: a limit may go into debt.
func (s *Store) Charge(id uint64, tr bucket.Tier, n int64) {
	if tr.Lone() {
		l := tr.Limits[0]
		sh := s.shard(id)
		now := s.now()
		sh.mu.Lock()
		defer sh.mu.Unlock()
		st, _ := sh.states.get(id)
		s.putLocked(sh, id, bucket.Charge(st, now, l, n), now)
		return
	}
	s.updateQuotas(id, tr.Limits, tr.Quotas, func(st bucket.State, now int64, l bucket.Limit) bucket.State { return bucket.Charge(st, now, l, n) },
		func(qs bucket.QuotaState, now int64, q bucket.Quota) bucket.QuotaState {
			return bucket.ChargeQuota(qs, now, q, n)
		})
}

// Reset forgets every limit's and quota's state of bucket id: it is full
// again. Its requests in flight stay counted.
func (s *Store) Reset(id uint64) {
	sh := s.shard(id)
	sh.mu.Lock()
	before := sh.states.n
	for i := range bucket.MaxLimits + bucket.MaxQuotas {
		sh.states.remove(limitID(id, i))
	}
	s.count.Add(int64(sh.states.n - before))
	sh.mu.Unlock()
}

// putLocked stores st under id, making room for a new entry; the shard's
// lock is held.
func (s *Store) putLocked(sh *shard, id uint64, st bucket.State, now int64) {
	if _, found := sh.states.get(id); !found {
		if s.count.Load() >= s.maxKeys.Load() {
			s.makeRoom(sh, now, id)
		}
		s.count.Add(1)
	}
	sh.states.put(id, st)
}

// makeRoom frees at least a 32nd of the shard, so that the sweep's cost is
// spread over many inserts. Full buckets go first: dropping one changes no
// decision. Only then are live buckets dropped, from a place in the table
// that the incoming hash picks, which is as good as random; banned ones,
// and quota counts used up (tableQuota), only when no other live one is
// left: otherwise a flood of new keys would lift a ban (docs/logins.md).
func (s *Store) makeRoom(sh *shard, now int64, seed uint64) {
	want := max(1, sh.states.n/32)
	if s.count.Load() > s.maxKeys.Load() {
		// Over the bound (a lower max_keys, SetMaxKeys): two, so that the
		// table shrinks by one a new client even where a 32nd of a shard
		// is one state.
		want = max(want, 2)
	}
	full := sh.states.sweep(0, sh.states.n, func(fullAt int64, _ uint32) bool { return fullAt <= now })
	s.fullDrops.Add(uint64(full))
	live := 0
	if full < want {
		live = sh.states.sweep(int(seed), want-full, func(_ int64, slack uint32) bool { return slack&s.spare == 0 })
		if full+live < want {
			live += sh.states.sweep(int(seed), want-full-live, func(int64, uint32) bool { return true })
		}
		s.evictions.Add(uint64(live))
		if s.allEvictions != nil {
			s.allEvictions.Add(uint64(live))
		}
	}
	s.count.Add(-int64(full + live))
}

// Len counts the states held.
func (s *Store) Len() int { return int(s.count.Load()) }

// Evictions counts the live states dropped to stay within the bound, and
// FullDrops the full ones, whose drop lost nothing.
func (s *Store) Evictions() uint64 { return s.evictions.Load() }

// FullDrops: see Evictions.
func (s *Store) FullDrops() uint64 { return s.fullDrops.Load() }

// Live counts the states that are not full: a full one decides as no
// state does, and stays in the table only until room is needed. It looks
// at every state, for the admin API, not the request path.
func (s *Store) Live() int {
	now := s.now()
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for j, key := range sh.states.keys {
			if key != 0 && sh.states.fullAt[j] > now {
				n++
			}
		}
		sh.mu.Unlock()
	}
	return n
}

// StartLoad empties the table when load, a config load, is not the one
// that last started it: a store that is a load's own (on_store_error
// local's) neither limits clients under a later load nor counts in its
// keys. A nil load (a store set up outside a config) changes nothing.
// In-flight slots stay: their requests still run.
func (s *Store) StartLoad(load any) {
	s.loadMu.Lock()
	defer s.loadMu.Unlock()
	if load == nil || load == s.load {
		return
	}
	s.load = load
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		s.count.Add(-int64(sh.states.n))
		sh.states = stateTable{}
		sh.mu.Unlock()
	}
}
