package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Fleet leases (DESIGN section 9): a node takes several tokens of a shared
// bucket at once, in one script call, and decides the requests they cover
// in memory. Redis keeps each bucket exactly as in strict mode, so the
// fleet never admits more than strict mode would: a token is either in the
// shared bucket, held by one node, or spent.
//
// A node's first lease for a bucket is the request's cost, so a client seen
// once costs one call, as in strict mode. Each later lease doubles, up to
// the lease size, when the node spent the last one within lease_ttl (half
// of it for a prefetch). Once leases are larger than the cost, the next is
// fetched in the background when the tokens held fall to half. Requests
// that find no tokens share one call in flight per bucket. A lease that is
// refused, or partly granted, says how long until the shared bucket covers
// the node's next lease; until then the node answers from memory and makes
// no call for that bucket. Tokens unused lease_ttl after they were leased
// go back to the shared bucket, as do all of them when the config is
// unloaded.

// leaseShards spreads the lease table over locks.
const leaseShards = 64

// leaseRemote is the shared store as leases see it: the Redis store, or
// a model of it in tests.
type leaseRemote interface {
	lease(key string, l Limit, cost, want int64) (LeaseResult, error)
	giveBack(back []giveBack) (int64, error)
}

// leaseTable is one store's leases, by Redis key.
type leaseTable struct {
	store  leaseRemote
	size   leaseSize
	ttl    int64 // µs
	now    func() int64
	seed   maphash.Seed
	shards [leaseShards]leaseShard
	// perShard bounds each shard's entries.
	perShard int
	logger   *zap.Logger

	stop    chan struct{}
	closed  atomic.Bool
	calls   sync.WaitGroup // fetches and give-backs in flight
	janitor sync.WaitGroup
}

type leaseShard struct {
	mu sync.Mutex
	m  map[string]*lease
}

// lease is what this node holds of one shared bucket.
type lease struct {
	key   string
	limit Limit
	// tokens are the leased tokens not yet spent.
	tokens int64
	// size is the size of the last lease asked for, 0 before the first.
	size     int64
	leasedAt int64
	// level and resetAt are the shared bucket as the last call saw it.
	level   int64
	resetAt int64
	// holdUntil: no call for this bucket before then.
	holdUntil int64
	lastUsed  int64
	call      *leaseCall
}

// leaseCall is one lease call in flight, which requests share.
type leaseCall struct {
	done chan struct{}
	err  error
	// banned: the call's refusal started a ban.
	banned bool
	// short: the call got fewer tokens than it asked for, so the shared
	// bucket is empty for now and strict mode would refuse too.
	short bool
	// joined counts the requests that wait on the call besides its own.
	joined int
}

// leaseSize is the lease setting: a number of tokens, or a share of each
// tier's capacity.
type leaseSize struct {
	tokens  int64
	percent float64
}

// parseLeaseSize reads `<n>` or `<p>%`. The empty setting is 1: strict.
func parseLeaseSize(s string) (leaseSize, error) {
	if s == "" {
		return leaseSize{tokens: 1}, nil
	}
	if p, ok := strings.CutSuffix(s, "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || !(f > 0 && f <= 100) {
			return leaseSize{}, fmt.Errorf("store redis: lease %q: want a share above 0%% and at most 100%%, such as 10%%", s)
		}
		return leaseSize{percent: f}, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 {
		return leaseSize{}, fmt.Errorf("store redis: lease %q: want a whole number of tokens, at least 1, or a share such as 10%%", s)
	}
	return leaseSize{tokens: n}, nil
}

// of is the lease size for a bucket of limit l: at least 1, at most the
// capacity.
func (z leaseSize) of(l Limit) int64 {
	if z.percent > 0 {
		return max(1, int64(float64(l.Capacity)*z.percent/100))
	}
	return min(z.tokens, l.Capacity)
}

// strict reports whether leases never exceed one token, so that every
// decision asks Redis, as without leases.
func (z leaseSize) strict() bool { return z.percent == 0 && z.tokens <= 1 }

func newLeaseTable(remote leaseRemote, now func() int64, size leaseSize, ttl time.Duration, maxEntries int, logger *zap.Logger) *leaseTable {
	t := &leaseTable{
		store:    remote,
		size:     size,
		ttl:      ttl.Microseconds(),
		now:      now,
		seed:     maphash.MakeSeed(),
		perShard: max(1, maxEntries/leaseShards),
		logger:   logger,
		stop:     make(chan struct{}),
	}
	for i := range t.shards {
		t.shards[i].m = make(map[string]*lease)
	}
	t.janitor.Add(1)
	go t.sweepEvery(max(ttl/4, 10*time.Millisecond))
	return t
}

func (t *leaseTable) shard(key []byte) *leaseShard {
	return &t.shards[maphash.Bytes(t.seed, key)%leaseShards]
}

