package redisbucket

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestRedisBreakerClosesAfterAProbeWhoseClientHungUp opens the breaker,
// lets the cool-down pass on an injected clock, and makes the probe a
// request whose client has gone away. That says nothing about Redis, but
// it must end the probe: the next request probes again, and with Redis
// up it closes the breaker.
func TestRedisBreakerClosesAfterAProbeWhoseClientHungUp(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	const cooldown = time.Second
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second,
		BreakerFailures: 2, BreakerCooldown: cooldown})
	s.conn.now = clock.now
	if _, err := s.takeLimit(bg, bucketFor("before"), slowLimit(10), 1); err != nil {
		t.Fatalf("take with Redis up: %v", err)
	}

	srv.Kill() // refused at once: two failures open the breaker
	for i := range 2 {
		if _, err := s.takeLimit(bg, bucketFor("down"+strconv.Itoa(i)), slowLimit(10), 1); err == nil {
			t.Fatalf("take %d with Redis killed: no error", i)
		}
	}
	if !s.conn.breaker.open() {
		t.Fatal("two failures did not open the breaker")
	}
	srv.Restart()
	if _, err := s.takeLimit(bg, bucketFor("cooling"), slowLimit(10), 1); !errors.Is(err, errBreakerOpen) {
		t.Fatalf("take during the cool-down: %v, want errBreakerOpen", err)
	}

	clock.advance(cooldown)
	gone, cancel := context.WithCancel(bg)
	cancel()
	if _, err := s.takeLimit(gone, bucketFor("hung-up"), slowLimit(10), 1); err == nil {
		t.Fatal("the probe of a client that hung up: no error")
	}
	res, err := s.takeLimit(bg, bucketFor("after"), slowLimit(10), 1)
	if err != nil || !res.Allowed {
		t.Fatalf("take after a probe whose client hung up, Redis up: %+v, %v; want allowed by Redis", res, err)
	}
	if s.conn.breaker.open() {
		t.Fatal("a successful probe left the breaker open")
	}
}

// TestBreakerEveryProbeOutcomeEndsTheProbe opens a breaker, lets its probe
// through after the cool-down and records each possible outcome: whatever
// it was, the breaker is not left waiting for a probe that is over.
func TestBreakerEveryProbeOutcomeEndsTheProbe(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name      string
		out       callOutcome
		open      bool  // after the probe
		nextProbe int64 // when the next call may go, while open
	}{
		{"success closes it", callOK, false, 0},
		{"failure starts another cool-down", callFailed, true, 1100 + 1000},
		{"a caller that went away lets the next call probe", callAbandoned, true, 1100},
	} {
		t.Run(c.name, func(t *testing.T) {
			b := breaker{threshold: 2, cooldown: 1000}
			b.record(false, callFailed, 1)
			b.record(false, callFailed, 2) // open until 1002
			if ok, probe := b.allow(1100); !ok || !probe {
				t.Fatalf("after the cool-down: allow = %v, probe = %v; want the probe", ok, probe)
			}
			if ok, _ := b.allow(1100); ok {
				t.Fatal("a second call went through while the probe was out")
			}
			b.record(true, c.out, 1100)
			if b.open() != c.open {
				t.Fatalf("after the probe: open = %v, want %v", b.open(), c.open)
			}
			if !c.open {
				return
			}
			if c.out == callFailed {
				if ok, _ := b.allow(c.nextProbe - 1); ok {
					t.Fatalf("a call went through at %d, before the next cool-down ends at %d", c.nextProbe-1, c.nextProbe)
				}
			}
			if ok, probe := b.allow(c.nextProbe); !ok || !probe {
				t.Fatalf("at %d: allow = %v, probe = %v; want a new probe", c.nextProbe, ok, probe)
			}
		})
	}
}

