package redisbucket

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A ban starts in Redis at the first refusal one bucket would also give,
// also when a client spends its bucket through node A (whose last lease
// call recorded the tokens it then spent) and moves to node B, as a client
// behind a changing route does: the shared store must not count A's spent
// tokens as still out, refuse B's requests without a ban, and let B admit
// the refill until A's record expires.
func TestABanStartsOnTimeWhenTheClientMovesToAnotherNode(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second} // 20 20/s, ban 1h
	f := newSideBySide(t, l)
	a := f.node(LeaseSize{tokens: 10}, time.Second)
	b := f.node(LeaseSize{tokens: 10}, time.Second)
	for i := range 2000 { // one request a millisecond for 2 s
		node := a
		if i >= 20 {
			node = b
		}
		f.request(node)
		f.clock.advance(time.Millisecond)
		if i%250 == 0 { // the sweep, every lease_ttl/4
			f.sweep(a, b)
		}
	}
	t.Logf("one bucket admitted %d and banned at %d µs; the fleet admitted %d and banned at %d µs", f.single, f.singleBan, f.fleet, f.fleetBan)
	if f.fleet > f.single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", f.fleet, f.single)
	}
	if f.fleetBan != f.singleBan {
		t.Errorf("the ban started at %d µs, %d ms after one bucket's first refusal", f.fleetBan, (f.fleetBan-f.singleBan)/1000)
	}
}

// A client that never exceeded its limit is not banned: the login limit
// with leases (5 attempts 1/h, ban 15m, lease 50%), five attempts 100 ms
// apart. The node spends the last token it holds, and the background
// prefetch that follows is refused, but starts no ban, for no request was
// refused; an hour later the sixth attempt is allowed, as one bucket
// allows it.
func TestAPrefetchDoesNotBanAClientWithinItsLimit(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	f := newSideBySide(t, l)
	node := f.node(LeaseSize{percent: 50}, time.Second)
	for i := range 5 {
		if res := f.request(node); !res.Allowed || !f.oneLast.Allowed {
			t.Fatalf("attempt %d of 5: fleet %+v, one bucket %+v", i+1, res, f.oneLast)
		}
		f.clock.advance(100 * time.Millisecond)
	}
	if sh := f.m.states["k"]; sh.Banned(f.clock.now()) {
		t.Errorf("after 5 attempts within the capacity of 5, none refused, the shared bucket is banned: %+v", sh.Levels)
	}
	f.clock.advance(time.Hour)
	if res := f.request(node); f.oneLast.Allowed && !res.Allowed {
		t.Errorf("an hour later: one bucket allows the 6th attempt, the fleet refuses it: %+v", res)
	}
}

// bans_total counts each ban once, also a ban a node's background call
// starts and keeps on the entry for the next request to report, when that
// request comes after the ban and is allowed: the login limit with leases
// (5 attempts 1/h, ban 15m, lease 50%), five attempts 100 ms apart, and the
// user back 1 h 16 min later.
func TestABanStartedByAPrefetchIsCountedWhenTheNextRequestIsAllowed(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	var started int
	m.onLease = func(_ string, _ *buckettest.Shared, res bucket.LeaseResult) {
		if res.Banned {
			started++
		}
	}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	counted := 0
	take := func() bucket.Result {
		res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Allowed && res.Banned { // what the handler counts in bans_total
			counted++
		}
		return res
	}
	for range 5 {
		take()
		clock.advance(100 * time.Millisecond)
	}
	clock.advance(76 * time.Minute)
	res := take()
	if started != counted {
		t.Errorf("the shared store started %d ban(s), bans_total would count %d (the next request: %+v)", started, counted, res)
	}
}

// A node that spends its lease under a ban setting says so at once, naming
// its last call, so that a refusal on another node does not take those
// tokens for held. When that call was a prefetch the shared store refused
// (the bucket ran dry meanwhile), the client's requests on another node
// are still refused with a ban when one bucket bans, not let through on
// the refill until the lease's record expires. The client's arrivals: 8 on node A (leases of 1, 2, 4, 8), then
// another node (strict mode) takes exactly what the shared bucket holds,
// then A spends what it holds (its prefetch at half is refused), then the
// client moves to node B, one request a millisecond for 2 s.
func TestABanStartsOnTimeAfterARefusedPrefetchOfASpentLease(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second} // 20 20/s, ban 1h
	f := newSideBySide(t, l)
	a := newModelTable(f.m, LeaseSize{tokens: 10}, time.Second)
	defer a.close()
	b := newModelTable(f.m, LeaseSize{tokens: 10}, time.Second)
	defer b.close()
	for range 8 {
		if res := f.request(a); !res.Allowed {
			t.Fatalf("node A, from a full bucket: %+v", res)
		}
	}
	for left := f.m.level("k", l); left > 0; left-- {
		if res := f.request(nil); !res.Allowed {
			t.Fatalf("another node's take of what the shared bucket holds: %+v", res)
		}
	}
	for a.snapshot([]byte("k")).tokens > 0 {
		if res := f.request(a); !res.Allowed {
			t.Fatalf("node A, on the tokens it holds: %+v", res)
		}
	}
	e := a.snapshot([]byte("k"))
	if rec, ok := f.record(a); ok {
		t.Logf("node A spent what it held: its last call (seq %d) was refused; the shared store still records %d tokens out on A's lease, seq %d", e.seq, rec.Tokens, rec.Seq)
	}
	if f.fleet != f.single {
		t.Fatalf("before B: the fleet admitted %d, one bucket %d", f.fleet, f.single)
	}
	for range 2000 {
		f.request(b)
		f.clock.advance(time.Millisecond)
	}
	t.Logf("one bucket admitted %d and banned at %d µs; the fleet admitted %d and banned at %d µs", f.single, f.singleBan, f.fleet, f.fleetBan)
	if f.fleet > f.single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", f.fleet, f.single)
	}
	if f.fleetBan != f.singleBan {
		t.Errorf("the ban started at %d µs, %d ms after one bucket's", f.fleetBan, (f.fleetBan-f.singleBan)/1000)
	}
}