// take decides one request from this node's lease on the bucket at key,
// fetching a lease when the tokens held do not cover it.
func (t *leaseTable) take(ctx context.Context, key []byte, l Limit, cost int64) (Result, error) {
	sh := t.shard(key)
	sh.mu.Lock()
	now := t.now()
	e := sh.m[string(key)]
	if e == nil {
		e = t.insert(sh, string(key), l, now)
	}
	e.limit, e.lastUsed = l, now
	waited, banned := false, false
	for {
		if e.tokens >= cost {
			e.tokens -= cost
			if e.tokens*2 < e.size && e.size > cost && e.call == nil && now >= e.holdUntil {
				t.fetch(e, cost, now, true)
			}
			res := e.result(now, true, cost)
			sh.mu.Unlock()
			return res, nil
		}
		if now < e.holdUntil || waited {
			res := e.result(now, false, cost)
			res.Banned = banned
			sh.mu.Unlock()
			return res, nil
		}
		c, mine := e.call, false
		if c == nil {
			c, mine = t.fetch(e, cost, now, false), true
		} else {
			c.joined++
		}
		sh.mu.Unlock()
		select {
		case <-c.done:
		case <-ctx.Done():
			return Result{}, fmt.Errorf("redis store: lease: %w", ctx.Err())
		}
		if c.err != nil {
			return Result{}, c.err
		}
		banned = mine && c.banned
		sh.mu.Lock()
		// A short lease means the shared bucket is empty: the requests it
		// did not cover are refused, with no second round trip. A full one
		// that others spent first (a small early lease) leaves the shared
		// bucket holding more: ask again, as strict mode would.
		now, waited = t.now(), c.short
		if sh.m[string(key)] != e {
			// Evicted meanwhile: its tokens went back.
			sh.mu.Unlock()
			return Result{RetryAfter: 1}, nil
		}
	}
}

// result is the answer for a request decided from e at now.
func (e *lease) result(now int64, allowed bool, cost int64) Result {
	res := Result{Allowed: allowed, Remaining: e.tokens + e.level, ResetAfter: max(0, e.resetAt-now)}
	if !allowed {
		res.Remaining = e.tokens
		res.RetryAfter = e.holdUntil - now
		if res.RetryAfter <= 0 {
			// The call in flight gave too little for every request that
			// waited on it: the shared bucket is empty for now.
			res.RetryAfter = ceilDiv(cost*e.limit.Rate.Interval, e.limit.Rate.Tokens)
		}
	}
	return res
}

// insert adds an entry for key, first making room in a full shard.
func (t *leaseTable) insert(sh *leaseShard, key string, l Limit, now int64) *lease {
	if len(sh.m) >= t.perShard {
		t.evict(sh, now)
	}
	e := &lease{key: key, limit: l}
	sh.m[key] = e
	return e
}

// evict drops one entry of a full shard: an idle one if it can, giving
// back any tokens it holds. An entry with a call in flight stays.
func (t *leaseTable) evict(sh *leaseShard, now int64) {
	var victim *lease
	for _, e := range sh.m {
		if e.call != nil {
			continue
		}
		if victim == nil || e.tokens == 0 && victim.tokens != 0 || e.lastUsed < victim.lastUsed {
			victim = e
		}
	}
	if victim == nil {
		return
	}
	delete(sh.m, victim.key)
	if victim.tokens > 0 {
		t.giveBackLater([]giveBack{{victim.key, victim.limit, victim.tokens}})
	}
	leaseEvictions.Inc()
}

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
			want = min(2*e.size, max(cost, t.size.of(e.limit)))
		}
	}
	c := &leaseCall{done: make(chan struct{})}
	if t.closed.Load() {
		// A request still in flight through an unloaded config.
		c.err = errLeasesClosed
		close(c.done)
		return c
	}
	e.call = c
	t.calls.Add(1)
	go func(key string, l Limit) {
		defer t.calls.Done()
		lr, err := t.store.lease(key, l, cost, want)
		sh := t.shard([]byte(key))
		sh.mu.Lock()
		now := t.now()
		if err == nil {
			t.apply(e, lr, want, now)
		}
		e.call = nil
		c.err, c.banned, c.short = err, lr.Banned, lr.Granted < want
		sh.mu.Unlock()
		close(c.done)
	}(e.key, e.limit)
	return c
}

// apply records a lease call's answer in e.
func (t *leaseTable) apply(e *lease, lr LeaseResult, want, now int64) {
	e.size = want
	e.level, e.resetAt = lr.Remaining, now+lr.ResetAfter
	e.holdUntil = 0
	if lr.HoldOff > 0 {
		e.holdUntil = now + lr.HoldOff
	}
	if lr.Granted > 0 {
		e.tokens += lr.Granted
		e.leasedAt = now
		leasesTotal.WithLabelValues(leaseOutcome(lr.Granted, want)).Inc()
	} else {
		leasesTotal.WithLabelValues("refused").Inc()
	}
}

func leaseOutcome(granted, want int64) string {
	if granted < want {
		return "partial"
	}
	return "granted"
}

// giveBackHeld returns n tokens to this node's lease on the bucket at key,
// if it holds one: they were taken from it.
func (t *leaseTable) giveBackHeld(key []byte, n int64) bool {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil {
		return false
	}
	e.tokens += n
	return true
}

