package redisbucket

import (
	"context"
	"errors"
	"fmt"
	mathrand "math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// The bounds on a round trip measured through a proxy that delays each
// direction by oneWay: generous, for a loaded machine.
const oneWay = 20 * time.Millisecond

func checkRoundTrip(t *testing.T, what string, avg time.Duration) {
	t.Helper()
	if avg < 35*time.Millisecond || avg > 120*time.Millisecond {
		t.Errorf("%s: round trip %s through a proxy delaying each way %s; want 35ms to 120ms", what, avg, oneWay)
	}
}

// warmPool opens n connections of each of the store's pools and waits for the
// script to be loaded, so that the calls a test counts dial nothing: a
// call that waits on a new connection's handshake is no sample
// (callTimer), and one over a link 3 round trips would fail a short
// timeout.
func warmPool(t *testing.T, s *Store, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(bg, 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			// Pipelines (the batcher's) have a pool of their own.
			_, err := s.conn.client().Pipelined(ctx, func(p redis.Pipeliner) error { return p.Ping(ctx).Err() })
			if err := errors.Join(err, s.conn.client().Ping(ctx).Err()); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if err := bucketScript.Load(ctx, s.conn.client()).Err(); err != nil {
		t.Fatal(err)
	}
}

// meterTrace checks a meter against the moving average in exact
// arithmetic (weight 1/8, seeded by the first sample) over a random
// trace: each integer step may lose under 1 µs, so the meter stays within
// 8 µs of it.
func meterTrace(seed uint64, add func(int64), read func() int64) error {
	rng := mathrand.New(mathrand.NewPCG(seed, 0))
	var exact float64
	for i := range 500 {
		took := 1 + rng.Int64N(200_000)
		if i%50 == 0 {
			took = 1 + rng.Int64N(2_000_000) // a slow call now and then
		}
		add(took)
		if i == 0 {
			exact = float64(took)
		} else {
			exact += (float64(took) - exact) / 8
		}
		if got := read(); got < int64(exact)-8 || got > int64(exact)+8 {
			return fmt.Errorf("sample %d (%d µs): average %d µs, want %.1f within 8", i, took, got, exact)
		}
	}
	return nil
}

// The meter is a moving average of weight 1/8 seeded by its first sample,
// and counts its samples; a meter of another weight fails the same check.
func TestRoundTripMeterWeighsANewSampleOneEighth(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	var m rttMeter
	if err := meterTrace(seed, func(took int64) { m.add(took) }, func() int64 { avg, _ := m.read(); return avg }); err != nil {
		t.Fatal(err)
	}
	if _, n := m.read(); n != 500 {
		t.Errorf("samples %d, want 500", n)
	}
	// The mutation: weight 1/4.
	var quarter int64
	err := meterTrace(seed, func(took int64) {
		if quarter == 0 {
			quarter = took
		} else {
			quarter += (took - quarter) / 4
		}
	}, func() int64 { return quarter })
	if err == nil {
		t.Error("a meter of weight 1/4 passed the check of weight 1/8")
	}
	var seeded rttMeter
	seeded.add(80_000)
	seeded.add(40_000)
	if avg, n := seeded.read(); avg != 75_000 || n != 2 {
		t.Errorf("80 ms then 40 ms: average %d µs over %d samples, want 75000 over 2", avg, n)
	}
}

// A store behind a proxy that delays each direction by 20 ms measures a
// round trip of about 40 ms, calls one by one and calls together through
// the batcher alike.
func TestRoundTripMeasuresADelayedLink(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), oneWay)
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 5 * time.Second})
	warmPool(t, s, 10)
	if avg, n := s.RoundTrip(); avg != 0 || n != 0 {
		t.Fatalf("before any call: %s over %d samples, want none", avg, n)
	}
	for i := range 10 {
		if _, err := s.takeLimit(bg, bucketFor("one"+strconv.Itoa(i)), slowLimit(10), 1); err != nil {
			t.Fatal(err)
		}
	}
	avg, n := s.RoundTrip()
	if n != 10 {
		t.Errorf("10 calls one by one: %d samples", n)
	}
	checkRoundTrip(t, "calls one by one", avg)

	var wg sync.WaitGroup
	for i := range 30 {
		wg.Go(func() {
			if _, err := s.takeLimit(bg, bucketFor("together"+strconv.Itoa(i)), slowLimit(10), 1); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	avg, n = s.RoundTrip()
	if n != 40 {
		t.Errorf("10 + 30 calls: %d samples", n)
	}
	checkRoundTrip(t, "calls together", avg)
}

// A call that waits in the batcher's queue while another pipeline is on
// the link reports the time of its own pipeline, not its wait: with one
// loop sending one call at a time, the last of five callers waits about
// four round trips and reports one.
func TestBatchedCallsRoundTripLeavesOutTheQueue(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), oneWay)
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 5 * time.Second})
	warmPool(t, s, 3)
	b := newRedisBatcher(s.conn.client(), s.conn.handshakes, 1, 1)
	defer b.close()
	args := s.args("take", oneLimit(slowLimit(10)), 0, 1)
	type result struct {
		took, waited time.Duration
		err          error
	}
	results := make([]result, 5)
	var wg sync.WaitGroup
	for i := range results {
		wg.Go(func() {
			start := time.Now()
			_, took, err := b.take(bg, []string{string(bucketFor("queued" + strconv.Itoa(i)))}, args)
			results[i] = result{time.Duration(took) * time.Microsecond, time.Since(start), err}
		})
	}
	wg.Wait()
	var longest time.Duration
	for i, r := range results {
		if r.err != nil {
			t.Fatalf("caller %d: %v", i, r.err)
		}
		checkRoundTrip(t, "caller "+strconv.Itoa(i), r.took)
		longest = max(longest, r.waited)
	}
	if longest < 120*time.Millisecond {
		t.Errorf("the last caller waited %s; want three round trips or more, or nobody queued", longest)
	}
}

