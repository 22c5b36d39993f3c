package redisbucket

import (
	"context"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"sync"
	"testing"
	"time"
)

// Adversarial review, round 2: the fixes of round 1 (a node under a ban
// setting reports a spent lease at once; prefetches never ban; lease calls
// wait for the give-back before them; Retry-After covers the hold-off) and
// the changes since (a request is refused at once on an oversubscribed
// bucket with a call in flight; a timer prefetches when a hold-off ends).

// review2Fleet plays one client's arrivals on nodes of a fleet and on one
// bucket (strict mode), side by side, on a fake clock.
type review2Fleet struct {
	t     *testing.T
	clock *fakeClock
	m     *sharedModel
	l     bucket.Limit
	one   bucket.State
	// admitted by the fleet and by one bucket; when each first banned.
	fleet, single       int
	fleetBan, singleBan int64
}

func newReview2Fleet(t *testing.T, l bucket.Limit) *review2Fleet {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	return &review2Fleet{t: t, clock: clock, m: &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}, l: l, fleetBan: -1, singleBan: -1}
}

// request sends one request to node, or, with node nil, to a node in
// strict mode (a node without leases, or a cost as large as the lease),
// and the same request to one bucket.
func (f *review2Fleet) request(node *leaseTable) bucket.Result {
	f.t.Helper()
	var res bucket.Result
	if node != nil {
		var err error
		res, err = node.take(bg, []byte("k"), oneLimit(f.l), 1, nil)
		tableSync(node)
		if err != nil {
			f.t.Fatal(err)
		}
	} else {
		f.m.mu.Lock()
		var out [1]bucket.Result
		f.m.bucket("k", 1).Take(f.clock.now(), []bucket.Limit{f.l}, 1, out[:])
		f.m.mu.Unlock()
		res = out[0]
	}
	if res.Allowed {
		f.fleet++
	}
	if res.Banned && f.fleetBan < 0 {
		f.fleetBan = f.clock.now()
	}
	var r bucket.Result
	if f.one, r = bucket.Take(f.one, f.clock.now(), f.l, 1); r.Allowed {
		f.single++
	}
	if r.Banned && f.singleBan < 0 {
		f.singleBan = f.clock.now()
	}
	return res
}

// record is the shared store's record of node's lease on "k", if any.
func (f *review2Fleet) record(node *leaseTable) (buckettest.Held, bool) {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	now := f.clock.now()
	for _, h := range f.m.bucket("k", 1).Held {
		if h.Node == node.node && h.Expires > now {
			return h, true
		}
	}
	return buckettest.Held{}, false
}

func (f *review2Fleet) entry(node *leaseTable) lease {
	sh := node.shard([]byte("k"))
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.m["k"]; e != nil {
		return *e
	}
	return lease{}
}

// Round 1's fix: "a node that spends its lease under a ban setting says so
// at once" (a give-back of 0 naming its lease), so that a refusal on
// another node does not take those tokens for held and bans when one
// bucket would. The report names the node's last call. When that call was
// a prefetch the shared store refused (the bucket ran dry meanwhile: it
// starts no ban, as the fix wants), the refusal left the record as it was,
// with the seq of the call before: the report names a lease the store
// does not have and does nothing. The shared store counts the node's spent
// tokens as out until the record expires (lease_ttl + a sweep + timeout,
// 1.35 s), refuses the client's requests on another node without a ban,
// and lets them have the refill meanwhile.
//
// The client's arrivals: 8 on node A (leases of 1, 2, 4, 8), then
// another node (strict mode) takes exactly what the shared bucket holds,
// then A spends what it holds (its prefetch at half is refused), then the
// client moves to node B, one request a millisecond for 2 s. One bucket
// admits the same up to B's first request, which it refuses and bans.
func TestReview2RefusedPrefetchKeepsASpentLeaseRecordedAndTheBanStartsLate(t *testing.T) {
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second} // 20 20/s, ban 1h
	f := newReview2Fleet(t, l)
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
	for f.entry(a).tokens > 0 {
		if res := f.request(a); !res.Allowed {
			t.Fatalf("node A, on the tokens it holds: %+v", res)
		}
	}
	e := f.entry(a)
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

