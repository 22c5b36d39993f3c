package redisbucket

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"go.uber.org/zap"
)

// Store is one config's view of a connection: its key prefix and, with
// lease, its lease table. Each decision is one atomic script call on one
// key, timed by the Redis server's clock, unless this node's lease or the
// deny cache already decides it.
type Store struct {
	conn    *Conn
	prefix  string
	timeout time.Duration
	leases  *leaseTable // nil in strict mode
	// releaseLog hands the connection's lines back from Logger, when given.
	releaseLog func()

	// slots are the in-flight slots this node holds (concurrency), made
	// on first use.
	slotsMu     sync.Mutex
	slots       *slotTable
	slotsClosed bool
	slotTTL     time.Duration

	// rtt is the round trip this view's calls measured, and watch the
	// settings it is checked against once WatchRoundTrip is called (rtt.go).
	// sharedRTT, when set, is the meter it shares instead (ShareRoundTrip).
	rtt       rttMeter
	sharedRTT atomic.Pointer[rttMeter]
	watch     atomic.Pointer[rttWatch]

	// boxed is the last lone limit a take sent, its numbers boxed
	// (appendTakeArgs).
	boxed atomic.Pointer[boxedLimit]

	// clockOffset is added to the Redis server's TIME. Only tests set it,
	// to replay traces faster than real time; it is always 0 otherwise.
	clockOffset int64
}

// StoreOptions are a config's settings for its view of a connection.
type StoreOptions struct {
	// Prefix starts every key. Default "rl:".
	Prefix string
	// Lease is how many tokens the node takes at once; strict, the
	// default, asks Redis for every decision.
	Lease LeaseSize
	// LeaseTTL is how long leased tokens may stay unused. Default 1s.
	LeaseTTL time.Duration
	// MaxLeases bounds the lease table's entries. Default DenyCacheSize.
	MaxLeases int
	// Credit is how many requests of a key this node holds no lease entry
	// for it admits at once, charging them in the background
	// (lease_credit.go). Leases only; default 0.
	Credit int64
	// SlotTTL is how long an in-flight slot lives unless its node renews
	// it. Default DefaultSlotTTL, or MinSlotTTL of the timeout if longer.
	SlotTTL time.Duration
	// Current, when set, says what the running config's limits and quotas
	// are for the bucket at key, whose lease was taken under tr, and false
	// when the bucket's tier is gone: leases given back when the config
	// unloads count in it.
	Current func(key string, tr bucket.Tier) (bucket.Tier, bool)
	// OnBan, when set, hears of each ban a lease call started, by the
	// bucket's key: with leases, the request that started it may be gone,
	// so results do not report it.
	OnBan func(key string)
	// Logger, when set, takes the connection's lines while this view is
	// the newest open one that names a logger (Conn.UseLogger).
	Logger *zap.Logger
}

// Defaults of a store's settings.
const (
	DefaultPrefix   = "rl:"
	DefaultLeaseTTL = time.Second
)

// NewStore makes a config's view of conn.
func NewStore(conn *Conn, o StoreOptions) *Store {
	s := &Store{conn: conn, prefix: o.Prefix, timeout: conn.timeout, slotTTL: o.SlotTTL}
	if s.slotTTL <= 0 {
		// The default, unless renewals within a long timeout need more.
		s.slotTTL = max(DefaultSlotTTL, MinSlotTTL(conn.timeout))
	}
	if s.prefix == "" {
		s.prefix = DefaultPrefix
	}
	if o.Logger != nil {
		s.releaseLog = conn.UseLogger(o.Logger)
	}
	if !o.Lease.Strict() {
		ttl := o.LeaseTTL
		if ttl == 0 {
			ttl = DefaultLeaseTTL
		}
		maxLeases := o.MaxLeases
		if maxLeases == 0 {
			maxLeases = conn.denyCapacity
		}
		logger := o.Logger
		if logger == nil {
			logger = zap.NewNop()
		}
		s.leases = newLeaseTable(s, conn.now, o.Lease, ttl, s.timeout, maxLeases, logger)
		s.leases.after = func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
		s.leases.current = o.Current
		s.leases.onBan = o.OnBan
		s.leases.credit, s.leases.failing, s.leases.debts = o.Credit, s.storeFailing, conn.debts
	}
	return s
}