// A call that fails is no sample: Redis killed (refused), then the
// breaker open, then a link that went silent (timed out). The counts are
// read before and after, since an answered call during which another
// test's connection finished its handshake is no sample either.
func TestFailedCallsAddNoRoundTripSample(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, BreakerFailures: 2, BreakerCooldown: time.Hour})
	warmPool(t, s, 1)
	takeUntil(t, s, oneLimit(slowLimit(10)), 3)
	_, before := s.RoundTrip()
	srv.Kill()
	for i := range 2 {
		if _, err := s.takeLimit(bg, bucketFor("down"+strconv.Itoa(i)), slowLimit(10), 1); err == nil {
			t.Fatalf("take %d with Redis killed: no error", i)
		}
	}
	if _, err := s.takeLimit(bg, bucketFor("open"), slowLimit(10), 1); !errors.Is(err, errBreakerOpen) {
		t.Fatalf("take with the breaker open: %v", err)
	}
	if _, n := s.RoundTrip(); n != before {
		t.Errorf("after 2 refused calls and 1 the breaker stopped: %d samples, want %d", n, before)
	}

	srv2 := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv2.Addr(), 0)
	silent := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 100 * time.Millisecond, BreakerFailures: 1000})
	warmPool(t, silent, 1)
	takeUntil(t, silent, oneLimit(slowLimit(10)), 1)
	_, before = silent.RoundTrip()
	proxy.Blackhole()
	if _, err := silent.takeLimit(bg, bucketFor("silent"), slowLimit(10), 1); err == nil {
		t.Fatal("take over a silent link: no error")
	}
	if _, n := silent.RoundTrip(); n != before {
		t.Errorf("%d answered calls and 1 timed out: %d samples, want %d", before, n, before)
	}
}