// "A token is in Redis, held by one node, or spent" and "once both give
// back, Redis holds every token not spent" (TestLeasingNodesConserveEvery
// Token). A node holds tokens of a lease when another node takes what the
// shared bucket holds; the node's next call (a prefetch at half the lease,
// or a request of cost 2 on the last token) is refused. The node then stops using the bucket and gives its
// tokens back (lease_ttl, or a reload): the give-back names the refused
// call, which the shared store has no record of, and returns nothing. The
// tokens count as spent when the old record expires: with no refill to
// speak of, the bucket is short of them for good (3 tokens, and 1).
func TestReview2TokensHeldAcrossARefusedCallAreLostAtTheGiveBack(t *testing.T) {
	for _, tt := range []struct {
		name string
		cost int64
	}{{"a refused prefetch", 1}, {"a refused request of cost 2", 2}} {
		t.Run(tt.name, func(t *testing.T) {
			clock := new(fakeClock)
			clock.micros.Store(1_000_000)
			m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
			l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}} // 100 1/h
			ls := []bucket.Limit{l}
			node := newModelTable(m, LeaseSize{tokens: 10}, time.Second)
			key := []byte("k")
			spent := int64(0)
			take := func(cost int64) bucket.Result {
				res, err := node.take(bg, key, oneLimit(l), cost, nil)
				tableSync(node)
				if err != nil {
					t.Fatal(err)
				}
				if res.Allowed {
					spent += cost
				}
				return res
			}
			held := func() int64 { return node.shard(key).m["k"].tokens }
			for range 8 { // leases of 1, 2, 4, 8, then 10 at half
				take(1)
			}
			t.Logf("after 8 requests the node holds %d, its lease is %d", held(), node.shard(key).m["k"].size)
			// Another node takes what the shared bucket holds.
			m.mu.Lock()
			var out [1]bucket.Result
			sh := m.bucket("k", 1)
			sh.Peek(clock.now(), ls, out[:])
			other := out[0].Remaining
			if !sh.Take(clock.now(), ls, other, out[:]) {
				t.Fatalf("another node's take of %d: %+v", other, out[0])
			}
			m.mu.Unlock()
			spent += other
			calls := m.calls
			if tt.cost == 1 {
				// Under half the lease, the node prefetches: refused.
				for m.calls == calls && held() > 0 {
					take(1)
				}
			} else {
				take(1)
				for held() > 1 {
					take(1)
				}
				if res := take(2); res.Allowed {
					t.Fatalf("a request of cost 2 on 1 token held, the shared bucket empty: %+v", res)
				}
			}
			if m.calls == calls {
				t.Fatal("no call was refused")
			}
			h := held()
			node.close() // a reload; lease_ttl's sweep gives back the same way
			clock.advance(10 * time.Second)
			level := m.level("k", l)
			t.Logf("spent %d; the node held %d after its refused call; after the give-back the shared bucket holds %d", spent, h, level)
			if spent+level != l.Capacity {
				t.Errorf("spent %d + in the shared bucket %d = %d, want the capacity %d: the %d tokens the node held were lost", spent, level, spent+level, l.Capacity, l.Capacity-spent-level)
			}
		})
	}
}

