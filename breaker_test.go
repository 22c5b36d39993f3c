package ratelimit

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// TestRedisBreakerClosesAfterAProbeWhoseClientHungUp opens the breaker,
// lets the cool-down pass on an injected clock, and makes the probe a
// request whose client has gone away. That says nothing about Redis, but
// it must end the probe: the next request probes again, and with Redis
// up it closes the breaker.
func TestRedisBreakerClosesAfterAProbeWhoseClientHungUp(t *testing.T) {
	srv := startRedis(t)
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	const cooldown = time.Second
	s := newPrivateRedisStore(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second),
		BreakerFailures: 2, BreakerCooldown: caddy.Duration(cooldown)})
	s.conn.now = clock.now
	if _, err := s.Take(bg, bucketFor("before"), slowLimit(10), 1); err != nil {
		t.Fatalf("take with Redis up: %v", err)
	}

	srv.kill() // refused at once: two failures open the breaker
	for i := range 2 {
		if _, err := s.Take(bg, bucketFor("down"+strconv.Itoa(i)), slowLimit(10), 1); err == nil {
			t.Fatalf("take %d with Redis killed: no error", i)
		}
	}
	if !s.conn.breaker.open() {
		t.Fatal("two failures did not open the breaker")
	}
	srv.start()
	if _, err := s.Take(bg, bucketFor("cooling"), slowLimit(10), 1); err != errBreakerOpen {
		t.Fatalf("take during the cool-down: %v, want errBreakerOpen", err)
	}

	clock.advance(cooldown)
	gone, cancel := context.WithCancel(bg)
	cancel()
	if _, err := s.Take(gone, bucketFor("hung-up"), slowLimit(10), 1); err == nil {
		t.Fatal("the probe of a client that hung up: no error")
	}
	res, err := s.Take(bg, bucketFor("after"), slowLimit(10), 1)
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

// TestRedisBreakerClosesAfterClientsHangUpDuringAnOutage runs a real
// config whose Redis link goes silent (a black hole: connections are
// accepted, nothing comes back) and whose clients hang up right after
// sending, so that the probes after each cool-down are cancelled. Once the
// link is back, decisions must reach Redis again within a few cool-downs,
// as Redis itself shows: new buckets appear in it.
func TestRedisBreakerClosesAfterClientsHangUpDuringAnOutage(t *testing.T) {
	skipUnderShort(t, "fault injection (a black-holed Redis link)")
	const timeout, cooldown = 300 * time.Millisecond, 300 * time.Millisecond
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), 0)
	s := serve(t, fmt.Sprintf(`
	rate_limit 100 1/h {
		store redis {
			address redis://%s
			timeout %s
			breaker_failures 2
			breaker_cooldown %s
		}
	}
	respond "ok"`, proxy.addr(), timeout, cooldown))
	waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
		v, _ := srv.do("SCRIPT", "EXISTS", bucketScript.Hash()).([]any)
		return len(v) == 1 && v[0] == int64(1)
	})
	c := trafficClient(5 * time.Second)
	if got := getFrom(c, s.base, "127.0.9.1"); got != 200 {
		t.Fatalf("before the outage: status %d", got)
	}
	if n := srv.do("DBSIZE").(int64); n != 1 {
		t.Fatalf("before the outage Redis holds %d buckets, want 1", n)
	}

	proxy.blackhole()
	for i := range 2 { // each waits for the timeout; the local fallback answers
		if got := getFrom(c, s.base, "127.0.9."+strconv.Itoa(10+i)); got != 200 {
			t.Fatalf("during the outage: status %d, want 200 from the local fallback", got)
		}
	}
	start := time.Now()
	getFrom(c, s.base, "127.0.9.20")
	if d := time.Since(start); d > timeout/2 {
		t.Fatalf("a request after two timeouts took %s: the breaker did not open", d)
	}

	// For six cool-downs only clients that hang up right after sending,
	// four at a time: the first request after each cool-down is the probe,
	// and its client is gone before Redis could answer.
	end := time.Now().Add(6 * cooldown)
	for i := 0; time.Now().Before(end); i++ {
		for j := range 4 {
			hangUp(t, s.port, "127.0.10."+strconv.Itoa((4*i+j)%250+1))
		}
		time.Sleep(10 * time.Millisecond)
	}

	proxy.restore()
	before := srv.do("DBSIZE").(int64)
	deadline := time.Now().Add(5 * cooldown)
	for i := 0; ; i++ {
		getFrom(c, s.base, "127.0.11."+strconv.Itoa(i%250+1))
		if srv.do("DBSIZE").(int64) > before {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("link restored %s ago, Redis up: no decision reached Redis (DBSIZE still %d, %s)",
				5*cooldown, before, srv.info("commandstats", "cmdstat_evalsha"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// hangUp sends one request as ip and closes the connection without
// reading the answer, as a client that gives up does.
func hangUp(t *testing.T, port int, ip string) {
	t.Helper()
	conn, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(conn)
	fmt.Fprintf(w, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Forwarded-For: %s\r\n\r\n", ip)
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	conn.Close()
}

func TestRedisBreakerTellsEachOpeningAndClosingOnce(t *testing.T) {
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
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(50 * time.Millisecond)})
	if _, err := s.Take(bg, bucketFor("y"), slowLimit(1), 1); err != nil {
		t.Fatal(err)
	}
	srv.pause()
	defer srv.resume()
	for i := range defaultBreakerFailures {
		start := time.Now()
		_, err := s.Take(bg, bucketFor("y"+strconv.Itoa(i)), slowLimit(1), 1)
		if err == nil || !strings.Contains(err.Error(), "no answer within 50ms") {
			t.Fatalf("take %d from a stopped Redis: %v", i, err)
		}
		if d := time.Since(start); d > 50*time.Millisecond+250*time.Millisecond {
			t.Fatalf("take %d waited %s, timeout 50ms", i, d)
		}
	}
	start := time.Now()
	if _, err := s.Take(bg, bucketFor("z"), slowLimit(1), 1); err != errBreakerOpen {
		t.Fatalf("take with the breaker open: %v, want errBreakerOpen", err)
	}
	if d := time.Since(start); d > 10*time.Millisecond {
		t.Fatalf("take with the breaker open waited %s", d)
	}
}
