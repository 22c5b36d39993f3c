package redisbucket

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

func TestDenyCacheIsBounded(t *testing.T) {
	t.Parallel()
	c := newDenyCache(1000)
	l := slowLimit(1)
	for i := range 20000 {
		c.put("rl:p:t:"+strconv.Itoa(i), 0, l, 1, 1, bucket.Result{RetryAfter: 1 << 40})
	}
	if n := c.len(); n > 1000+denyShards {
		t.Fatalf("deny cache holds %d entries, bound 1000", n)
	}
	// Expired entries go before live ones.
	c = newDenyCache(denyShards)
	c.put("old", 0, l, 1, 0, bucket.Result{RetryAfter: 10})
	sh := c.shard("old")
	sh.makeRoom(100)
	if len(sh.entries) != 0 {
		t.Fatal("an expired entry survived makeRoom")
	}
	// Only the same limit and cost are answered.
	c.put("k", 0, l, 2, 0, bucket.Result{RetryAfter: 1000})
	if _, _, ok := c.get("k", l, 1, 10); ok {
		t.Fatal("a denial at cost 2 answered a take of cost 1")
	}
	if _, _, ok := c.get("k", slowLimit(2), 2, 10); ok {
		t.Fatal("a denial answered a take on another limit")
	}
	if _, _, ok := c.get("k", l, 2, 1000); ok {
		t.Fatal("a denial answered at its retry time")
	}
	if res, _, ok := c.get("k", l, 2, 10); !ok || res.Allowed || res.RetryAfter != 990 {
		t.Fatalf("get within the retry time: %+v, %v", res, ok)
	}
}

// TestDenyCacheDropsADenialFromBeforeAReset is the deny cache's side of
// the race: a put that carries the epoch from before a reset is dropped,
// one from after it is kept.
func TestDenyCacheDropsADenialFromBeforeAReset(t *testing.T) {
	t.Parallel()
	c := newDenyCache(100)
	l := slowLimit(1)
	denial := bucket.Result{RetryAfter: 1000, ResetAfter: 1000}
	_, before, _ := c.get("k", l, 1, 0)
	c.remove("k")
	c.put("k", before, l, 1, 0, denial)
	if _, _, ok := c.get("k", l, 1, 10); ok {
		t.Fatal("a denial from before the reset was kept")
	}
	_, after, _ := c.get("k", l, 1, 10)
	c.put("k", after, l, 1, 10, denial)
	if _, _, ok := c.get("k", l, 1, 20); !ok {
		t.Fatal("a denial from after the reset was dropped")
	}
}

// Once a denial expires, one request of the node asks Redis (the probe)
// and the others wait for its answer, then look again: a flood costs one
// call, not one per request in the round trip. A denial the probe put is
// what they find; without one, the expired entry goes, and they ask Redis
// each.
func TestDenyCacheOneProbeAfterADenialExpires(t *testing.T) {
	t.Parallel()
	c := newDenyCache(100)
	l := slowLimit(1)
	if done, wait := c.claim("k", 0); done != nil || wait != nil {
		t.Fatal("a client never denied takes no turns")
	}
	c.put("k", 0, l, 1, 0, bucket.Result{RetryAfter: 100})
	if done, wait := c.claim("k", 50); done != nil || wait != nil {
		t.Fatal("before the retry time the cache answers; claim has nothing to say")
	}
	done, wait := c.claim("k", 100)
	if done == nil || wait != nil {
		t.Fatal("the first request after the denial expired is not the probe")
	}
	other, wait2 := c.claim("k", 101)
	if other != nil || wait2 == nil {
		t.Fatal("a second request while the probe is out does not wait for it")
	}
	select {
	case <-wait2.done:
		t.Fatal("the wait ended before the probe's answer")
	default:
	}
	// The probe's answer: allowed, and the bucket lacks the cost again
	// until 1100, which it remembers.
	c.put("k", 0, l, 1, 100, bucket.Result{RetryAfter: 1000})
	done(nil)
	<-wait2.done
	if _, _, ok := c.get("k", l, 1, 102); !ok {
		t.Fatal("the request that waited does not find the probe's denial")
	}
	// A probe whose answer leaves room puts nothing: the entry goes.
	probe, _ := c.claim("k", 1100)
	if probe == nil {
		t.Fatal("no probe after the second denial expired")
	}
	probe(nil)
	if done, wait := c.claim("k", 1101); done != nil || wait != nil {
		t.Fatal("after an answer with room, requests still take turns")
	}
}