// A request's own lease call is made apart from the request's context, so
// that a client that hangs up does not fail the others waiting on it. When
// the call starts a ban (the client was over its limit), only the request
// that made it reports the ban, for bans_total; if that client hung up
// meanwhile (a brute-forcer that sends and disconnects), nobody reports
// it, and the ban, which holds in the shared store, is never counted.
func TestReview2BanStartedByTheCallOfAClientThatHungUpIsNeverCounted(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
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

// review2Timers is an injected `after`: it keeps the timers, for the test
// to fire when the fake clock reaches them.
type review2Timers struct {
	mu  sync.Mutex
	due []*review2Timer
}

type review2Timer struct {
	at int64
	f  func()
}

func (tm *review2Timers) install(t *leaseTable) {
	t.after = func(d time.Duration, f func()) func() bool {
		tm.mu.Lock()
		defer tm.mu.Unlock()
		timer := &review2Timer{at: t.now() + d.Microseconds(), f: f}
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
func (tm *review2Timers) fire(now int64) int {
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

func (tm *review2Timers) pending() int {
	tm.mu.Lock()
	defer tm.mu.Unlock()
	return len(tm.due)
}

// "A refused request's Retry-After is when the shared bucket holds its
// cost, as the node's last call saw it; the node calls Redis again by
// then", and the hold-off is "never past the Retry-After it gave". The
// new timer fetches the next lease in the background exactly when the
// hold-off ends, on a bucket still in use; and a request that finds the
// node's tokens spent while a call is in flight, on a bucket whose last
// call was short, is refused at once. The hold-off is capped at the
// refused call's Retry-After in whole seconds, so it ends when the clients
// it refused were told to come back: a client that retries then finds the
// timer's call in flight (a round trip to Redis) and is refused again, at
// once, although the shared bucket holds its cost (and 4 more), and one
// bucket would allow it. Before the timer, the retry made the call and was
// allowed.
//
// `rate_limit 100 5/s` (and 1/10s), lease 10, lease_ttl 2s: a node's
// requests drain the bucket, and the call of the first it cannot cover is
// refused, with Retry-After 1 s (10 s); the bucket stays in use (a request
// every 100 ms, refused from memory). The refused retry is told to wait
// one token's refill more: 1 s (10 s), although the bucket holds its cost.
func TestReview2RetryAtRetryAfterIsRefusedAtOnceWhileTheTimersCallIsOut(t *testing.T) {
	for _, refill := range []string{"5/s", "1/10s"} {
		t.Run(refill, func(t *testing.T) { review2RetryAtRetryAfter(t, refill) })
	}
}

func review2RetryAtRetryAfter(t *testing.T, refill string) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	rate, err := bucket.ParseRate(refill)
	if err != nil {
		t.Fatal(err)
	}
	l := bucket.Limit{Capacity: 100, Rate: rate}
	node := newModelTable(m, LeaseSize{tokens: 10}, 2*time.Second)
	node.jitter = func(int64) int64 { return 0 }
	var timers review2Timers
	timers.install(node)
	defer node.close()
	key := []byte("k")
	take := func() bucket.Result {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
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
	answer := make(chan bucket.Result, 1)
	go func() {
		retry, err := node.take(bg, key, oneLimit(l), 1, nil)
		if err != nil {
			t.Error(err)
		}
		answer <- retry
	}()
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

// "The lease table is bounded by deny_cache_size entries" (README). An
// entry evicted while the give-back of its tokens is in flight leaves that
// give-back's channel in its shard's `returning` map, for the key's next
// entry to wait on; only the sweep removes the channels of give-backs
// done, every lease_ttl/4. Eviction starts the give-back and forgets the
// entry at once, so every evicted entry that held tokens leaves one. A
// flood of distinct keys, each seen twice (its second lease holds a
// token), through a table of 64 entries with lease_ttl 1m (a sweep every
// 15 s): after 20,000 keys, with every give-back answered, the shards hold
// 64 entries and a `returning` channel for nearly every key evicted.
func TestReview2ReturningMapGrowsWithEvictionsBetweenSweeps(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	l := bucket.Limit{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 1000}}
	node := newLeaseTable(m, m.now, LeaseSize{tokens: 10}, time.Minute, 100*time.Millisecond, leaseShards, nopLogger)
	defer node.close()
	const keys = 20_000
	for i := range keys {
		key := []byte{'k', byte(i), byte(i >> 8), byte(i >> 16)}
		for range 2 {
			if res, err := node.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
				t.Fatalf("key %d: %+v %v", i, res, err)
			}
		}
		if i%1000 == 0 {
			tableSync(node)
		}
	}
	tableSync(node)
	entries, returning := 0, 0
	for i := range node.shards {
		sh := &node.shards[i]
		sh.mu.Lock()
		entries += len(sh.m)
		returning += len(sh.returning)
		sh.mu.Unlock()
	}
	t.Logf("%d keys through a table of %d entries: %d entries, %d give-back channels kept (every give-back answered)", keys, leaseShards, entries, returning)
	if entries+returning > 2*leaseShards {
		t.Errorf("the table of %d entries holds %d entries and %d channels of give-backs already answered", leaseShards, entries, returning)
	}
}

// "A node with a ban setting asks Redis before it refuses, unless it
// knows a ban holds", because "the ban starts in Redis at the first
// refusal that one bucket would also give". A request that finds the
// node's tokens spent while a prefetch is in flight joins the prefetch;
// the prefetch, which may not ban, is refused, and the request is refused
// with it, without asking: no ban starts. The README's login limit with
// leases (5 attempts 1/h, ban 15m, lease 50%): a brute-forcer's 5th and
// 6th attempts come together; the 5th spends the last token held and
// starts the prefetch, the 6th waits on it. One bucket bans at the 6th;
// the shared store never bans, and an hour later the 7th attempt is
// allowed (one bucket: still refused, the ban refilling from empty).
func TestReview2RequestRefusedWithARefusedPrefetchStartsNoBan(t *testing.T) {
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	f := newReview2Fleet(t, l)
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

// A claim that holds (passes): a hold-off timer that fires after its table
// closed starts no lease call and no give-back. A node drains a bucket,
// its refused call arms the timer, the table closes (a reload), and the
// timer fires: the shared store sees no call after close.
func TestReview2TimerFiringAfterCloseStartsNoCall(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 200_000}}
	node := newModelTable(m, LeaseSize{tokens: 10}, 2*time.Second)
	var timers review2Timers
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