// takeUntil makes takes of fresh keys until the store weighs n samples;
// calls that time out add none, and are tried again.
func takeUntil(t *testing.T, s *Store, tr bucket.Tier, n int64) {
	t.Helper()
	for i := 0; ; i++ {
		if _, got := s.RoundTrip(); got >= n {
			return
		}
		if i == int(n)*5 {
			t.Fatalf("%d takes, not %d samples", i, n)
		}
		out := make([]bucket.Result, tr.Parts())
		_, _ = s.Take(bg, bucketFor(fmt.Sprintf("%p-%d", s, i)), tr, 1, out)
	}
}

// roundTripWarnings is the round-trip warnings logged, by setting.
func roundTripWarnings(t *testing.T, logs *observer.ObservedLogs) map[string][]observer.LoggedEntry {
	t.Helper()
	by := map[string][]observer.LoggedEntry{}
	for _, e := range logs.FilterMessageSnippet("measured round trip").All() {
		setting, _ := e.ContextMap()["setting"].(string)
		by[setting] = append(by[setting], e)
		if e.Level != zapcore.WarnLevel {
			t.Errorf("%s warning at %s, want warn", setting, e.Level)
		}
	}
	return by
}

// A timeout of 50ms against a round trip of about 40 ms (more than half
// of it) is warned of once the average weighs 20 samples, once, and again
// only an hour later (an injected clock) while it lasts. A new store on
// the same connection, as a reload makes, starts afresh and warns again.
func TestTimeoutUnderTwoRoundTripsWarnsOnceAnHour(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), oneWay)
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 50 * time.Millisecond, BreakerFailures: 1000})
	// A call that times out closes its connection: spares, so that the
	// next does not pay a handshake over the slow link (no sample).
	warmPool(t, s, 15)
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	s.conn.now = clock.now
	core, logs := observer.New(zapcore.InfoLevel)
	s.WatchRoundTrip(zap.New(core), nil)
	tr := oneLimit(slowLimit(1000))

	takeUntil(t, s, tr, rttWarmup-1)
	if n := logs.Len(); n != 0 {
		t.Fatalf("%d lines before %d samples: %v", n, rttWarmup, logs.All())
	}
	takeUntil(t, s, tr, rttWarmup)
	warned := roundTripWarnings(t, logs)
	if len(warned["timeout"]) != 1 || len(warned) != 1 {
		t.Fatalf("after %d samples: %v; want one timeout warning", rttWarmup, logs.All())
	}
	fields := warned["timeout"][0].ContextMap()
	if fields["timeout"] != "50ms" {
		t.Errorf("the warning names timeout %v, want 50ms (%v)", fields["timeout"], fields)
	}
	rtt, _ := fields["round_trip"].(time.Duration)
	checkRoundTrip(t, "the warning's", rtt)

	takeUntil(t, s, tr, 2*rttWarmup)
	clock.advance(59 * time.Minute)
	takeUntil(t, s, tr, 2*rttWarmup+5)
	if n := len(roundTripWarnings(t, logs)["timeout"]); n != 1 {
		t.Fatalf("%d timeout warnings within the hour, want 1", n)
	}
	clock.advance(time.Minute)
	takeUntil(t, s, tr, 2*rttWarmup+6)
	if n := len(roundTripWarnings(t, logs)["timeout"]); n != 2 {
		t.Fatalf("%d timeout warnings an hour on, want 2", n)
	}

	reloaded := NewStore(s.conn, StoreOptions{})
	defer reloaded.Close()
	core2, logs2 := observer.New(zapcore.InfoLevel)
	reloaded.WatchRoundTrip(zap.New(core2), nil)
	if avg, n := reloaded.RoundTrip(); avg != 0 || n != 0 {
		t.Errorf("a new store on the connection starts at %s over %d samples, want none", avg, n)
	}
	takeUntil(t, reloaded, tr, rttWarmup)
	if n := len(roundTripWarnings(t, logs2)["timeout"]); n != 1 {
		t.Errorf("the new store: %d timeout warnings, want 1 (%v)", n, logs2.All())
	}
}