// reset drops this node's lease on the bucket at key: its tokens are not
// given back, since the shared bucket is reset too.
func (t *leaseTable) reset(key []byte) {
	sh := t.shard(key)
	sh.mu.Lock()
	if e := sh.m[string(key)]; e != nil && e.call == nil {
		delete(sh.m, e.key)
	} else if e != nil {
		e.tokens, e.holdUntil = 0, 0
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

// giveBack is unused leased tokens on their way back to a shared bucket.
type giveBack struct {
	key    string
	limit  Limit
	tokens int64
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
// or, with all, every one. It forgets entries idle for lease_ttl.
func (t *leaseTable) sweep(now int64, all bool) []giveBack {
	var back []giveBack
	for i := range t.shards {
		sh := &t.shards[i]
		sh.mu.Lock()
		for key, e := range sh.m {
			if e.call != nil {
				continue
			}
			if e.tokens > 0 && (all || now-e.leasedAt >= t.ttl) {
				back = append(back, giveBack{key, e.limit, e.tokens})
				e.tokens = 0
			}
			if e.tokens == 0 && now-e.lastUsed >= t.ttl && now >= e.holdUntil {
				delete(sh.m, key)
			}
		}
		sh.mu.Unlock()
	}
	return back
}

// giveBackLater gives tokens back in the background.
func (t *leaseTable) giveBackLater(back []giveBack) {
	t.calls.Add(1)
	go func() {
		defer t.calls.Done()
		t.giveBackNow(back)
	}()
}

// giveBackNow returns tokens to their shared buckets, in one pipeline. A
// give-back that fails loses its tokens, which only ever admits less.
func (t *leaseTable) giveBackNow(back []giveBack) {
	n, err := t.store.giveBack(back)
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
	t.closed.Store(true)
	// A fetch starts under its shard's lock: once every lock has been held
	// since closed was set, none can start, so the waits below see them all.
	for i := range t.shards {
		t.shards[i].mu.Lock()
		//lint:ignore SA2001 the empty critical section is the point: it waits out fetches starting
		t.shards[i].mu.Unlock()
	}
	close(t.stop)
	t.janitor.Wait()
	t.calls.Wait()
	if back := t.sweep(t.now(), true); len(back) > 0 {
		t.giveBackNow(back)
	}
}

// Lease metrics, registered with the others.
var (
	leasesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "leases_total",
		Help: "Lease calls to the shared store, by result: granted, partial or refused.",
	}, []string{"result"})
	leaseTokensReturned = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "lease_tokens_returned_total",
		Help: "Leased tokens given back unused to the shared store.",
	})
	leaseEvictions = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "lease_evictions_total",
		Help: "Lease entries dropped to keep this node's lease table within its bound.",
	})
)

// lease takes a lease of want tokens on the bucket at key, for a request
// costing cost, within the timeout and through the breaker.
func (s *RedisStore) lease(key string, l Limit, cost, want int64) (LeaseResult, error) {
	args := []any{l.Capacity, l.Rate.Tokens, l.Rate.Interval, cost, s.clockOffset, want, l.Ban}
	vals, err := s.call(context.Background(), leaseBucketScript, key, args, false)
	if err != nil {
		return LeaseResult{}, err
	}
	return LeaseResult{Granted: vals[0], Remaining: vals[1], HoldOff: vals[2], ResetAfter: vals[3], Banned: len(vals) == 6 && vals[5] == 1}, nil
}

// giveBack returns unused leased tokens to their buckets in one pipeline,
// and reports how many went back.
func (s *RedisStore) giveBack(back []giveBack) (int64, error) {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return 0, errBreakerOpen
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	run := func(pipe redis.Pipeliner, g giveBack) *redis.Cmd {
		return giveBackBucketScript.EvalSha(ctx, pipe, []string{g.key}, g.limit.Capacity, g.limit.Rate.Tokens, g.limit.Rate.Interval, g.tokens, s.clockOffset)
	}
	cmds := make([]*redis.Cmd, len(back))
	_, err := s.conn.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, g := range back {
			cmds[i] = run(pipe, g)
		}
		return nil
	})
	var returned int64
	var failed error
	for i, cmd := range cmds {
		err := cmd.Err()
		if redis.HasErrorPrefix(err, "NOSCRIPT") {
			// Redis lost its scripts (a restart, a failover): EVAL loads it.
			err = giveBackBucketScript.Run(ctx, s.conn.client, []string{back[i].key}, back[i].limit.Capacity, back[i].limit.Rate.Tokens, back[i].limit.Rate.Interval, back[i].tokens, s.clockOffset).Err()
		}
		if err == nil {
			returned += back[i].tokens
		} else if failed == nil {
			failed = err
		}
	}
	if failed == nil && err != nil && !redis.HasErrorPrefix(err, "NOSCRIPT") {
		failed = err
	}
	s.record(ctx, probe, failed)
	if failed != nil {
		return returned, s.wrap(failed)
	}
	return returned, nil
}