// A request's own lease call runs apart from the request's context, so that
// a client that hangs up does not fail the others waiting on it. When the
// call starts a ban and its client hung up meanwhile (a brute-forcer that
// sends and disconnects), the ban is still counted once, through onBan.
func TestABanStartedByTheCallOfAClientThatHungUpIsCounted(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 600 * second}
	started := 0
	m.onLease = func(_ string, _ *buckettest.Shared, res bucket.LeaseResult) {
		if res.Banned {
			started++
		}
	}
	node := newModelTable(m, LeaseSize{tokens: 4}, time.Second)
	defer node.close()
	key := []byte("k")
	counted := 0
	node.onBan = func(string) { counted++ } // bans_total, for the bans no request reports
	take := func(ctx context.Context) (bucket.Result, error) {
		res, err := node.take(ctx, key, oneLimit(l), 1, nil)
		if err == nil && !res.Allowed && res.Banned {
			counted++ // what the handler counts in bans_total
		}
		return res, err
	}
	for range 10 {
		if res, _ := take(bg); !res.Allowed {
			t.Fatalf("within the capacity: %+v", res)
		}
		tableSync(node)
	}
	// The 11th attempt: its client hangs up while the call is out.
	m.gate = make(chan struct{})
	ctx, cancel := context.WithCancel(bg)
	done := make(chan error, 1)
	go func() {
		_, err := take(ctx)
		done <- err
	}()
	redistest.WaitFor(t, 5*time.Second, "the call to go out", func() bool {
		sh := node.shard(key)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.m["k"] != nil && sh.m["k"].call != nil
	})
	cancel()
	err := <-done
	close(m.gate)
	tableSync(node)
	// Later attempts are refused under the ban, which they did not start.
	for range 5 {
		if res, _ := take(bg); res.Allowed {
			t.Fatalf("during the ban: %+v", res)
		}
		tableSync(node)
	}
	t.Logf("the request that hung up: %v", err)
	if started != counted {
		t.Errorf("the shared store started %d ban(s); bans_total would count %d", started, counted)
	}
}

// fakeTimers is an injected after: it keeps the timers, for the test to
// fire when the fake clock reaches them.
type fakeTimers struct {
	mu  sync.Mutex
	due []*fakeTimer
}

type fakeTimer struct {
	at int64
	f  func()
}

func (tm *fakeTimers) install(t *leaseTable) {
	t.after = func(d time.Duration, f func()) func() bool {
		tm.mu.Lock()
		defer tm.mu.Unlock()
		timer := &fakeTimer{at: t.now() + d.Microseconds(), f: f}
		tm.due = append(tm.due, timer)
		return func() bool {
			tm.mu.Lock()
			defer tm.mu.Unlock()
			stopped := timer.f != nil
			timer.f = nil
			return stopped
		}
	}
}

// fire runs the timers due by now, and reports how many it ran.
func (tm *fakeTimers) fire(now int64) int {
	tm.mu.Lock()
	var run []func()
	kept := tm.due[:0]
	for _, d := range tm.due {
		switch {
		case d.f == nil: // stopped
		case d.at <= now:
			run = append(run, d.f)
		default:
			kept = append(kept, d)
		}
	}
	tm.due = kept
	tm.mu.Unlock()
	for _, f := range run {
		f()
	}
	return len(run)
}

func (tm *fakeTimers) pending() int {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	return len(tm.due)
}

// A node's hold-off ends when the clients it refused were told to come
// back, and a timer then fetches the next lease in the background. A
// client that retries at its Retry-After finds the timer's call in flight
// (a round trip to Redis), and is allowed, as one bucket allows it (the
// shared bucket holds its cost), not refused at once.
// rate_limit 100 5/s (and 1/10s), lease 10, lease_ttl 2s: a node's
// requests drain the bucket, its refused call answers Retry-After 1 s
// (10 s), and the bucket stays in use (a request every 100 ms, refused
// from memory).
func TestARetryAtRetryAfterIsAllowedWhileTheHoldOffTimersCallIsOut(t *testing.T) {
	t.Parallel()
	for _, refill := range []string{"5/s", "1/10s"} {
		t.Run(refill, func(t *testing.T) { retryAtRetryAfter(t, refill) })
	}
}