// With leases, lease_ttl 100ms under 4 round trips of about 40 ms is
// warned of, and so is a tier whose lease (10 tokens) is under what its
// rate refills in a round trip (1000/s: 40); a slow tier and a timeout of
// 1s are not.
func TestLeaseSettingsUnderTheRoundTripWarn(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), oneWay)
	plan, err := NewPlan(Options{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: time.Second, Batch: true})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	defer conn.Close()
	lease, err := ParseLeaseSize("10")
	if err != nil {
		t.Fatal(err)
	}
	s := NewStore(conn, StoreOptions{Lease: lease, LeaseTTL: 100 * time.Millisecond})
	defer s.Close()
	warmPool(t, s, 5)
	core, logs := observer.New(zapcore.InfoLevel)
	slow := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: second}}
	fast := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1000, Interval: second}}
	s.WatchRoundTrip(zap.New(core), []NamedTier{{Name: "slow", Tier: oneLimit(slow)}, {Name: "fast", Tier: oneLimit(fast)}})

	takeUntil(t, s, oneLimit(slow), rttWarmup)
	warned := roundTripWarnings(t, logs)
	if len(warned["lease_ttl"]) != 1 || len(warned["lease"]) != 1 || len(warned) != 2 {
		t.Fatalf("warnings %v; want one of lease_ttl and one of lease", logs.All())
	}
	if f := warned["lease_ttl"][0].ContextMap(); f["lease_ttl"] != "100ms" {
		t.Errorf("the lease_ttl warning names %v, want 100ms (%v)", f["lease_ttl"], f)
	}
	f := warned["lease"][0].ContextMap()
	if f["tier"] != "fast" || f["lease"] != "10" || f["lease_tokens"] != int64(10) {
		t.Errorf("the lease warning's fields %v; want tier fast, lease 10, 10 tokens", f)
	}
	rtt, _ := f["round_trip"].(time.Duration)
	checkRoundTrip(t, "the lease warning's", rtt)

	// The lease table reads the store's measure, in µs.
	avg, _ := s.RoundTrip()
	if got := s.leases.roundTrip(); got != avg.Microseconds() {
		t.Errorf("the lease table's round trip %d µs, the store's %s", got, avg)
	}
	model := newLeaseTable(nil, s.conn.now, lease, time.Second, time.Second, 10, nopLogger)
	defer model.close()
	if got := model.roundTrip(); got != 0 {
		t.Errorf("a table on a remote that measures nothing: round trip %d µs, want 0", got)
	}
}

// A call during which a connection of its own clients finished its
// handshake is no sample: it may have waited for that connection's dial
// and handshake, which are no round trip of its own. Another connection's
// handshake (another policy's, another test's) leaves it one.
func TestACallDuringAHandshakeIsNoRoundTripSample(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	warmPool(t, s, 1)
	h := s.conn.handshakes
	// The store's own start may still be dialling (the script's load): a
	// warm call is a sample once that is done.
	took := int64(-1)
	for i := 0; i < 20 && took < 0; i++ {
		call := h.startCall()
		if _, err := s.takeLimit(bg, bucketFor("warm"+strconv.Itoa(i)), slowLimit(10), 1); err != nil {
			t.Fatal(err)
		}
		took = call.took()
	}
	if took < 0 {
		t.Errorf("20 calls on a warm connection: none a sample")
	}
	// Holding every connection of the pool and one more dials one.
	client := s.conn.client().(*redis.Client)
	call := h.startCall()
	for range client.PoolStats().TotalConns + 1 {
		held := client.Conn()
		defer held.Close()
		if err := held.Ping(bg).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if took := call.took(); took != -1 {
		t.Errorf("a call while a new connection of its pool shook hands took %d µs, want -1 (no sample)", took)
	}
	call = h.startCall()
	other := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	warmPool(t, other, 1)
	if took := call.took(); took < 0 {
		t.Errorf("a call while another connection's client shook hands took %d µs, want a sample", took)
	}
	_, before := s.RoundTrip()
	s.sample(-1)
	if _, after := s.RoundTrip(); after != before {
		t.Errorf("a call that is no round trip made %d samples %d", before, after)
	}
}