// Close gives back every token this view holds on lease. It takes no new
// slot; the slots its requests hold stay theirs, renewed, until they end:
// a reload does not free the slot of a stream that runs on.
func (s *Store) Close() {
	if s.leases != nil {
		s.leases.close()
	}
	if s.releaseLog != nil {
		s.releaseLog()
	}
	s.slotsMu.Lock()
	t := s.slots
	s.slotsClosed = true
	s.slotsMu.Unlock()
	if t != nil {
		t.retire()
	}
}

// AppendKey appends a bucket's key to buf: the prefix, then the policy and
// the tier, each after its length in bytes, then the first 16 bytes of the
// client's digest in hex, so that client values never reach Redis:
//
//	rl:<len>:<policy>:<len>:<tier>:<32 hex digits>
//
// The lengths keep names apart that hold ":" (policy "a:b" with tier "c"
// and policy "a" with tier "b:c"). It is one key per bucket, with no hash
// tag of its own, so a Cluster spreads the buckets over its masters.
func (s *Store) AppendKey(buf []byte, policy, tier string, digest []byte) []byte {
	buf = append(buf, s.prefix...)
	for _, part := range [...]string{policy, tier} {
		buf = strconv.AppendInt(buf, int64(len(part)), 10)
		buf = append(buf, ':')
		buf = append(buf, part...)
		buf = append(buf, ':')
	}
	return hex.AppendEncode(buf, digest[:16])
}

// SplitKey reads the policy and the tier back from a bucket's key.
func (s *Store) SplitKey(key string) (policy, tier string, ok bool) {
	rest, ok := strings.CutPrefix(key, s.prefix)
	var parts [2]string
	for i := range parts {
		size, after, found := strings.Cut(rest, ":")
		n, err := strconv.Atoi(size)
		if !ok || !found || err != nil || n < 0 || n+1 > len(after) {
			return "", "", false
		}
		parts[i], rest = after[:n], after[n+1:]
	}
	return parts[0], parts[1], true
}

// Take decides one request costing cost on the tier tr of the bucket at
// key, and writes each limit's result into out, then each quota's (room
// for tr.Parts()): from this node's lease when leases are on and larger
// than the cost, which takes from every limit and quota at once; else by
// one script call on the key, which holds them all, unless the deny cache
// already knows the answer. A lone limit's call goes through the batcher.
// A denial is remembered until the retry time of the limit or quota that
// makes the client wait longest: until then, no call.
func (s *Store) Take(ctx context.Context, key []byte, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	return s.TakeNamed(ctx, key, 0, tr, cost, out)
}

// TakeNamed is Take for a caller that also names the bucket by id, its
// own 64-bit hash of the bucket's name, one to one with key (0: none):
// with leases, the next request for it may be decided by TakeHeld.
func (s *Store) TakeNamed(ctx context.Context, key []byte, id uint64, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	out = out[:tr.Parts()]
	if s.Leasing(tr, cost) {
		res, err := s.leases.takeNamed(ctx, key, id, tr, cost, out)
		if !errors.Is(err, errLeasesClosed) {
			return res.Allowed, err
		}
	}
	return s.decide(ctx, string(key), tr, cost, out)
}

// TakeHeld decides a request from the tokens this node holds on the
// bucket of id, as Take would, without the bucket's key (which a caller
// hashes from the client's value): for a bucket a request named by
// TakeNamed before, whose lease covers the cost. ok is false otherwise,
// and the caller calls TakeNamed.
func (s *Store) TakeHeld(id uint64, tr bucket.Tier, cost int64, out []bucket.Result) (allowed, ok bool) {
	if !s.Leasing(tr, cost) {
		return false, false
	}
	res, ok := s.leases.takeByID(id, tr, cost, out[:tr.Parts()])
	return res.Allowed, ok
}

// Leasing says whether a request of cost on tr is decided from leases.
func (s *Store) Leasing(tr bucket.Tier, cost int64) bool {
	return s.leases != nil && cost > 0 && s.leases.size.ofTier(tr) > cost
}

// Peek reports every limit and quota of the tier tr of the bucket at key
// into out, as Take does, in one script call that changes nothing and
// starts no ban. With leases, each remaining counts the tokens this node
// holds of the bucket (Held) besides the shared level, as Take's does:
// the quotas count them as used, but this node may still spend them.
func (s *Store) Peek(ctx context.Context, key []byte, tr bucket.Tier, out []bucket.Result) error {
	out = out[:tr.Parts()]
	if s.leases != nil {
		// A lease call out would be counted in neither (settle).
		s.leases.settle(ctx, key)
	}
	if _, err := s.decideBy(ctx, "peek", string(key), tr, 0, out, false); err != nil {
		return err
	}
	if held := s.Held(key); held > 0 {
		for i := range out {
			out[i].Remaining += held
		}
	}
	return nil
}