func retryAtRetryAfter(t *testing.T, refill string) {
	clock, m := newModelStore()
	rate, err := bucket.ParseRate(refill)
	if err != nil {
		t.Fatal(err)
	}
	l := bucket.Limit{Capacity: 100, Rate: rate}
	node := newModelTable(m, LeaseSize{tokens: 10}, 2*time.Second)
	node.jitter = func(int64) int64 { return 0 }
	var timers fakeTimers
	timers.install(node)
	defer node.close()
	key := []byte("k")
	take := func() bucket.Result { return takeSynced(t, node, key, l) }
	var res bucket.Result
	for i := 0; ; i++ {
		if res = take(); !res.Allowed {
			break
		}
		if i > 200 {
			t.Fatal("200 requests at once on a bucket of 100 all allowed")
		}
	}
	// The request that made the refused call is told to retry when the
	// shared bucket holds its cost, in whole seconds.
	retryAt := clock.now() + bucket.CeilDiv(res.RetryAfter, 1_000_000)*1_000_000
	t.Logf("refused by the node's call, with Retry-After %d µs: the header says %d s", res.RetryAfter, bucket.CeilDiv(res.RetryAfter, 1_000_000))
	for clock.now()+100_000 < retryAt { // the bucket in use meanwhile
		clock.advance(100 * time.Millisecond)
		if res := take(); res.Allowed {
			t.Fatalf("during the hold-off: %+v", res)
		}
		timers.fire(clock.now())
	}
	clock.micros.Store(retryAt)
	// The timer's call is out for a round trip.
	m.gate = make(chan struct{})
	fired := timers.fire(clock.now())
	level := m.level("k", l)
	answer := takeLater(t, node, key, oneLimit(l))
	// The retry either is answered at once or waits on the timer's call.
	redistest.WaitFor(t, 5*time.Second, "the retry to be answered or to join the call", func() bool {
		if len(answer) > 0 {
			return true
		}
		sh := node.shard(key)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m["k"]
		return e != nil && e.call != nil && e.call.joined > 0
	})
	close(m.gate)
	retry := <-answer
	tableSync(node)
	t.Logf("at the retry: %d timer(s) fired; the shared bucket holds %d; the retry: %+v", fired, level, retry)
	if level >= 1 && !retry.Allowed {
		t.Errorf("the client retried after Retry-After (%d s): the shared bucket holds %d, the node refused it at once, and told it to wait %d s more", bucket.CeilDiv(res.RetryAfter, 1_000_000), level, bucket.CeilDiv(retry.RetryAfter, 1_000_000))
	}
}

// A request that finds the node's tokens spent while a prefetch is in
// flight joins it; the prefetch may not ban, and is refused; the request,
// refused with it, then starts the ban, as one bucket does, and the fleet
// admits no more than one bucket. The login limit with leases (5 attempts
// 1/h, ban 15m, lease 50%): the 5th and 6th attempts come together; the 5th
// spends the last token held and starts the prefetch, the 6th waits on it.
func TestARequestRefusedWithARefusedPrefetchStartsTheBan(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	f := newSideBySide(t, l)
	node := newModelTable(f.m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	for i := range 4 {
		if res := f.request(node); !res.Allowed {
			t.Fatalf("attempt %d: %+v", i+1, res)
		}
	}
	// The 5th spends the last token held; its prefetch is out for a round
	// trip, while the 6th comes.
	f.m.gate = make(chan struct{})
	res5, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
	if err != nil || !res5.Allowed {
		t.Fatalf("attempt 5: %+v %v", res5, err)
	}
	f.fleet++
	var r bucket.Result
	if f.one, r = bucket.Take(f.one, f.clock.now(), l, 1); r.Allowed {
		f.single++
	}
	done := make(chan bucket.Result, 1)
	go func() {
		res, _ := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		done <- res
	}()
	redistest.WaitFor(t, 5*time.Second, "the 6th attempt to wait on the prefetch", func() bool {
		sh := node.shard([]byte("k"))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m["k"]
		return e != nil && e.call != nil && e.call.joined == 1
	})
	close(f.m.gate)
	res6 := <-done
	tableSync(node)
	if res6.Allowed {
		t.Fatalf("attempt 6 on a spent bucket: %+v", res6)
	}
	if res6.Banned && f.fleetBan < 0 {
		f.fleetBan = f.clock.now()
	}
	if f.one, r = bucket.Take(f.one, f.clock.now(), l, 1); r.Allowed {
		f.single++
	}
	if r.Banned {
		f.singleBan = f.clock.now()
	}
	banned := f.m.states["k"].Banned(f.clock.now())
	f.clock.advance(time.Hour)
	res7 := f.request(node)
	t.Logf("attempt 6: %+v (shared bucket banned: %v); an hour later, attempt 7: %+v", res6, banned, res7)
	t.Logf("one bucket admitted %d and banned at %d µs; the fleet admitted %d and banned at %d µs", f.single, f.singleBan, f.fleet, f.fleetBan)
	if !banned {
		t.Errorf("attempt 6, refused on a spent bucket as one bucket refuses it, started no ban")
	}
	if f.fleet > f.single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", f.fleet, f.single)
	}
}

