package ratelimit

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// on_store_error local reconcile: what a node admitted alone while its
// shared store failed is charged to the shared buckets once a call to the
// store succeeds again, so that over a cut the fleet admits about what one
// bucket would (docs/fleet.md). Requests a lease covered were decided by
// the lease table, not the fallback, and are not counted here.
//
// The counts live in a map of their own, bounded (Handler.owedMax, by
// default the fallback's max keys), not in the fallback's table: a bucket
// the table drops keeps its count, and a bucket first admitted once the
// map is full loses it, counted (reconcileLostTokens) and logged.

// reconciler counts, per bucket, what the fallback admitted (taken minus
// given back) until the store is charged with it.
type reconciler struct {
	policy  string
	store   store
	log     *zap.Logger
	now     func() int64 // monotonic µs: the hold-off after a failed pass
	max     int
	timeout time.Duration
	lost    prometheus.Counter
	charged prometheus.Counter

	// pending says owed holds counts not charged yet: all the request path
	// reads while the store answers.
	pending atomic.Bool
	mu      sync.Mutex
	// passDone is signalled when a pass ends.
	passDone *sync.Cond
	owed     map[uint64]*owedCount
	running  bool
	// settled, while a pass runs, is what the request path gave back or
	// forgave of the buckets the pass is charging: a charge that fails
	// goes back into owed less that.
	settled map[uint64]settlement
	// closed: the config unloaded (drain); what comes later is lost.
	closed  bool
	retryAt int64
}

// owedCount is one bucket's count: its name, the tier as written, which
// the shared store enforces, and the tokens. The name keeps the digest of
// the client's value (Bucket.Digest), which is all a digestCharger needs:
// a flood of long keys during a cut costs no more memory than short ones,
// and no client value is kept. For any other store, the value is copied
// too, as the request's buffer is reused.
type owedCount struct {
	b    Bucket
	sum  [sha256.Size]byte
	tier *Tier
	n    int64
	// state is owedPending, then owedCharged or owedLost, once.
	state atomic.Int32
}

// settlement is what happened to a bucket's count while its charge was
// out: tokens given back, or an admin reset that forgave it.
type settlement struct {
	back     int64
	forgiven bool
}

const (
	owedPending int32 = iota
	owedCharged
	owedLost
)

// digestCharger is a store that charges a bucket named by its policy,
// tier and digest (Bucket.Digest), without the client's value.
type digestCharger interface {
	chargeDigest(ctx context.Context, policy, tier string, sum *[sha256.Size]byte, tr bucket.Tier, n int64) error
}

// reconcileRetry is how long a node waits after a pass whose charges
// failed (the store answered a take, then failed again) before it tries
// the rest again: those that surely did not land (mayHaveLanded).
const reconcileRetry = time.Second

// reconcileWorkers bounds the charges in flight at once, each bucket's
// one call.
const reconcileWorkers = 4

// mayHaveLanded says whether a charge that failed with err may have
// reached the store and been applied: it got no answer in time.
func mayHaveLanded(err error) bool {
	var netErr net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout()
}

// storeTimeouter is a store whose calls are bounded by a timeout: a config
// that unloads waits that long for its charges.
type storeTimeouter interface {
	callTimeout() time.Duration
}

func (s *RedisStore) callTimeout() time.Duration {
	return cmp.Or(time.Duration(s.Timeout), 100*time.Millisecond)
}

func newReconciler(h *Handler, bound int) *reconciler {
	o := &reconciler{
		policy: h.Name, store: h.store, log: h.storeLog, now: h.clocks.now, max: bound,
		timeout: 100 * time.Millisecond,
		lost:    reconcileLostTokens.WithLabelValues(h.Name),
		charged: reconciledTokens.WithLabelValues(h.Name),
		owed:    make(map[uint64]*owedCount),
	}
	if st, ok := h.store.(storeTimeouter); ok {
		o.timeout = st.callTimeout()
	}
	o.passDone = sync.NewCond(&o.mu)
	return o
}