// Held is how many tokens of the bucket at key this node holds on lease
// and may spend now, on every limit and quota of its tier at once: a
// request they cover is allowed without Redis. 0 in strict mode.
func (s *Store) Held(key []byte) int64 {
	if s.leases == nil {
		return 0
	}
	return s.leases.heldNow(key)
}

// GiveBack returns the n tokens a request took at the moment at
// (microseconds since the epoch; for a tier with quotas, 0 otherwise) to
// every quota of the tier tr of the bucket at key, and limitsN of them (at
// most n) to every limit: into this node's lease when it holds one (its
// tokens stay counted in the quotas, to be spent in the period that
// counted them), up to what the lease's record counts, and the rest in one
// script call, to a quota only while the period it was counted in lasts.
// A denial this node cached for the bucket may no longer hold: it goes.
//
// A lease holds tokens of the limits and the quotas at once: when the
// limits take back fewer than the quotas (a reload changed them), it
// takes none, and the script gives each its own.
func (s *Store) GiveBack(ctx context.Context, key []byte, tr bucket.Tier, limitsN, n, at int64) error {
	if limitsN == n {
		if n = s.fromLease(key, n, true, at); n <= 0 {
			return nil
		}
		limitsN = n
	}
	k := string(key)
	_, err := s.call(context.WithoutCancel(ctx), k, s.args("giveback", tr, at, n, max(0, limitsN)), false, 2)
	s.conn.denied.remove(k)
	return err
}

// Charge takes n more tokens from every limit and quota of the tier tr of
// the bucket at key, into debt if need be: from the tokens this node holds
// on lease for the bucket when they cover it, with no call, as a request's
// cost is; what they do not cover is charged to the shared bucket by one
// script call, into debt as in strict mode.
func (s *Store) Charge(ctx context.Context, key []byte, tr bucket.Tier, n int64) error {
	if n = s.fromLease(key, n, false, 0); n == 0 && s.leases != nil {
		return nil
	}
	_, err := s.chargeShared(ctx, string(key), tr, n)
	return err
}

// fromLease is, with leases, how many of n tokens this node's lease on
// the bucket at key does not take back (give) or spend (charge): the rest
// goes to the shared bucket by one call.
//
// A give-back on a tier with quotas names when the request was taken (at,
// µs of the wall clock; 0 otherwise).
func (s *Store) fromLease(key []byte, n int64, give bool, at int64) int64 {
	switch {
	case s.leases == nil || n <= 0:
		return n
	case give && at != 0:
		// When it was taken by the table's clock.
		took := s.conn.now() - (time.Now().UnixMicro() + s.clockOffset - at)
		return s.leases.giveBackHeldSince(key, n, took)
	case give:
		return s.leases.giveBackHeld(key, n)
	default:
		return s.leases.chargeHeld(key, n)
	}
}

// Forget drops what this node keeps of the bucket at key, its lease (or
// a lease call's hold-off) and its denial in the deny cache, and leaves
// Redis alone: for another Store on the same connection whose Reset
// emptied the shared bucket (a copy of a policy on a second port).
func (s *Store) Forget(key []byte) {
	if s.leases != nil {
		s.leases.reset(key)
	}
	s.conn.denied.remove(string(key))
}

// Reset deletes the bucket at key. It forgets the bucket's denial on this
// node whether or not Redis answers; other nodes may still answer from
// their deny caches until the retry time they were given.
func (s *Store) Reset(ctx context.Context, key []byte) error {
	k := string(key)
	s.Forget(key)
	// Again once Redis has answered: a Take that went to Redis before the
	// reset is dropped when it puts its denial, but one that set out
	// between the first remove and the DEL carries the newer epoch.
	defer s.conn.denied.remove(k)
	return s.do(ctx, func(ctx context.Context, set *clientSet) error {
		if err := set.client.Del(ctx, k).Err(); err != nil {
			return fmt.Errorf("reset: %w", err)
		}
		return nil
	})
}

// call runs the bucket script on one key with args (callBy). The script
// must answer want values: one of two counts when two are given (a take's
// short form or long).
func (s *Store) call(ctx context.Context, key string, args []any, batched bool, want ...int) ([]int64, error) {
	return s.callBy(ctx, scriptArgs(key, args), batched, want[0], want[len(want)-1])
}

