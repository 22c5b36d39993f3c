package ratelimit

import (
	"context"
	"fmt"
	"hash/maphash"
	"math/bits"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(LocalStore{})
}

// LocalStore keeps buckets in this process's memory. It is the default
// store. Buckets survive config reloads, for as long as some loaded config
// uses the policy.
type LocalStore struct {
	// MaxKeys bounds how many buckets the policy keeps. When a new client
	// arrives at the bound, buckets that have refilled to full are dropped
	// first (which loses nothing), then others. Default 1000000.
	MaxKeys int `json:"max_keys,omitempty"`

	buckets *localBuckets
	key     string
}

// CaddyModule returns the Caddy module information.
func (LocalStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.local",
		New: func() caddy.Module { return new(LocalStore) },
	}
}

const defaultMaxKeys = 1000000

// Validate checks the configuration.
func (s *LocalStore) Validate() error {
	if s.MaxKeys < 0 {
		return fmt.Errorf("store local: max_keys %d: must be at least 1", s.MaxKeys)
	}
	return nil
}

func (s *LocalStore) maxKeys() int {
	if s.MaxKeys == 0 {
		return defaultMaxKeys
	}
	return s.MaxKeys
}

// localPool holds one bucket table per policy, across config reloads.
var localPool = caddy.NewUsagePool()

func (s *LocalStore) bind(policy string) error {
	if err := s.Validate(); err != nil {
		return err
	}
	s.key = "local/" + policy
	val, loaded, err := localPool.LoadOrNew(s.key, func() (caddy.Destructor, error) {
		return newLocalBuckets(s.maxKeys(), localClock), nil
	})
	if err != nil {
		return err
	}
	s.buckets = val.(*localBuckets)
	if loaded {
		s.buckets.setMaxKeys(s.maxKeys())
	}
	return nil
}

// Cleanup releases this config's hold on the policy's buckets.
func (s *LocalStore) Cleanup() error {
	if s.key == "" {
		return nil
	}
	// Idempotent: a config's Cleanup may reach a store more than once.
	_, err := localPool.Delete(s.key)
	s.key = ""
	return err
}

// Take implements Store.
func (s *LocalStore) Take(_ context.Context, b *Bucket, l bucket.Limit, cost int64) (bucket.Result, error) {
	return s.buckets.take(b, l, cost), nil
}

// Peek implements Store.
func (s *LocalStore) Peek(_ context.Context, b *Bucket, l bucket.Limit) (bucket.Result, error) {
	return s.buckets.peek(b, l), nil
}

// Reset implements Store.
func (s *LocalStore) Reset(_ context.Context, b *Bucket) error {
	s.buckets.reset(b)
	return nil
}

// TakeAll implements Store.
func (s *LocalStore) TakeAll(_ context.Context, b *Bucket, ls []bucket.Limit, cost int64, out []bucket.Result) (bool, error) {
	return s.buckets.takeAll(b, ls, cost, out), nil
}

// Charge implements Store.
func (s *LocalStore) Charge(_ context.Context, b *Bucket, l bucket.Limit, n int64) error {
	s.buckets.update(b, func(st bucket.State, now int64) bucket.State { return bucket.Charge(st, now, l, n) }, true)
	return nil
}

// GiveBack implements Store.
func (s *LocalStore) GiveBack(_ context.Context, b *Bucket, l bucket.Limit, n int64) error {
	s.buckets.giveBack(b, l, n)
	return nil
}

// GiveBackAll implements Store.
func (s *LocalStore) GiveBackAll(_ context.Context, b *Bucket, ls []bucket.Limit, n int64) error {
	s.buckets.giveBackAll(b, ls, n)
	return nil
}

// Report implements StoreReporter: its Keys are the live buckets.
func (s *LocalStore) Report() StoreReport { return StoreReport{Keys: s.buckets.live()} }

// UnmarshalCaddyfile sets up the store from Caddyfile tokens:
//
//	store local {
//	    max_keys <n>
//	}
func (s *LocalStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // "local"
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "max_keys":
			n, err := intArg(d)
			if err != nil {
				return err
			}
			if n < 1 {
				return d.Errf("max_keys %d: must be at least 1", n)
			}
			s.MaxKeys = int(n)
		default:
			return d.Errf("store local: unknown subdirective %q", d.Val())
		}
	}
	return nil
}

// localClock is the clock that new local bucket tables read. Tests replace
// it before they load a config.
var localClock = monotonicMicros