// A probe whose client hangs up while its call is out says nothing about
// Redis: the requests that waited for it ask again (one of them probes),
// and get Redis's answer, not the probe's "context canceled". The breaker
// hears no failure.
// Regression test for issue 30 item 1.
func TestDenyCacheProbeWhoseClientHangsUpFailsNoWaiter(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	clock := new(fakeClock)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 10 * time.Second})
	s.conn.now = clock.now
	key := bucketFor("probe-hangs-up")
	l := slowLimit(1)
	if res, err := s.takeLimit(bg, key, l, 1); err != nil || !res.Allowed {
		t.Fatalf("the first take: %+v, %v", res, err)
	}
	if res, err := s.takeLimit(bg, key, l, 1); err != nil || res.Allowed {
		t.Fatalf("the second take: %+v, %v; want denied", res, err)
	}
	// The cached denial has expired on the node's clock; Redis, on its
	// own, still denies for an hour.
	clock.advance(2 * time.Hour)
	srv.Pause()
	paused := true
	defer func() {
		if paused {
			srv.Resume()
		}
	}()
	// A decision on another bucket is out, so the probe's call queues in
	// the batcher, where a client that hangs up stops waiting at once.
	other := make(chan error, 1)
	go func() {
		_, err := s.takeLimit(bg, bucketFor("another-client"), l, 1)
		other <- err
	}()
	redistest.WaitFor(t, 5*time.Second, "the other decision", func() bool { return s.conn.batcher().callers.Load() == 1 })
	probeCtx, hangUp := context.WithCancel(bg)
	probeErr := make(chan error, 1)
	go func() {
		_, err := s.takeLimit(probeCtx, key, l, 1)
		probeErr <- err
	}()
	redistest.WaitFor(t, 5*time.Second, "the probe's claim", func() bool {
		sh := s.conn.denied.shard(string(key))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.entries[string(key)].probe != nil
	})
	const waiters = 3
	type answer struct {
		res bucket.Result
		err error
	}
	answers := make(chan answer, waiters)
	for range waiters {
		go func() {
			res, err := s.takeLimit(bg, key, l, 1)
			answers <- answer{res, err}
		}()
	}
	redistest.WaitFor(t, 5*time.Second, "the requests waiting for the probe", func() bool {
		return waitingForProbe() == waiters
	})
	hangUp()
	if err := <-probeErr; !errors.Is(err, context.Canceled) {
		t.Fatalf("the probe whose client hung up: %v, want context canceled", err)
	}
	if n := s.conn.breaker.failures.Load(); n != 0 {
		t.Fatalf("the breaker counted %d failures for a client that hung up", n)
	}
	srv.Resume()
	paused = false
	if err := <-other; err != nil {
		t.Fatalf("the other decision: %v", err)
	}
	for range waiters {
		a := <-answers
		if a.err != nil || a.res.Allowed || a.res.RetryAfter <= 0 {
			t.Errorf("a request that waited for the probe: %+v, %v; want Redis's denial", a.res, a.err)
		}
	}
}

// waitingForProbe counts the goroutines that wait in decide for another
// request's probe (those blocked in select there, not in a call).
func waitingForProbe() int {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if strings.Contains(g, " [select") && strings.Contains(g, "redisbucket.(*Store).decide(") &&
			!strings.Contains(g, "redisbucket.(*Store).callBy(") {
			n++
		}
	}
	return n
}