// add counts n tokens the fallback admitted in the bucket b of tier t (the
// fallback's copy: its tier as written is charged).
func (o *reconciler) add(b *Bucket, t *Tier, n int64) {
	if n <= 0 {
		return
	}
	id := localID(b)
	o.mu.Lock()
	defer o.mu.Unlock()
	c := o.owed[id]
	if c == nil {
		sum := b.Digest()
		if o.closed || len(o.owed) >= o.max {
			o.lose(&sum, t, n, "the count of what this node admitted alone is lost: too many buckets to count, or the config unloaded")
			return
		}
		c = &owedCount{b: *b, sum: sum, tier: t.asWritten()}
		c.b.Value = nil
		if _, ok := o.store.(digestCharger); !ok {
			c.b.Value = append([]byte(nil), b.Value...)
		}
		o.owed[id] = c
	}
	c.n += n
	o.pending.Store(true)
}

// sub takes back n tokens the fallback gave back (count_status, max_wait,
// concurrency). A bucket charged already keeps its charge: the store gave
// the client nothing back either.
func (o *reconciler) sub(b *Bucket, n int64) {
	id := localID(b)
	o.mu.Lock()
	defer o.mu.Unlock()
	if c := o.owed[id]; c != nil {
		if c.n -= n; c.n <= 0 {
			delete(o.owed, id)
		}
	} else if o.running {
		st := o.settled[id]
		st.back += n
		o.settled[id] = st
	}
}

// forget drops the bucket b's count: an admin reset forgave it.
func (o *reconciler) forget(b *Bucket) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := localID(b)
	delete(o.owed, id)
	if o.running {
		o.settled[id] = settlement{forgiven: true}
	}
}

// lose counts and logs n tokens of the bucket of digest sum that will not
// be charged. Only the key id (keyID) names the client.
func (o *reconciler) lose(sum *[sha256.Size]byte, t *Tier, n int64, msg string) {
	o.lost.Add(float64(n))
	o.log.Warn(msg, zap.String("policy", o.policy), zap.String("tier", t.Name), zap.String("key_id", hex.EncodeToString(sum[:8])), zap.Int64("tokens", n))
}

// charge charges c's bucket its count, by digest when the store can.
func (o *reconciler) charge(c *owedCount) error {
	if dc, ok := o.store.(digestCharger); ok {
		return dc.chargeDigest(context.Background(), c.b.Policy, c.b.Tier, &c.sum, c.tier.shape(), c.n)
	}
	return o.store.charge(context.Background(), &c.b, c.tier.shape(), c.n)
}

// storeAnswered starts a pass in the background, when counts wait and
// none runs: a call to the store just succeeded.
func (o *reconciler) storeAnswered() {
	if !o.pending.Load() {
		return
	}
	o.mu.Lock()
	if o.running || o.closed || o.now() < o.retryAt {
		o.mu.Unlock()
		return
	}
	batch := o.owed
	o.owed = make(map[uint64]*owedCount)
	o.pending.Store(false)
	o.running = true
	o.settled = make(map[uint64]settlement)
	o.mu.Unlock()
	go o.pass(batch)
}

// pass charges each bucket of batch its count, one call each, and keeps
// the counts whose charge failed for a later pass.
func (o *reconciler) pass(batch map[uint64]*owedCount) {
	o.chargeAll(batch)
	o.mu.Lock()
	defer o.mu.Unlock()
	failed := false
	var charged, tokens int64
	for id, c := range batch {
		switch c.state.Load() {
		case owedCharged:
			charged, tokens = charged+1, tokens+c.n
			continue
		case owedLost:
			continue
		}
		failed = true
		if st := o.settled[id]; st.forgiven || st.back >= c.n {
			continue // given back or forgiven while its charge was out
		}
		c.n -= o.settled[id].back
		if o.closed {
			o.lose(&c.sum, c.tier, c.n, "the count of what this node admitted alone is lost: the config unloaded before the store answered")
			continue
		}
		if now := o.owed[id]; now != nil {
			now.n += c.n
		} else if len(o.owed) >= o.max {
			o.lose(&c.sum, c.tier, c.n, "the count of what this node admitted alone is lost: too many buckets to count")
		} else {
			c.state.Store(owedPending)
			o.owed[id] = c
		}
	}
	if charged > 0 {
		o.log.Info("the store answers again: charged the shared buckets what this node admitted alone",
			zap.String("policy", o.policy), zap.Int64("buckets", charged), zap.Int64("tokens", tokens), zap.Int("left", len(o.owed)))
	}
	if failed {
		o.retryAt = o.now() + reconcileRetry.Microseconds()
		o.pending.Store(len(o.owed) > 0)
	}
	o.running = false
	o.settled = nil
	o.passDone.Broadcast()
}