// A hold-off timer that fires after its table closed (a reload) starts no
// lease call and no give-back.
func TestAHoldOffTimerFiringAfterCloseStartsNoCall(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 200_000}}
	node := newModelTable(m, LeaseSize{tokens: 10}, 2*time.Second)
	var timers fakeTimers
	timers.install(node)
	for range 150 {
		node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
	}
	if timers.pending() == 0 {
		t.Fatal("no hold-off timer armed")
	}
	node.close()
	m.mu.Lock()
	calls := m.calls
	m.mu.Unlock()
	clock.advance(time.Second)
	fired := timers.fire(clock.now() + int64(time.Hour/time.Microsecond))
	tableSync(node)
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.calls != calls {
		t.Errorf("%d timer(s) fired after close and made %d lease call(s)", fired, m.calls-calls)
	}
}

// TestABanStartsOnTimeAfterARefusedPrefetchOfASpentLease on a real Redis,
// in real time: two leasing nodes (lease 10, lease_ttl 1s),
// rate_limit 20 20/s, ban 1h. The client spends 8 through node A, another
// node (strict) takes what Redis holds, A spends what it holds (its
// prefetch at half is refused), and the client moves to node B, a request
// every 2 ms. As one bucket, B's first request is refused with a ban, and
// B admits nothing after it.
func TestABanStartsOnTimeAfterARefusedPrefetchOfASpentLeaseOnRedis(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-time (1.5 s of a client on a real Redis)")
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second}
	var nodes [3]*Store
	for i := range nodes {
		nodes[i] = newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
		if i < 2 {
			nodes[i].leases = newLeaseTable(nodes[i], nodes[i].conn.now, LeaseSize{tokens: 10}, time.Second, 100*time.Millisecond, 1000, nopLogger)
		}
	}
	a, b, strict := nodes[0], nodes[1], nodes[2]
	defer a.leases.close()
	defer b.leases.close()
	bk := bucketFor("refused-prefetch")
	key := string(bk)
	for i := range 8 {
		res, err := a.takeLimit(bg, bk, l, 1)
		a.leases.calls.Wait()
		if err != nil || !res.Allowed {
			t.Fatalf("node A, request %d: %+v %v", i+1, res, err)
		}
	}
	for {
		peek, _, err := strict.run(bg, key, l, 0)
		if err != nil {
			t.Fatal(err)
		}
		if peek.Remaining == 0 {
			break
		}
		if res, _, err := strict.run(bg, key, l, peek.Remaining); err != nil || !res.Allowed {
			t.Fatalf("the strict node's take of %d: %+v %v", peek.Remaining, res, err)
		}
	}
	entry := func() lease {
		sh := a.leases.shard([]byte(key))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return *sh.m[key]
	}
	for entry().tokens > 0 {
		res, err := a.takeLimit(bg, bk, l, 1)
		a.leases.calls.Wait()
		if err != nil || !res.Allowed {
			t.Fatalf("node A, on the tokens it holds: %+v %v", res, err)
		}
	}
	rdb := srv.Client()
	defer rdb.Close()
	fields, _ := rdb.Get(bg, key).Result()
	t.Logf("node A spent what it held (its last call seq %d); Redis holds %v", entry().seq, fields)
	admitted, firstRefusal := 0, bucket.Result{}
	refused := false
	start := time.Now()
	for time.Since(start) < 1500*time.Millisecond {
		res, err := b.takeLimit(bg, bk, l, 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed && refused {
			admitted++
		} else if !res.Allowed && !refused {
			refused, firstRefusal = true, res
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Logf("node B: first refusal %+v; admitted %d after it, in 1.5 s", firstRefusal, admitted)
	if !firstRefusal.Banned {
		t.Errorf("B's first request, refused on a bucket the client has spent, started no ban; one bucket bans it")
	}
	if admitted > 0 {
		t.Errorf("node B admitted %d after its first refusal, within 1.5 s of the client spending its bucket; one bucket, banned there, admits none", admitted)
	}
}

// A ban with leases, on 4 nodes: 100 at 1/s, ban 10m, lease 10%, 10
// requests a second for 60 s. The ban starts in the shared store on the
// first refusal, other nodes spend at most what they hold, and their
// give-backs do not end it: the fleet admits no more than one bucket on
// the same arrivals (111; it admitted 157), and one request reports the
// ban that started, for bans_total, even when a prefetch started it.
func TestBanHoldsOnEveryLeasingNode(t *testing.T) {
	t.Parallel()
	f := newSideBySide(t, bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: second}, Ban: 600 * second})
	var fleet [4]*leaseTable
	for i := range fleet {
		fleet[i] = f.node(LeaseSize{percent: 10}, time.Second)
	}
	bans := 0
	for i := range 600 {
		if f.request(fleet[i%4]).Banned {
			bans++
		}
		f.clock.advance(100 * time.Millisecond)
		if i%2 == 0 { // the sweep, every 250 ms with lease_ttl 1s
			f.sweep(fleet[:]...)
		}
	}
	if f.fleet > f.single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", f.fleet, f.single)
	}
	if bans != 1 {
		t.Errorf("%d requests reported a ban that started, want 1", bans)
	}
	t.Logf("fleet %d, one bucket %d", f.fleet, f.single)
}