// In strict mode, a waiter's give-back (a hang-up, max_waiting's overflow)
// clears the deny cache: the client's next request may wait for the tokens
// given back, as Redis lets it, not be refused from memory.
func TestAWaitersGiveBackClearsTheDenyCache(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	// rate 10/s, capacity 1, max_wait 1s: 11 fit (1 now, 10 waiting).
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	key := bucketFor("denycache")
	for i := range 11 {
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("take %d: %+v, %v; want allowed (waiting)", i, res, err)
		}
	}
	// The 12th would wait 1.1 s: refused, retry in about 100 ms, and the
	// deny cache remembers it.
	res, err := s.takeLimit(bg, key, l, 1)
	if err != nil || res.Allowed {
		t.Fatalf("12th take: %+v, %v; want refused", res, err)
	}
	// The 5 last waiters hang up: each gives its token back, as the
	// handler does (a give-back is at most one capacity).
	for range 5 {
		if err := s.GiveBack(bg, key, oneLimit(l), 1, 1, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Redis now lets the client's next request wait ~0.6 s for them.
	res, err = s.takeLimit(bg, key, l, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Allowed {
		t.Fatalf("after 5 waiters gave their tokens back, the next request: %+v (deny cache hits %d); want allowed, waiting about 600 ms", res, s.DenyCacheHits())
	}
	if res.Wait > 700_000 {
		t.Fatalf("allowed with wait %d µs, want about 600 ms", res.Wait)
	}
}

// A decision has Redis's answer or an error within the store's timeout, also
// for the requests that find an expired denial with a probe in flight: with
// Redis silent, a client's burst does not wait one probe's timeout after
// another (the k-th request k timeouts) until the breaker opens. A client
// with no cached denial is the control.
// Serial: it bounds decisions in wall-clock time.
func TestDenyCacheWaitersAreAnsweredWithinTheTimeout(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	const timeout = 300 * time.Millisecond
	// A decision's bound: the timeout, and half of it for the scheduler.
	const bound = timeout + timeout/2
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: timeout, BreakerFailures: 1000})
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	s.conn.now = clock.now
	ls := []bucket.Limit{slowLimit(1), slowLimit(5)}
	denied := bucketFor("denied")
	fresh := bucketFor("fresh")
	out := make([]bucket.Result, 2)
	if ok, err := s.Take(bg, denied, bucket.Tier{Limits: ls}, 1, out); err != nil || !ok {
		t.Fatalf("set-up: first take %v %v", ok, err)
	}
	if ok, err := s.Take(bg, denied, bucket.Tier{Limits: ls}, 1, out); err != nil || ok {
		t.Fatalf("set-up: second take %v %v; want a denial (cached)", ok, err)
	}
	// The denial expires (the limit refills within the hour), and Redis
	// falls silent.
	clock.advance(2 * time.Hour)
	proxy.Blackhole()

	burst := func(key []byte) time.Duration {
		const n = 6
		var wg sync.WaitGroup
		var mu sync.Mutex
		var slowest time.Duration
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				o := make([]bucket.Result, 2)
				begin := time.Now()
				_, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, o)
				took := time.Since(begin)
				if err == nil {
					t.Errorf("a take answered with Redis silent")
				}
				mu.Lock()
				slowest = max(slowest, took)
				mu.Unlock()
			}()
		}
		wg.Wait()
		return slowest
	}
	// Control: a client with no cached denial. Each call is bounded.
	if d := burst(fresh); d > bound {
		t.Fatalf("control: without a cached denial the slowest of 6 took %v (timeout %v); the test's bound does not hold here", d, timeout)
	}
	if d := burst(denied); d > bound {
		t.Errorf("after a cached denial expired, with Redis silent, the slowest of 6 concurrent requests took %v for its decision; the store's timeout is %v: a waiter first waits out the probe ahead of it (at c46dab4 they then probe one after another)", d.Round(time.Millisecond), timeout)
	}
}
