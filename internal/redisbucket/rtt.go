package redisbucket

import (
	"context"
	"math"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The measured round trip to the store, and the settings it is checked
// against (docs/operating.md, "Round-trip warnings").
//
// The meter is the Store's, not the Conn's: configs with the same
// connection settings share a Conn across policies and reloads, while a
// Store is one policy of one config load. Each policy then reports, and
// is warned of, the round trip of the calls it made itself, and a reload
// starts afresh with its new Store.
//
// A sample is one script call that Redis answered: from when it was
// written (a batched call's pipeline, not its time in the batcher's
// queue) to its reply. Pipelines of give-backs, renewals and frees are
// not samples: their time grows with their length.

// handshakes counts the connections of one Plan's clients that finished
// their handshake (the clients' OnConnect), the Cluster client a node is
// followed by included. A call during which one did may have waited for
// it, its dial included: that is no round trip, so it is no sample. Dials
// are rare once the pools are warm; another connection's do not count.
type handshakes struct{ n atomic.Int64 }

func (h *handshakes) onConnect(context.Context, *redis.Conn) error {
	h.n.Add(1)
	return nil
}

// callTimer times one call from its write to its reply.
type callTimer struct {
	start, seen int64
	h           *handshakes
}

func (h *handshakes) startCall() callTimer {
	return callTimer{monotonicMicros(), h.n.Load(), h}
}

// runTimed runs script on keys as Script.Run does, EVALSHA and, when Redis
// answers NOSCRIPT (it restarted, or no node loaded the script yet), EVAL,
// and reports the call's round trip in µs (took): -1 after NOSCRIPT, since
// the call then took two, and the first of a store would seed the average
// with twice the round trip.
func runTimed(ctx context.Context, script *redis.Script, c redis.Scripter, h *handshakes, keys []string, args ...any) (*redis.Cmd, int64) {
	call := h.startCall()
	cmd := script.EvalSha(ctx, c, keys, args...)
	if isNoScript(cmd.Err()) {
		return script.Eval(ctx, c, keys, args...), -1
	}
	return cmd, call.took()
}

// took is the call's round trip in µs, or -1 when a connection finished
// its handshake meanwhile.
func (c callTimer) took() int64 {
	if c.h.n.Load() != c.seen {
		return -1
	}
	return monotonicMicros() - c.start
}

// rttMeter is a moving average of round trips, weight 1/8 for a new
// sample, seeded by the first, and their count: atomics only, since
// every call that Redis answers adds to it.
type rttMeter struct {
	avg     atomic.Int64 // µs; 0 before the first sample
	samples atomic.Int64
}

// add adds one round trip of took µs, and reports how many there are.
func (m *rttMeter) add(took int64) int64 {
	took = max(1, took) // 0 means no sample yet
	for {
		old := m.avg.Load()
		next := took
		if old > 0 {
			next = old + (took-old)/8
		}
		if m.avg.CompareAndSwap(old, max(1, next)) {
			return m.samples.Add(1)
		}
	}
}

// read is the average in µs, 0 before the first sample, and the count.
func (m *rttMeter) read() (avg, samples int64) {
	return m.avg.Load(), m.samples.Load()
}

// sample adds the round trip of a call answered in took µs (none when
// negative: callTimer), and checks the settings against the average.
func (s *Store) sample(took int64) {
	if took < 0 {
		return
	}
	m := s.meter()
	n := m.add(took)
	if w := s.watch.Load(); w != nil && n >= rttWarmup {
		w.check(m.avg.Load(), n)
	}
}

// RoundTrip is the moving average of this store's round trips to Redis,
// and how many calls it weighs; 0 and 0 before the first answer.
func (s *Store) RoundTrip() (avg time.Duration, samples int64) {
	a, n := s.meter().read()
	return time.Duration(a) * time.Microsecond, n
}

// roundTripMicros is RoundTrip in µs, for the lease table.
func (s *Store) roundTripMicros() int64 { return s.meter().avg.Load() }

// meter is the meter this store's calls add to: its own, or the one it
// shares.
func (s *Store) meter() *rttMeter {
	if m := s.sharedRTT.Load(); m != nil {
		return m
	}
	return &s.rtt
}

// ShareRoundTrip makes s add its calls to other's round trip and warn
// through other's watch (WatchRoundTrip): copies of one policy, each a
// Store, measure one round trip, and each condition warns once for them
// all.
func (s *Store) ShareRoundTrip(other *Store) {
	s.sharedRTT.Store(other.meter())
	s.watch.Store(other.watch.Load())
}

// roundTrip is the measured round trip to the shared store in µs, 0 while
// nothing was measured (or the store is a model that measures nothing).
func (t *leaseTable) roundTrip() int64 {
	if m, ok := t.store.(interface{ roundTripMicros() int64 }); ok {
		return m.roundTripMicros()
	}
	return 0
}

// rttWarmup is how many samples the average weighs before it is checked,
// so that a few slow first calls (the script loaded again) do not warn.
const rttWarmup = 20

// rttWarnEvery is how often one condition may warn again while it lasts.
const rttWarnEvery = time.Hour

// NamedTier is a tier by name, for the lease check of WatchRoundTrip.
type NamedTier struct {
	Name string
	Tier bucket.Tier
}

// WatchRoundTrip makes the store warn on logger, once the average weighs
// rttWarmup samples, when a setting is too small for the round trip
// measured: timeout under 2 round trips (calls fail over to
// on_store_error); with leases, lease_ttl under 4 (a lease lapses soon
// after it lands), and a tier's lease under the tokens its first limit
// refills in one round trip (requests wait on lease calls). Each
// condition warns once, and again at most once an hour while it lasts.
func (s *Store) WatchRoundTrip(logger *zap.Logger, tiers []NamedTier) {
	w := &rttWatch{logger: logger, now: s.conn.now}
	w.add("timeout", s.timeout.String(), s.timeout.Microseconds()/2,
		"redis store: timeout is under twice the measured round trip, so calls time out and on_store_error decides: raise timeout")
	if s.leases != nil {
		ttl := time.Duration(s.leases.ttl) * time.Microsecond
		w.add("lease_ttl", ttl.String(), s.leases.ttl/4,
			"redis store: lease_ttl is under four times the measured round trip, so leases lapse soon after they arrive: raise lease_ttl")
		if t, most, ok := s.tightestLease(tiers); ok {
			w.add("lease", s.leases.size.String(), most,
				"redis store: a tier's lease is under the tokens its rate refills in one measured round trip, so requests wait on lease calls: raise lease",
				zap.String("tier", t.Name), zap.Int64("lease_tokens", s.leases.size.ofTier(t.Tier)), zap.String("refill", t.Tier.Limits[0].Rate.String()))
		}
	}
	s.watch.Store(w)
}

// tightestLease is the tier whose lease covers its first limit's refill
// for the shortest round trip, and that round trip in µs.
func (s *Store) tightestLease(tiers []NamedTier) (NamedTier, int64, bool) {
	var found NamedTier
	least, ok := int64(math.MaxInt64), false
	for _, t := range tiers {
		if len(t.Tier.Limits) == 0 {
			continue
		}
		r := t.Tier.Limits[0].Rate
		if r.Tokens <= 0 {
			continue
		}
		// lease < r x RTT when RTT > lease / r.
		most := float64(s.leases.size.ofTier(t.Tier)) * float64(r.Interval) / float64(r.Tokens)
		if most < float64(least) {
			found, least, ok = t, int64(most), true
		}
	}
	return found, least, ok
}

// String is the setting as written: tokens, or a share such as 10%.
func (z LeaseSize) String() string {
	if z.percent > 0 {
		return strconv.FormatFloat(z.percent, 'g', -1, 64) + "%"
	}
	return strconv.FormatInt(z.tokens, 10)
}

// rttWatch is the conditions a store's round trip is checked against.
type rttWatch struct {
	logger *zap.Logger
	now    func() int64 // µs, the connection's clock
	checks []*rttCheck
}

// rttCheck warns when the round trip passes most µs.
type rttCheck struct {
	setting, value, msg string
	most                int64
	extra               []zap.Field
	// warned is when it last warned (µs, now), 0 before.
	warned atomic.Int64
}

func (w *rttWatch) add(setting, value string, most int64, msg string, extra ...zap.Field) {
	w.checks = append(w.checks, &rttCheck{setting: setting, value: value, most: most, msg: msg, extra: extra})
}

// check warns of each condition the average avg (µs) meets, unless it
// did within the hour.
func (w *rttWatch) check(avg, samples int64) {
	for _, c := range w.checks {
		if avg <= c.most {
			continue
		}
		now := w.now()
		last := c.warned.Load()
		if last != 0 && now-last < rttWarnEvery.Microseconds() || !c.warned.CompareAndSwap(last, max(1, now)) {
			continue
		}
		rtt := time.Duration(avg) * time.Microsecond
		w.logger.Warn(c.msg, append([]zap.Field{zap.String("setting", c.setting), zap.String(c.setting, c.value),
			zap.Duration("round_trip", rtt), zap.Int64("samples", samples)}, c.extra...)...)
	}
}
