package ratelimit

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// The stores: the contract every store implements, the bucket it keys,
// and the local store module (Redis's is in store_redis.go).

// Bucket names one client's bucket: the policy, the tier, the keyer that
// named the client and the value it read. Stores hash it: the value is
// whatever the client sent and is never stored or shown in clear.
type Bucket struct {
	Policy string
	Tier   string
	Keyer  string
	Value  []byte
	// secret keys the digest of Keyer and Value (key_secret), when set.
	secret string
	// prefix is the local store's hash of Policy, Tier and Keyer
	// (bucketIDs.Prefix), which the handler keeps for each tier and
	// keyer; 0 when not at hand, and then hashed afresh (localID). A copy
	// renamed (another Policy, Tier or Keyer) must set it to 0.
	prefix uint64
}

// Digest hashes the client part of a bucket's name: the keyer and the
// value, with HMAC-SHA256 under key_secret when there is one, else plain
// SHA-256. It is stable across processes, for stores shared by several
// nodes.
func (b *Bucket) Digest() [sha256.Size]byte {
	if len(b.secret) == 0 && len(b.Keyer)+1+len(b.Value) <= 256 {
		// Most keys are short: hashed from the stack, with no allocation.
		var buf [256]byte
		n := copy(buf[:], b.Keyer)
		n++ // the 0 between keyer and value
		n += copy(buf[n:], b.Value)
		return sha256.Sum256(buf[:n])
	}
	var h hash.Hash
	if len(b.secret) > 0 {
		h = hmac.New(sha256.New, []byte(b.secret))
	} else {
		h = sha256.New()
	}
	h.Write([]byte(b.Keyer))
	h.Write([]byte{0})
	h.Write(b.Value)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// keyID is a fingerprint of a bucket's client, for logs, the admin API and
// the {http.rate_limit.key_id} placeholder: the first 8 bytes of its digest.
func keyID(b *Bucket) string {
	sum := b.Digest()
	return hex.EncodeToString(sum[:8])
}

// store keeps buckets: the local store, Redis (strict or with leases) and
// the on_store_error local fallback. Every call takes the tier's shape,
// its limits then its quotas (bucket.Tier), and writes or reads each one's
// result in that order, so that the handler writes each step once,
// whatever the shape and the store. Calls on one bucket are atomic: two
// concurrent takes behave as if one came first.
type store interface {
	// take applies a request costing cost to every limit and quota of
	// the bucket, all or none: it writes each one's result into out
	// (room for tr.Parts()) and reports whether the request was allowed.
	take(ctx context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error)
	// peek reports every limit and quota of the bucket into out, as take
	// does, changing nothing and starting no ban.
	peek(ctx context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error
	// giveBack returns limitsN tokens to every limit, up to its capacity,
	// and n, which a request took at the moment at (Unix µs), to every
	// quota while the period that counted them lasts: for count_status,
	// max_wait and concurrency, when a request does not keep what it
	// took. limitsN is at most n: after a reload that changed the limits,
	// what they may take back. A tier of no quota gives back limitsN.
	giveBack(ctx context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error
	// charge takes n more tokens from every limit and quota after the
	// fact, for cost_from_response: a limit may go into debt.
	charge(ctx context.Context, b *Bucket, tr bucket.Tier, n int64) error
	// reset makes the bucket full again.
	reset(ctx context.Context, b *Bucket) error
	// acquire takes one of n in-flight slots of the bucket (concurrency):
	// it reports the slot to free, how many are in use with it, and
	// whether it got one.
	acquire(ctx context.Context, b *Bucket, n int64) (slot uint64, inUse int64, ok bool, err error)
	// release frees a slot acquire gave.
	release(b *Bucket, slot uint64)
	// inFlight is the bucket's slots in use.
	inFlight(ctx context.Context, b *Bucket) (int64, error)
}

// reporter is a store that says how it stands, for GET
// /rate_limit/policies. A store that is not one is shown by name alone.
type reporter interface {
	report() storeReport
}

// storeReport is how a store stands on this node.
type storeReport struct {
	// keys is the buckets it holds in this process's memory.
	keys int
	// breaker is closed, open or half-open, for a store with one.
	breaker string
	// leases is the buckets this node holds leased tokens of.
	leases int
	// master is the address of the master in use, for a store that finds
	// it through Sentinel.
	master string
	// rtt is the measured round trip to a shared store, 0 before its
	// first answer and for the local store.
	rtt time.Duration
}

// layeredResetter is a store whose reset clears several layers, some on
// this node whatever becomes of the others (a deny cache before Redis): it
// resets each, and names them with each one's error, for DELETE
// /rate_limit/buckets.
type layeredResetter interface {
	resetLayers(ctx context.Context, b *Bucket) (layers []string, errs []error)
}

// leaseHolder is a store whose node may hold tokens of a bucket apart from
// it (Redis leases): a request they cover is allowed on this node whatever
// the bucket holds. Its peek counts them in each remaining.
type leaseHolder interface {
	// held is how many tokens of the bucket b this node holds and may
	// spend now.
	held(b *Bucket) int64
}

// policyStore is a store that keeps each policy's buckets apart, in this
// process: the handler binds it to its policy once it has loaded it, and
// needs no fallback beside it (on_store_error local).
type policyStore interface {
	store
	bind(policy string, c clocks) error
}

// leaseWarner is a store that warns, at load, of what its settings make
// of the tiers (a lease the tiers' capacities cap).
type leaseWarner interface {
	warnLeaseCaps(logger *zap.Logger, tiers []*Tier)
}

// roundTripWatcher is a store that measures its round trip, 0 before its
// first answer, and warns, as it runs, of settings too small for it
// (docs/operating.md).
type roundTripWatcher interface {
	roundTrip() time.Duration
	watchRoundTrip(logger *zap.Logger, tiers []*Tier)
}

// processStart anchors the monotonic clock. One is added so that the zero
// State, full at time 0, is full at every time the clock gives.
var processStart = time.Now()

func monotonicMicros() int64 { return time.Since(processStart).Microseconds() + 1 }

// monotonicAt is monotonicMicros at the moment t, a reading of time.Now:
// computed from t's monotonic reading, as time.Since is, with no clock
// read of its own.
func monotonicAt(t time.Time) int64 { return t.Sub(processStart).Microseconds() + 1 }

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

	buckets *localbucket.Store
	key     string
}

// CaddyModule returns the Caddy module information.
func (LocalStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.local",
		New: func() caddy.Module { return new(LocalStore) },
	}
}

// defaultMaxKeys is max_keys when the config does not say.
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

// localPool holds one bucket table per policy, across config reloads:
// "local/" and the policy's name for its local store, fallbackPoolPrefix
// and the name for its on_store_error local fallback. No policy's name
// puts one in the other's place.
var localPool = caddy.NewUsagePool()

// fallbackPoolPrefix starts the localPool key of an on_store_error local
// fallback's table.
const fallbackPoolPrefix = "on_store_error/"

// bind implements policyStore: the store takes the policy's table, which
// every loaded config of the policy shares, across reloads; a new table
// reads the clocks c.
func (s *LocalStore) bind(policy string, c clocks) error { return s.bindKey("local/"+policy, c) }

// bindKey takes the table of localPool at key; a new table reads the
// clocks c.
func (s *LocalStore) bindKey(key string, c clocks) error {
	if err := s.Validate(); err != nil {
		return err
	}
	s.key = key
	val, loaded, err := localPool.LoadOrNew(s.key, func() (caddy.Destructor, error) {
		return localbucket.New(localOptions(s.maxKeys(), c)), nil
	})
	if err != nil {
		return err
	}
	s.buckets = val.(*localbucket.Store)
	if loaded {
		s.buckets.SetMaxKeys(s.maxKeys())
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

func (s *LocalStore) take(_ context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	return s.buckets.Take(localID(b), tr, cost, out), nil
}

// takeAt is take at the moment at, which the handler read, when the
// policy's table reads the process's clocks: it saves the request a clock
// read (localbucket.Store.TakeAt).
func (s *LocalStore) takeAt(b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result, at time.Time) bool {
	return s.buckets.TakeAt(localID(b), tr, cost, out, monotonicAt(at), at.UnixMicro())
}

func (s *LocalStore) peek(_ context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error {
	s.buckets.Peek(localID(b), tr, out)
	return nil
}

func (s *LocalStore) giveBack(_ context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error {
	s.buckets.GiveBack(localID(b), tr, limitsN, n, at)
	return nil
}

func (s *LocalStore) charge(_ context.Context, b *Bucket, tr bucket.Tier, n int64) error {
	s.buckets.Charge(localID(b), tr, n)
	return nil
}

func (s *LocalStore) reset(_ context.Context, b *Bucket) error {
	s.buckets.Reset(localID(b))
	return nil
}

// acquire counts the slot beside the policy's buckets, under the same
// shard lock, only while requests are in flight.
func (s *LocalStore) acquire(_ context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	inUse, ok := s.buckets.Acquire(localID(b), n)
	return 0, inUse, ok, nil
}

func (s *LocalStore) release(b *Bucket, _ uint64) { s.buckets.Release(localID(b)) }

func (s *LocalStore) inFlight(_ context.Context, b *Bucket) (int64, error) {
	return s.buckets.InFlight(localID(b)), nil
}

// report's keys are the live buckets.
func (s *LocalStore) report() storeReport { return storeReport{keys: s.buckets.Live()} }

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

// clocks are what a handler's local buckets and its record of denials
// read: now, monotonic microseconds, for the limits; wall, microseconds
// since the epoch, for the quotas' calendar.
type clocks struct {
	now, wall func() int64
	// system marks the process's clocks (systemClocks), which a handler
	// reads a request's moment from (decision.start) and hands to its
	// local buckets (LocalStore.takeAt) rather than have them read again.
	system bool
}

func wallMicros() int64 { return time.Now().UnixMicro() }

// systemClocks are the clocks of a handler that was handed none
// (Handler.clocks, which tests of a handler alone set). Tests that load
// Caddy replace them (useFakeClock): they run one at a time anyway, since
// Caddy has one config.
var systemClocks = clocks{now: monotonicMicros, wall: wallMicros, system: true}

// or is c, or the system's clocks when c is the zero value.
func (c clocks) or() clocks {
	if c.now == nil {
		return systemClocks
	}
	return c
}

// localOptions are the engine's settings for a store of maxKeys that
// reads the clocks c.
func localOptions(maxKeys int, c clocks) localbucket.Options {
	return localbucket.Options{MaxKeys: maxKeys, Now: c.now, Wall: c.wall, CallersClocks: c.system, Evictions: &evictionsTotal}
}

// bucketIDs hashes buckets' names for the local stores, under seeds of
// this process, so clients cannot aim for collisions.
var bucketIDs = localbucket.NewHasher()

// localID is the engine's id of a bucket: a keyed hash of its whole name,
// from the prefix the handler keeps when b has it.
func localID(b *Bucket) uint64 {
	p := b.prefix
	if p == 0 {
		p = bucketIDs.Prefix(b.Policy, b.Tier, b.Keyer)
	}
	return bucketIDs.ID(p, b.Value)
}

// localFallback is the local store that decides a policy's requests on
// this node while its shared store fails (on_store_error local): kept
// apart from every policy's own local store (fallbackPoolPrefix), so that
// a policy that switches between local and Redis does not mix the two, and
// emptied at each config load (localbucket.Store.StartLoad), so that an
// earlier config's outage neither limits clients under the running one
// nor counts in its keys.
func localFallback(ctx caddy.Context, policy string, c clocks) (*LocalStore, error) {
	s := new(LocalStore)
	if err := s.bindKey(fallbackPoolPrefix+policy, c); err != nil {
		return nil, err
	}
	if reg := ctx.GetMetricsRegistry(); reg != nil {
		s.buckets.StartLoad(reg)
	}
	return s, nil
}

// Interface guards
var (
	_ policyStore           = (*LocalStore)(nil)
	_ reporter              = (*LocalStore)(nil)
	_ caddy.Validator       = (*LocalStore)(nil)
	_ caddy.CleanerUpper    = (*LocalStore)(nil)
	_ caddyfile.Unmarshaler = (*LocalStore)(nil)
)