// localWallClock is the local stores' wall clock, for quotas; tests
// replace it.
var localWallClock = func() int64 { return time.Now().UnixMicro() }

// hashSeed keys the local hash, so clients cannot aim for collisions.
var hashSeed = maphash.MakeSeed()

// localBuckets is a sharded table of bucket states keyed by a 64-bit keyed
// hash of the bucket's name. Each shard has its own lock. The bound on keys
// is kept over the whole table, so that shards that happen to draw more
// clients than others do not evict early.
type localBuckets struct {
	now func() int64
	// wall is the wall clock (Unix microseconds), which quotas' calendars
	// read; now may be monotonic.
	wall    func() int64
	shards  []localShard
	shift   uint
	maxKeys atomic.Int64
	count   atomic.Int64 // buckets held, over all shards

	fullDrops atomic.Uint64 // full buckets dropped: nothing lost
	evictions atomic.Uint64 // live buckets dropped to respect MaxKeys

	// load is the config load that last started the table (startLoad).
	loadMu sync.Mutex
	load   any
}

type localShard struct {
	mu     sync.Mutex
	states stateTable
	// slots counts the requests in flight of each bucket that has some
	// (concurrency), by the bucket's id.
	slots map[uint64]int32
	_     [64]byte // keep shards' locks on separate cache lines
}

func newLocalBuckets(maxKeys int, now func() int64) *localBuckets {
	n := 1
	for n < 64 && n*2*256 <= maxKeys {
		n *= 2
	}
	lb := &localBuckets{now: now, wall: localWallClock, shards: make([]localShard, n), shift: uint(64 - bits.TrailingZeros(uint(n)))}
	lb.setMaxKeys(maxKeys)
	return lb
}

// setMaxKeys changes the bound. A table over its new bound shrinks as new
// clients arrive.
func (lb *localBuckets) setMaxKeys(maxKeys int) { lb.maxKeys.Store(int64(max(maxKeys, 1))) }

// Destruct implements caddy.Destructor.
func (lb *localBuckets) Destruct() error { return nil }

func (lb *localBuckets) locate(b *Bucket) (*localShard, uint64) {
	var h maphash.Hash
	h.SetSeed(hashSeed)
	h.WriteString(b.Policy)
	h.WriteByte(0)
	h.WriteString(b.Tier)
	h.WriteByte(0)
	h.WriteString(b.Keyer)
	h.WriteByte(0)
	h.Write(b.Value)
	sum := h.Sum64()
	if lb.shift == 64 {
		return &lb.shards[0], sum
	}
	return &lb.shards[sum>>lb.shift], sum
}

func (lb *localBuckets) take(b *Bucket, l bucket.Limit, cost int64) bucket.Result {
	sh, id := lb.locate(b)
	// The clock is read before the lock, to keep the lock short (a clock
	// read is a third of a take on some VMs). Another take may then store
	// a later time first; an earlier now only makes the bucket look
	// emptier, and leaves its FullAt as it would have been, so it can deny
	// early, by the time between the two reads, and never admits more.
	now := lb.now()
	sh.mu.Lock()
	old, ok := sh.states.get(id)
	st, res := bucket.Take(old, now, l, cost)
	if st != old {
		if !ok {
			if lb.count.Load() >= lb.maxKeys.Load() {
				lb.makeRoom(sh, now, id)
			}
			lb.count.Add(1)
		}
		sh.states.put(id, st)
	}
	sh.mu.Unlock()
	return res
}

// takeAll is take over several limits under one shard lock, all or none.
// Limit i keeps its state under the bucket's id mixed with i, in the same
// shard; limit 0's is the bucket's own, as with one limit. A request of
// cost 0 only reads.
func (lb *localBuckets) takeAll(b *Bucket, ls []bucket.Limit, cost int64, out []bucket.Result) bool {
	sh, id := lb.locate(b)
	var states, olds [bucket.MaxLimits]bucket.State
	var found [bucket.MaxLimits]bool
	now := lb.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i := range ls {
		states[i], found[i] = sh.states.get(limitID(id, i))
	}
	olds = states
	allowed := bucket.TakeAll(states[:len(ls)], now, ls, cost, out)
	for i := range ls {
		if states[i] == olds[i] {
			continue
		}
		if !found[i] {
			if lb.count.Load() >= lb.maxKeys.Load() {
				lb.makeRoom(sh, now, limitID(id, i))
			}
			lb.count.Add(1)
		}
		sh.states.put(limitID(id, i), states[i])
	}
	return allowed
}