// With leases, a ban starts when one bucket would refuse: the shared level
// plus the tokens out on lease cannot cover the cost. The first refusal, made
// only because another node holds the tokens, answers a refill wait and bans
// nobody, and the holder still spends them; once they are spent, the next
// refusal bans, and after the ban's start plus lease_ttl no node admits a
// request until the ban is over.
func TestARefusalCausedOnlyByTokensOutOnLeaseStartsNoBan(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 7200 * second}
	a := newModelTable(m, LeaseSize{tokens: 5}, time.Second)
	b := newModelTable(m, LeaseSize{tokens: 5}, time.Second)
	defer a.close()
	defer b.close()
	take := func(node *leaseTable) bucket.Result {
		t.Helper()
		res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	for range 3 {
		take(a) // leases of 1 and 2, then a prefetch: a holds tokens
	}
	held := a.snapshot([]byte("k")).tokens
	if held == 0 {
		t.Fatal("node a holds no tokens")
	}
	var refused bucket.Result
	for range 20 {
		if refused = take(b); !refused.Allowed {
			break
		}
	}
	if refused.Allowed || refused.Banned || m.states["k"].Banned(clock.now()) {
		t.Fatalf("b refused with %d tokens on a's lease: %+v, banned %v; want a refusal that bans nobody", held, refused, m.states["k"].Banned(clock.now()))
	}
	if refused.RetryAfter >= l.Ban {
		t.Errorf("the refusal's Retry-After is %d µs, the ban's; want a refill wait", refused.RetryAfter)
	}
	for range held {
		if res := take(a); !res.Allowed {
			t.Fatalf("a's held token refused: %+v", res)
		}
	}
	res := take(b)
	if res.Allowed || !res.Banned {
		t.Fatalf("b's refusal with nothing out on lease: %+v; want the ban started", res)
	}
	start := clock.now()
	clock.advance(time.Second) // lease_ttl
	for clock.now() < start+l.Ban {
		for _, node := range []*leaseTable{a, b} {
			if res := take(node); res.Allowed {
				t.Fatalf("admitted %d µs after the ban started, past lease_ttl", clock.now()-start)
			}
		}
		clock.advance(30 * time.Second)
	}
}

// A ban starts at a refused request, not at a refused prefetch, which
// refuses nobody; the request that starts it reports it, so that
// bans_total counts it once.
func TestABanStartsAtARefusedRequestNotAPrefetch(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 600 * second}
	node := newModelTable(m, LeaseSize{tokens: 20}, time.Hour)
	defer node.close()
	key := []byte("k")
	for range 2 { // leases of 1 and 2 tokens: one is left
		if res, _ := node.take(bg, key, oneLimit(l), 1, nil); !res.Allowed {
			t.Fatal("denied from a full bucket")
		}
		tableSync(node)
	}
	// Another node empties the shared bucket.
	left := m.level("k", l)
	m.mu.Lock()
	var out [1]bucket.Result
	if !m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, left, out[:]) {
		t.Fatalf("another node's take of the %d left: %+v", left, out[0])
	}
	m.mu.Unlock()
	// The last token held is spent, and the prefetch that follows finds
	// the bucket empty: refused, with no ban.
	if res, _ := node.take(bg, key, oneLimit(l), 1, nil); !res.Allowed || res.Banned {
		t.Fatalf("the request on the last token held: %+v", res)
	}
	tableSync(node)
	if sh := m.states["k"]; sh.Banned(clock.now()) {
		t.Fatal("a refused prefetch started a ban")
	}
	if res, _ := node.take(bg, key, oneLimit(l), 1, nil); res.Allowed || !res.Banned {
		t.Fatalf("the next request: %+v, want refused, reporting the ban it started", res)
	}
}

// A refused or partial lease makes the node wait until the shared bucket
// covers its next lease: meanwhile it answers from memory, with no call.
func TestRefusedLeaseHoldsOffCalls(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}} // 1/s
	node := newModelTable(m, LeaseSize{tokens: 5}, time.Minute)
	defer node.close()
	key := []byte("k")
	allowed := 0
	for range 40 {
		res, _ := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if res.Allowed {
			allowed++
		}
	}
	if allowed != 10 {
		t.Fatalf("%d allowed from a bucket of 10 with no time passing, want 10", allowed)
	}
	calls := m.calls
	res, _ := node.take(bg, key, oneLimit(l), 1, nil)
	if res.Allowed || res.RetryAfter <= 0 {
		t.Fatalf("after the bucket ran dry: %+v, want denied with a retry time", res)
	}
	if m.calls != calls {
		t.Errorf("a denial within the hold-off made %d calls, want none", m.calls-calls)
	}
	clock.advance(time.Duration(res.RetryAfter) * time.Microsecond)
	if res, _ := node.take(bg, key, oneLimit(l), 1, nil); !res.Allowed {
		t.Errorf("after the hold-off: %+v, want allowed", res)
	}
}