func TestRedisBreakerTellsEachOpeningAndClosingOnce(t *testing.T) {
	t.Parallel()
	var opened, closed atomic.Int64
	b := breaker{threshold: 5, cooldown: 1000, changed: func(open bool) {
		if open {
			opened.Add(1)
		} else {
			closed.Add(1)
		}
	}}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 10 {
				b.record(false, callFailed, 10)
			}
		})
	}
	wg.Wait()
	if opened.Load() != 1 || closed.Load() != 0 {
		t.Fatalf("80 concurrent failures: told open %d times, closed %d; want 1 and 0", opened.Load(), closed.Load())
	}
	if ok, probe := b.allow(1010); !ok || !probe {
		t.Fatal("no probe after the cool-down")
	}
	b.record(true, callOK, 1011)
	for range 3 {
		b.record(false, callOK, 1011)
	}
	if opened.Load() != 1 || closed.Load() != 1 {
		t.Fatalf("after the probe succeeded: told open %d, closed %d; want 1 and 1", opened.Load(), closed.Load())
	}
}

// Serial: it bounds a failing call to milliseconds of wall-clock time.
func TestRedisBreakerFailsFastThenProbes(t *testing.T) {
	b := breaker{threshold: 3, cooldown: 1000}
	for now := range int64(3) {
		if ok, _ := b.allow(now); !ok {
			t.Fatalf("closed breaker refused call %d", now)
		}
		b.record(false, callFailed, now)
	}
	// Open until 2+1000.
	allowed := func(now int64) bool { ok, _ := b.allow(now); return ok }
	if allowed(500) || allowed(1001) || !allowed(1002) {
		t.Fatal("after 3 failures: want refusal during the cool-down, then a probe")
	}
	if allowed(1003) {
		t.Fatal("a second probe went through while the first was out")
	}
	b.record(true, callFailed, 1004) // the probe failed: open until 2004
	if allowed(1500) {
		t.Fatal("a failed probe did not restart the cool-down")
	}
	if !allowed(2004) {
		t.Fatal("no probe after the second cool-down")
	}
	b.record(true, callOK, 2005)
	if !allowed(2006) || !allowed(2007) || b.open() {
		t.Fatal("a successful probe did not close the breaker")
	}

	// Through the store: a Redis that does not answer costs the timeout
	// per decision until the breaker opens, then nothing.
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 50 * time.Millisecond})
	if _, err := s.takeLimit(bg, bucketFor("y"), slowLimit(1), 1); err != nil {
		t.Fatal(err)
	}
	srv.Pause()
	defer srv.Resume()
	for i := range DefaultBreakerFailures {
		start := time.Now()
		_, err := s.takeLimit(bg, bucketFor("y"+strconv.Itoa(i)), slowLimit(1), 1)
		if err == nil || !strings.Contains(err.Error(), "no answer within 50ms") {
			t.Fatalf("take %d from a stopped Redis: %v", i, err)
		}
		if d := time.Since(start); d > 50*time.Millisecond+250*time.Millisecond {
			t.Fatalf("take %d waited %s, timeout 50ms", i, d)
		}
	}
	start := time.Now()
	if _, err := s.takeLimit(bg, bucketFor("z"), slowLimit(1), 1); !errors.Is(err, errBreakerOpen) {
		t.Fatalf("take with the breaker open: %v, want errBreakerOpen", err)
	}
	if d := time.Since(start); d > 10*time.Millisecond {
		t.Fatalf("take with the breaker open waited %s", d)
	}
}