// limitID is the table id of a bucket's limit i.
func limitID(id uint64, i int) uint64 {
	if i == 0 {
		return id
	}
	return id ^ uint64(i)*0x9e3779b97f4a7c15
}

func (lb *localBuckets) peek(b *Bucket, l bucket.Limit) bucket.Result {
	sh, id := lb.locate(b)
	now := lb.now()
	sh.mu.Lock()
	st, _ := sh.states.get(id)
	res := bucket.Peek(st, now, l)
	sh.mu.Unlock()
	return res
}

func (lb *localBuckets) giveBack(b *Bucket, l bucket.Limit, n int64) {
	// A bucket back to full is no bucket; keeping it costs nothing.
	lb.update(b, func(st bucket.State, now int64) bucket.State { return bucket.GiveBack(st, now, l, n) }, false)
}

// giveBackAll gives n back to each of the bucket's limits, under one lock.
func (lb *localBuckets) giveBackAll(b *Bucket, ls []bucket.Limit, n int64) {
	sh, id := lb.locate(b)
	now := lb.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i, l := range ls {
		if st, ok := sh.states.get(limitID(id, i)); ok {
			sh.states.put(limitID(id, i), bucket.GiveBack(st, now, l, n))
		}
	}
}

// update applies f to the bucket's state under its shard's lock; a bucket
// the table lacks is added only when add is set.
func (lb *localBuckets) update(b *Bucket, f func(st bucket.State, now int64) bucket.State, add bool) {
	sh, id := lb.locate(b)
	now := lb.now()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	st, ok := sh.states.get(id)
	if !ok && !add {
		return
	}
	if !ok {
		if lb.count.Load() >= lb.maxKeys.Load() {
			lb.makeRoom(sh, now, id)
		}
		lb.count.Add(1)
	}
	sh.states.put(id, f(st, now))
}

func (lb *localBuckets) reset(b *Bucket) {
	sh, id := lb.locate(b)
	sh.mu.Lock()
	before := sh.states.n
	for i := range bucket.MaxLimits + bucket.MaxQuotas {
		sh.states.remove(limitID(id, i))
	}
	lb.count.Add(int64(sh.states.n - before))
	sh.mu.Unlock()
}

// makeRoom frees at least a 32nd of the shard, so that the sweep's cost is
// spread over many inserts. Full buckets go first: dropping one changes no
// decision. Only then are live buckets dropped, from a place in the table
// that the incoming hash picks, which is as good as random.
func (lb *localBuckets) makeRoom(sh *localShard, now int64, seed uint64) {
	want := max(1, sh.states.n/32)
	full := sh.states.sweep(0, sh.states.n, func(fullAt int64) bool { return fullAt <= now })
	lb.fullDrops.Add(uint64(full))
	live := 0
	if full < want {
		live = sh.states.sweep(int(seed), want-full, func(int64) bool { return true })
		lb.evictions.Add(uint64(live))
		evictionsTotal.Add(uint64(live))
	}
	lb.count.Add(-int64(full + live))
}

// len counts the buckets held.
func (lb *localBuckets) len() int { return int(lb.count.Load()) }

// live counts the buckets that are not full: a full one decides as no
// bucket does, and stays in the table only until room is needed. It looks
// at every bucket, for the admin API, not the request path.
func (lb *localBuckets) live() int {
	now := lb.now()
	n := 0
	for i := range lb.shards {
		sh := &lb.shards[i]
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

// startLoad empties the table when load, a config load, is not the one
// that last started it: on_store_error local's buckets are a load's own
// (Handler.provisionStore), so that an earlier config's outage neither
// limits clients under the running one nor counts in its keys. A nil load
// (a handler provisioned outside a config) changes nothing. In-flight
// slots stay: their requests still run.
func (lb *localBuckets) startLoad(load any) {
	lb.loadMu.Lock()
	defer lb.loadMu.Unlock()
	if load == nil || load == lb.load {
		return
	}
	lb.load = load
	for i := range lb.shards {
		sh := &lb.shards[i]
		sh.mu.Lock()
		lb.count.Add(-int64(sh.states.n))
		sh.states = stateTable{}
		sh.mu.Unlock()
	}
}

// Interface guards
var (
	_ policyStore           = (*LocalStore)(nil)
	_ StoreReporter         = (*LocalStore)(nil)
	_ caddy.Validator       = (*LocalStore)(nil)
	_ caddy.CleanerUpper    = (*LocalStore)(nil)
	_ caddyfile.Unmarshaler = (*LocalStore)(nil)
)