// A node whose lease call found a quota used up holds its calls off for
// as long as strict mode's deny cache keeps a quota's refusal, at most:
// a give-back elsewhere returns the quota, and the node sees it within
// that time; a give-back on the node itself clears the hold at once. A
// flood of refusals meanwhile costs no call, under a ban setting too (a
// quota starts no ban). Regression test for issue 30 (items 4 and the
// flood under ban).
func TestAQuotaRefusalHoldsLeaseCallsOffNoLongerThanStrictMode(t *testing.T) {
	t.Parallel()
	for _, ban := range []int64{0, 600 * second} {
		t.Run(fmt.Sprintf("ban %ds", ban/second), func(t *testing.T) {
			clock := new(fakeClock)
			tr := quotaTier(40, ban)
			_, midnight := tr.Quotas[0].Bounds(1_000_000)
			clock.micros.Store(midnight - 12*3600*second)
			m := newSharedModel(clock.now)
			node := newModelTable(m, LeaseSize{tokens: 20}, 10*time.Second)
			defer node.close()
			node.jitter = func(n int64) int64 { return n - 1 }
			spendQuota(t, node, clock, tr)
			calls := m.calls
			for range 200 { // a flood, 10 ms apart
				if res, _ := node.take(bg, []byte("k"), tr, 1, nil); res.Allowed {
					t.Fatal("a request admitted past the quota")
				}
				tableSync(node)
				clock.advance(10 * time.Millisecond)
			}
			if extra := m.calls - calls; extra > 1 {
				t.Errorf("a flood of 200 refusals over 2 s cost %d calls, want at most 1", extra)
			}
			// Another node's request did not count: its give-back returns one.
			m.mu.Lock()
			m.bucket("k", 1).GiveBackQuotas(clock.now(), clock.now(), tr.Quotas, 1)
			m.mu.Unlock()
			clock.advance(quotaDenyFor)
			if res, _ := node.take(bg, []byte("k"), tr, 1, nil); !res.Allowed {
				t.Errorf("%s after a give-back elsewhere: %+v; want allowed", quotaDenyFor, res)
			}
			tableSync(node)
			if res, _ := node.take(bg, []byte("k"), tr, 1, nil); res.Allowed {
				t.Fatal("admitted past the quota")
			}
			tableSync(node)
			// This node's own give-back (count_status), past lease_ttl, goes
			// to the shared bucket, and the next request sees it at once.
			clock.advance(11 * time.Second)
			if rest := node.giveBackHeldSince([]byte("k"), 1, clock.now()); rest == 1 {
				m.mu.Lock()
				m.bucket("k", 1).GiveBackQuotas(clock.now(), clock.now(), tr.Quotas, 1)
				m.mu.Unlock()
			}
			if res, _ := node.take(bg, []byte("k"), tr, 1, nil); !res.Allowed {
				t.Errorf("at once after this node's give-back: %+v; want allowed", res)
			}
		})
	}
}

// A refused prefetch whose answer drops tokens of a quota period that has
// ended, with no ban holding the bucket, leaves the node's requests to
// the shared store, which bans when one bucket would: it once held them
// off as if a ban held, so that no ban ever started. Regression test for
// issue 30 ("a refused prefetch after a quota period change").
func TestARefusedPrefetchAcrossMidnightDoesNotHoldOffTheBan(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	q := bucket.Quota{N: 1000, Period: bucket.Day, Loc: time.UTC}
	_, midnight := q.Bounds(1_000_000)
	clock.micros.Store(midnight - 10*second)
	m := newSharedModel(clock.now)
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 600 * second}
	tr := bucket.Tier{Limits: []bucket.Limit{l}, Quotas: []bucket.Quota{q}}
	node := newModelTable(m, LeaseSize{tokens: 20}, time.Hour)
	defer node.close()
	key := []byte("k")
	for range 4 { // leases of 1, 2 and 4 tokens: 3 are left, of a lease of 4
		if res, _ := node.take(bg, key, tr, 1, nil); !res.Allowed {
			t.Fatal("denied from a full bucket")
		}
		tableSync(node)
	}
	// Another node empties the shared bucket.
	m.mu.Lock()
	var peek, out, qout [1]bucket.Result
	m.bucket("k", 1).Peek(clock.now(), []bucket.Limit{l}, peek[:])
	if !m.bucket("k", 1).TakeWithQuotas(clock.now(), []bucket.Limit{l}, []bucket.Quota{q}, peek[0].Remaining, out[:], qout[:]) {
		t.Fatalf("another node's take of the %d left: %+v", peek[0].Remaining, out[0])
	}
	m.mu.Unlock()
	// The next requests spend held tokens, and the prefetch that follows
	// reaches the store after midnight: the tokens' period has ended, the
	// bucket is empty, and a prefetch bans nobody.
	m.gate = make(chan struct{})
	for node.shard(key).m["k"].call == nil {
		if res, _ := node.take(bg, key, tr, 1, nil); !res.Allowed {
			t.Fatalf("a request on a held token: %+v", res)
		}
	}
	clock.micros.Store(midnight + second)
	close(m.gate)
	tableSync(node)
	if m.states["k"].Banned(clock.now()) {
		t.Fatal("a refused prefetch started a ban")
	}
	res, _ := node.take(bg, key, tr, 1, nil)
	if res.Allowed || !res.Banned {
		t.Errorf("the next request, which one bucket refuses: %+v; want refused, starting the ban", res)
	}
}