// callBy makes the script call args (scriptArgs) as do makes a call:
// within the timeout, through the breaker, following a Cluster on MOVED;
// batched, through the batcher if there is one. The script must answer
// w0 or w1 values. It makes no context of its own unless it sends the
// call alone (redisBatcher.takeBy): a timer and a context per decision
// were about a tenth of what a decision cost Caddy
// (TestQueuedStrictTakesAllocateLittle).
func (s *Store) callBy(ctx context.Context, args []any, batched bool, w0, w1 int) ([]int64, error) {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return nil, s.conn.breaker.openError()
	}
	deadline := time.Now().Add(s.timeout)
	vals, err := s.runChecked(ctx, s.conn.cur.Load(), deadline, args, batched, w0, w1)
	if s.conn.followed(err) {
		vals, err = s.runChecked(ctx, s.conn.cur.Load(), deadline, args, batched, w0, w1)
	}
	s.record(ctx, probe, err)
	if err != nil {
		return nil, s.wrap(err)
	}
	return vals, nil
}

// runChecked runs the script call args on set by deadline. The script
// must answer w0 or w1 values; an answer is a round-trip sample.
func (s *Store) runChecked(ctx context.Context, set *clientSet, deadline time.Time, args []any, batched bool, w0, w1 int) ([]int64, error) {
	vals, took, err := set.runScript(ctx, deadline, args, batched)
	if err == nil && len(vals) != w0 && len(vals) != w1 {
		err = fmt.Errorf("script answered %d values, want %d or %d", len(vals), w0, w1)
	}
	if err == nil {
		s.sample(took)
	}
	return vals, err
}

// do makes one call to Redis, within the timeout and through the breaker:
// send sends it on the client in use (Conn.send, which follows a Cluster
// on MOVED). Every call but the bucket script's goes through it: a reset,
// a slot, a free, a lease's give-back pipeline; the bucket script's
// through callBy, which does the same.
func (s *Store) do(ctx context.Context, send func(context.Context, *clientSet) error) error {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return s.conn.breaker.openError()
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	err := s.conn.send(ctx, send)
	s.record(ctx, probe, err)
	if err != nil {
		return s.wrap(err)
	}
	return nil
}

// runScript makes the script call args (scriptArgs), through the batcher
// when batched and there is one, until ctx ends or the deadline. It
// reports how long the call took from its write to its reply (µs), not
// counting its wait in the batcher's queue; -1 when that was no round trip
// alone (callTimer).
func (set *clientSet) runScript(ctx context.Context, deadline time.Time, args []any, batched bool) ([]int64, int64, error) {
	if batched && set.batcher != nil {
		return set.batcher.takeBy(ctx, deadline, args)
	}
	return runScriptBy(ctx, deadline, set.client, set.handshakes, args)
}

// wrap says what went wrong with a call to Redis.
func (s *Store) wrap(err error) error {
	var netErr net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout() {
		return fmt.Errorf("redis store: no answer within %s: %w", s.timeout, err)
	}
	return fmt.Errorf("redis store: %w", err)
}

// record tells the breaker how a call went; probe says whether the breaker
// let it through as its probe. A request whose client went away says
// nothing about Redis, but it still ends its probe. A MOVED or ASK that
// no Cluster client followed is an answer: Redis is up.
func (s *Store) record(ctx context.Context, probe bool, err error) {
	out := callOK
	switch {
	case err == nil, isRedirect(err):
	case errors.Is(err, context.Canceled) && ctx.Err() == context.Canceled:
		out = callAbandoned
	default:
		out = callFailed
		s.conn.breaker.failedWith(s.wrap(err))
	}
	s.conn.breaker.record(probe, out, s.conn.now())
}

// Master is the address of the master that Sentinel names, as this node
// last heard it; "" without Sentinel.
func (s *Store) Master() string { return s.conn.Master() }

// BreakerState is closed, open or half-open.
func (s *Store) BreakerState() string { return s.conn.breaker.state(s.conn.now()) }

// LeasesHeld is how many buckets this view holds leased tokens of.
func (s *Store) LeasesHeld() int {
	if s.leases == nil {
		return 0
	}
	return s.leases.held()
}

// DenyCacheHits counts the decisions answered by the deny cache, without
// Redis, since the connection was made.
func (s *Store) DenyCacheHits() uint64 { return s.conn.denied.hits.Load() }