// chargeAll charges each bucket of batch its count through the store, as
// cost_from_response does, reconcileWorkers calls at a time, and marks
// each charged.
func (o *reconciler) chargeAll(batch map[uint64]*owedCount) {
	work := make(chan *owedCount)
	var wg sync.WaitGroup
	for range min(reconcileWorkers, len(batch)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := range work {
				err := o.charge(c)
				switch {
				case err == nil:
					if c.state.CompareAndSwap(owedPending, owedCharged) {
						o.charged.Add(float64(c.n))
					}
				case mayHaveLanded(err):
					// Tried again, it could be charged twice.
					if c.state.CompareAndSwap(owedPending, owedLost) {
						o.lose(&c.sum, c.tier, c.n, "the count of what this node admitted alone is not charged again: its charge got no answer in time, and may have landed")
					}
				}
			}
		}()
	}
	for _, c := range batch {
		work <- c
	}
	close(work)
	wg.Wait()
}

// drain charges, when the config unloads, what the fallback admitted and
// no pass charged yet, within the store's timeout; the rest is lost. It
// runs before Caddy cleans up the store (caddy.Context.OnCancel).
func (o *reconciler) drain() {
	o.mu.Lock()
	o.closed = true
	for o.running {
		o.passDone.Wait()
	}
	batch := o.owed
	o.owed = make(map[uint64]*owedCount)
	o.pending.Store(false)
	o.mu.Unlock()
	if len(batch) == 0 {
		return
	}
	done := make(chan struct{})
	go func() {
		o.chargeAll(batch)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(o.timeout):
	}
	for _, c := range batch {
		if c.state.CompareAndSwap(owedPending, owedLost) {
			o.lose(&c.sum, c.tier, c.n, "the count of what this node admitted alone is lost: the config unloaded before the store answered")
		}
	}
}

// unloadHooks are, by store, what runs when the store's config unloads,
// before the store lets go of its connection: a handler's drain, which
// Caddy may clean up after its store.
var unloadHooks = struct {
	sync.Mutex
	m map[store][]func()
}{m: make(map[store][]func())}

// beforeStoreUnloads has f run when s unloads, before it lets go.
func beforeStoreUnloads(s store, f func()) {
	unloadHooks.Lock()
	defer unloadHooks.Unlock()
	unloadHooks.m[s] = append(unloadHooks.m[s], f)
}

// storeUnloading runs what waits for s to unload, once.
func storeUnloading(s store) {
	unloadHooks.Lock()
	fs := unloadHooks.m[s]
	delete(unloadHooks.m, s)
	unloadHooks.Unlock()
	for _, f := range fs {
		f()
	}
}

// wait returns once no pass runs, for tests.
func (o *reconciler) wait() {
	o.mu.Lock()
	defer o.mu.Unlock()
	for o.running {
		o.passDone.Wait()
	}
}

var (
	reconciledTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "reconciled_tokens_total",
		Help: "Tokens this node admitted alone while its shared store failed (on_store_error local reconcile), charged to the shared buckets once the store answered, by policy.",
	}, []string{"policy"})

	reconcileLostTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "reconcile_lost_tokens_total",
		Help: "Tokens this node admitted alone while its shared store failed (on_store_error local reconcile) that it will not charge: buckets beyond the fallback's max keys, not charged within the store's timeout when a config unloaded, or whose charge got no answer in time and may have landed, by policy.",
	}, []string{"policy"})
)

// registerReconcileMetrics adds reconcile's counters to a config's registry.
func registerReconcileMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{reconciledTokens, reconcileLostTokens} {
		if err := reg.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				return err
			}
		}
	}
	return nil
}

// Interface guards
var (
	_ storeTimeouter = (*RedisStore)(nil)
	_ digestCharger  = (*RedisStore)(nil)
)