// askedAt is a lease call the model answered: its key, its ask and when.
type askedAt struct {
	key string
	ask bucket.LeaseAsk
	at  int64
}

// askLog is the model store that logs every lease call.
type askLog struct {
	*sharedModel
	mu   sync.Mutex
	asks []askedAt
}

func (r *askLog) lease(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error) {
	r.mu.Lock()
	r.asks = append(r.asks, askedAt{key, a, r.now()})
	r.mu.Unlock()
	return r.sharedModel.lease(ctx, key, tr, a, each)
}

// Keys in steady use renew their leases before they lapse, in the
// background and spread out in time: 200 keys started together, each seen
// 30 times a second (bench/keys.lua's clients, setup (i) of bench/run.sh),
// make no lease call for a request once each has ramped up (its first two
// requests: a first lease of one request's cost, then the next), and after
// the ramp (2 s) no 10 ms holds more than an eighth of the keys' calls (a
// wave: every key's, 60, in one pass of 33 ms), nor does a key call more
// than 1.5 times a lease_ttl. No key ever holds more than two leases' tokens.
// Regression test for issue 34 (leases lapsing in waves).
func TestKeysInSteadyUseRenewTheirLeasesSpreadOut(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	remote := &askLog{sharedModel: m}
	const keys, perSecond, seconds = 200, 30, 5
	ttl := time.Second
	node := newLeaseTable(remote, m.now, LeaseSize{percent: 10}, ttl, 100*time.Millisecond, 1000, nopLogger)
	node.jitter = func(int64) int64 { return 0 }
	defer node.close()
	l := bucket.Limit{Capacity: 10_000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}}
	names := make([][]byte, keys)
	for i := range names {
		names[i] = []byte(fmt.Sprintf("client-%d", i))
	}
	start := clock.now()
	step := time.Second / (keys * perSecond)
	var most int64
	for i := range keys * perSecond * seconds {
		key := names[i%keys]
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d: %+v, %v", i, res, err)
		}
		if e := node.snapshot(key); e.size > 0 {
			most = max(most, e.tokens*100/e.size)
		}
		clock.advance(step)
	}
	remote.mu.Lock()
	asks := remote.asks
	remote.mu.Unlock()
	forRequests := map[string]int{}
	var late []int64
	for _, a := range asks {
		if !a.ask.Prefetch {
			forRequests[a.key]++
		}
		if a.at >= start+2*time.Second.Microseconds() {
			// Past the ramp: the keys' leases doubled in step, each at
			// half, until they last a lease_ttl.
			late = append(late, a.at)
		}
	}
	waited := 0
	for _, n := range forRequests {
		waited += max(0, n-2)
	}
	if waited > 0 {
		t.Errorf("%d lease calls made for requests beyond each key's first two (%d calls in all); want none: a key in steady use renews in the background", waited, len(asks))
	}
	crowd := 0
	for i := range late {
		n := 0
		for j := i; j < len(late) && late[j] < late[i]+10_000; j++ {
			n++
		}
		crowd = max(crowd, n)
	}
	if crowd > keys/8 {
		t.Errorf("after the ramp, %d lease calls within 10 ms; want at most %d (the keys' renewals spread out, not every key's in one pass of 33 ms)", crowd, keys/8)
	}
	if perKey := float64(len(late)) / keys / (seconds - 2); perKey > 1.5 {
		t.Errorf("after the ramp, %.2f lease calls a key a second; want at most 1.5 (a renewal a lease_ttl, a part early)", perKey)
	}
	if most > 200 {
		t.Errorf("a key held %d%% of its lease size; want at most two leases' tokens", most)
	}
}

// A renewal that fails (Redis slow or down) is not sent again in the
// background while the lease lasts: background calls do not count toward
// the breaker, and one a request would otherwise send every time it finds
// the lease due would pile more calls on a Redis that cannot answer them.
// The lease's requests spend what it holds; once it lapses a request calls
// itself, and that call counts.
// Regression test for issue 34 (renewals retried on every request).
func TestAFailedRenewalIsNotRetriedInTheBackground(t *testing.T) {
	t.Parallel()
	clock, m, remote, node, l, key := steadyLease(t)
	take := func() bucket.Result { return takeSynced(t, node, key, l) }
	e := node.snapshot(key)
	m.mu.Lock()
	m.down = true
	m.mu.Unlock()
	remote.mu.Lock()
	before := len(remote.asks)
	remote.mu.Unlock()
	clock.micros.Store(e.renewAt)
	for range 20 {
		if node.snapshot(key).tokens < 1 || node.lapsed(&e, clock.now()) {
			break
		}
		take()
		clock.advance(5 * time.Millisecond)
	}
	remote.mu.Lock()
	sent := remote.asks[before:]
	remote.mu.Unlock()
	if len(sent) != 1 || !sent[0].ask.Prefetch {
		t.Fatalf("requests that found the lease due for renewal while the store failed: %d lease calls (the first a prefetch: %v); want one renewal", len(sent), len(sent) > 0 && sent[0].ask.Prefetch)
	}
}