// TestRedisBreakerOpenNamesTheLastFailure opens the breaker on a Redis
// that refuses connections: the breaker-open line (at warn, as
// docs/operating.md says) and every refusal while it is open name what
// failed, not only the breaker.
// Regression test for issue 31 item 12.
func TestRedisBreakerOpenNamesTheLastFailure(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.DebugLevel)
	plan, err := NewPlan(Options{Addresses: []string{"redis://127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}, BreakerFailures: 2, BreakerCooldown: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(zap.New(core))
	defer conn.Close()
	s := NewStore(conn, StoreOptions{})
	for i := range 2 {
		if _, err := s.takeLimit(bg, bucketFor("down"+strconv.Itoa(i)), slowLimit(10), 1); err == nil {
			t.Fatalf("take %d with nothing listening: no error", i)
		}
	}
	opened := logs.FilterMessageSnippet("circuit breaker open").All()
	if len(opened) != 1 {
		t.Fatalf("breaker-open lines: %d, want 1 (all: %v)", len(opened), logs.All())
	}
	if opened[0].Level != zapcore.WarnLevel {
		t.Errorf("the breaker-open line is at %s, want warn", opened[0].Level)
	}
	if cause, _ := opened[0].ContextMap()["cause"].(string); !strings.Contains(cause, "connection refused") {
		t.Errorf("the breaker-open line names the cause %q, want the refused connection (fields %v)", cause, opened[0].ContextMap())
	}
	_, err = s.takeLimit(bg, bucketFor("while-open"), slowLimit(10), 1)
	if !errors.Is(err, errBreakerOpen) || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("take with the breaker open: %v; want the breaker's error naming the refused connection", err)
	}
}

// Lease calls that no request waits on (prefetches, renewals, give-backs)
// that time out leave the breaker closed: a burst of renewals queued past
// the timeout on a loaded Redis must not stop every key's leases for the
// cool-down. A Redis that is really down still opens it, from requests'
// own calls; while it is open, background calls are not sent, and they
// never take the probe.
// Regression test for issue 34 (a wave of background timeouts opened the
// breaker).
func TestBackgroundLeaseCallsThatTimeOutLeaveTheBreakerClosed(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 50 * time.Millisecond, Lease: "10%", BreakerCooldown: 100 * time.Millisecond})
	tr := oneLimit(slowLimit(100))
	key := string(bucketFor("renewed"))
	ask := func(seq int64, prefetch bool) error {
		a := bucket.LeaseAsk{Node: "n", Seq: seq, Cost: 1, Want: 10, Hold: 2_000_000, Prefetch: prefetch}
		if !prefetch {
			a.Spend = 1
		}
		_, err := s.lease(bg, key, tr, a, nil)
		return err
	}
	if err := ask(1, false); err != nil {
		t.Fatal(err)
	}
	srv.Pause()
	defer srv.Resume()
	for i := range 2 * DefaultBreakerFailures {
		if err := ask(int64(2+i), true); err == nil || !strings.Contains(err.Error(), "no answer within 50ms") {
			t.Fatalf("renewal %d from a paused Redis: %v", i, err)
		}
		if _, err := s.giveBack("n", []leaseReturn{{key: key, tier: tr, tokens: 1, seq: 1}}); err == nil {
			t.Fatalf("give-back %d answered by a paused Redis", i)
		}
	}
	if st := s.BreakerState(); st != "closed" {
		t.Fatalf("after %d renewals and give-backs timed out: the breaker is %s; want closed", 2*DefaultBreakerFailures, st)
	}
	for i := range DefaultBreakerFailures {
		if err := ask(int64(100+i), false); err == nil {
			t.Fatalf("request's lease call %d answered by a paused Redis", i)
		}
	}
	if st := s.BreakerState(); st != "open" {
		t.Fatalf("after %d requests' lease calls timed out: the breaker is %s; want open", DefaultBreakerFailures, st)
	}
	start := time.Now()
	if err := ask(200, true); !errors.Is(err, errBreakerOpen) {
		t.Fatalf("a renewal with the breaker open: %v; want errBreakerOpen", err)
	}
	if d := time.Since(start); d > 10*time.Millisecond {
		t.Fatalf("a renewal with the breaker open waited %s", d)
	}
	time.Sleep(150 * time.Millisecond) // the cool-down
	if err := ask(201, true); !errors.Is(err, errBreakerOpen) {
		t.Fatalf("a renewal once the cool-down is over: %v; want errBreakerOpen (a request's call probes)", err)
	}
	srv.Resume()
	if err := ask(202, false); err != nil {
		t.Fatalf("the probe, a request's lease call, once Redis is back: %v", err)
	}
	if st := s.BreakerState(); st != "closed" {
		t.Fatalf("after the probe answered: the breaker is %s; want closed", st)
	}
}