// A failed renewal keeps the lease's background calls quiet only while
// that lease lasts: once a request's own call has brought a new lease
// (Redis answers again), its tokens falling to half are prefetched in the
// background as any lease's, and no further request waits on a call.
// Regression test for issue 34 (a failed renewal's quiet outlived its lease).
func TestANewLeaseAfterAFailedRenewalPrefetchesAgain(t *testing.T) {
	t.Parallel()
	clock, m, remote, node, l, key := steadyLease(t)
	take := func() { allowSynced(t, node, key, l) }
	e := node.snapshot(key)
	setDown := func(down bool) {
		m.mu.Lock()
		m.down = down
		m.mu.Unlock()
	}
	setDown(true)
	clock.micros.Store(e.renewAt)
	take() // the renewal, which fails
	setDown(false)
	remote.mu.Lock()
	before := len(remote.asks)
	remote.mu.Unlock()
	// 10 requests a millisecond, all within the failed renewal's lease:
	// its tokens run out, a request calls, and then the new lease's.
	for range 400 {
		take()
		clock.advance(100 * time.Microsecond)
	}
	if now := clock.now(); now >= e.leasedAt+time.Second.Microseconds() {
		t.Fatalf("the requests went on past the lease's end (%d ≥ %d)", now, e.leasedAt+time.Second.Microseconds())
	}
	remote.mu.Lock()
	sent := remote.asks[before:]
	remote.mu.Unlock()
	forRequests, prefetches := 0, 0
	for _, a := range sent {
		if a.ask.Prefetch {
			prefetches++
		} else {
			forRequests++
		}
	}
	if forRequests != 1 || prefetches == 0 {
		t.Errorf("once Redis answered again: %d lease calls for requests, %d prefetches; want one request's call (the failed renewal's lease ran out), then prefetches", forRequests, prefetches)
	}
}

// steadyLease is a node whose key k, on a limit of 10,000 at 1,000/s with
// a lease of up to 1,000 and lease_ttl 1s, has been asked 100 times a
// second until its lease is large enough to last (64 tokens); remote logs
// the node's lease calls.
func steadyLease(t *testing.T) (clock *fakeClock, m *sharedModel, remote *askLog, node *leaseTable, l bucket.Limit, key []byte) {
	t.Helper()
	clock, m = newModelStore()
	remote = &askLog{sharedModel: m}
	node = newLeaseTable(remote, m.now, LeaseSize{tokens: 1000}, time.Second, 100*time.Millisecond, 1000, nopLogger)
	t.Cleanup(node.close)
	l = bucket.Limit{Capacity: 10_000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}}
	key = []byte("k")
	for node.snapshot(key).size < 64 {
		allowSynced(t, node, key, l)
		clock.advance(10 * time.Millisecond)
	}
	return clock, m, remote, node, l, key
}

// Through a real redis-server that stops answering (SIGSTOP) while a
// give-back of the bucket is out, requests whose lease call waits for it
// (fetch) end, with an error, within the store's timeout, as a strict
// decision does (TestStrictTakesEndWithinTheTimeoutWhileRedisIsStopped):
// the wait for the give-back and the call after it share it, for the
// request that made the call and for one that joined it.
func TestALeaseCallWaitingOnAGiveBackEndsWhileRedisIsStopped(t *testing.T) {
	skipUnderShort(t, "stops Redis")
	srv := redistest.Start(t)
	const timeout = time.Second
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: timeout, Lease: "4", BreakerFailures: 1000})
	node := s.leases
	key, tr := bucketFor("stopped-call"), oneLimit(slowLimit(8))
	// Redis stops once the node holds tokens, before their give-back;
	// the bucket is not refused from memory after it: the next request
	// makes a lease call.
	holdTokens(t, node, key, tr, srv.Pause)
	defer srv.Resume()
	sh := node.shard(key)
	sh.mu.Lock()
	sh.m[string(key)].banUntil = 0
	sh.mu.Unlock()

	start := time.Now()
	done := make(chan error, 2)
	for range 2 {
		go func() {
			_, err := node.take(bg, key, tr, 1, nil)
			done <- err
		}()
	}
	// The race detector and a loaded machine get some slack, under a
	// second timeout more.
	bound := timeout + 700*time.Millisecond
	for i := range 2 {
		select {
		case err := <-done:
			if err == nil {
				t.Errorf("request %d answered while Redis was stopped", i+1)
			}
			if took := time.Since(start); took > bound {
				t.Errorf("request %d took %s with a %s timeout", i+1, took, timeout)
			}
		case <-time.After(bound + 5*time.Second):
			t.Fatalf("request %d still waits %s after it came, with a %s timeout", i+1, time.Since(start), timeout)
		}
	}
}
