package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"math/rand/v2"
	"sync"
	"testing"
	"time"
)

// Adversarial review of issue 20's fixes. Each test states a claim of the
// README or issue 20, and plays it against one
// bucket (strict mode) on the same arrivals, or against shared.go's model.

// A give-back computed under an older config creates no tokens (README:
// "it never ... raises the level past what the current limit allows, even
// when it was computed under an older config"; README: "never creates
// tokens under an older, smaller limit"). The existing test changes only
// the capacity. Here a reload changes the refill too, `rate_limit 10 1/s`
// to `rate_limit 1000 100/s`: a request admitted under the old config and
// answered after the reload (count_status) gives back its one token with
// the old limit, and so does a lease table closed at the reload. The
// give-back takes one old token's refill time (1 s) off the bucket's time
// to full, which is 100 tokens of the new limit.
func TestReviewGiveBackUnderAnOlderRateCreatesTokens(t *testing.T) {
	old := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: second}}   // 10 1/s
	cur := bucket.Limit{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 10_000}} // 1000 100/s
	now := 10 * second
	st, _ := bucket.Take(bucket.State{}, now, cur, 200) // 800 left
	// The handler and a lease table closed by a reload give back in the
	// running config's limit, converted with Converted; the math never
	// sees an old limit.
	t.Run("GiveBack", func(t *testing.T) {
		got := bucket.Peek(bucket.GiveBack(st, now, cur, cur.Converted(1, old)), now, cur).Remaining
		if got != 801 {
			t.Errorf("800 left of 1000, one token given back under the old limit 10 1/s: %d left, want 801", got)
		}
		// A slower refill: one old token is a hundredth of a new one.
		if got := bucket.Peek(bucket.GiveBack(st, now, cur, old.Converted(1, cur)), now, old).Remaining; got > bucket.Peek(st, now, old).Remaining {
			t.Errorf("a token of 100/s given back under 1/s added %d", got-bucket.Peek(st, now, old).Remaining)
		}
	})
	t.Run("Shared.GiveBack", func(t *testing.T) {
		sh := &buckettest.Shared{Levels: []bucket.State{st}}
		sh.GiveBack(now, []bucket.Limit{cur}, cur.Converted(1, old))
		var out [1]bucket.Result
		sh.Peek(now, []bucket.Limit{cur}, out[:])
		if out[0].Remaining != 801 {
			t.Errorf("shared bucket, 800 left, one token back under the old limit: %d left, want 801", out[0].Remaining)
		}
	})
	t.Run("a lease table closed by the reload", func(t *testing.T) {
		// A node of the old config leased before the reload, and gives
		// back when its table closes, 2 s later, as the new config counts.
		clock := new(fakeClock)
		clock.micros.Store(now - 2*second)
		m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
		node := newModelTable(m, LeaseSize{tokens: 5}, time.Hour)
		node.current = func(string, bucket.Tier) (bucket.Tier, bool) { return bucket.Tier{Limits: []bucket.Limit{cur}}, true }
		for range 3 { // leases of 1, 2, 4: 3 held
			if res, _ := node.take(bg, []byte("k"), oneLimit(old), 1, nil); !res.Allowed {
				t.Fatal("denied from a full bucket")
			}
			tableSync(node)
		}
		clock.micros.Store(now)
		m.mu.Lock()
		var out [1]bucket.Result
		sh := m.bucket("k", 1)
		sh.Peek(now, []bucket.Limit{cur}, out[:])
		if !sh.Take(now, []bucket.Limit{cur}, out[0].Remaining-800, out[:]) {
			t.Fatalf("take down to 800: %+v", out[0])
		}
		m.mu.Unlock()
		before := m.level("k", cur)
		held := node.shard([]byte("k")).m["k"].tokens
		node.close()
		if after := m.level("k", cur); after > before+held {
			t.Errorf("%d leased tokens returned under the old limit: %d left, then %d, want at most %d", held, before, after, before+held)
		}
	})
}

// With ban, "the ban starts in Redis at the first refusal that one bucket
// would also give", and "a ban on leasing nodes admits no more than one
// bucket on the same arrivals". A client spends its bucket through node A
// (whose last lease call recorded 8 tokens it then spent), then moves to
// node B, as a client behind a changing route or anycast does. One bucket
// refuses and bans at the 21st request. The shared store counts A's spent
// tokens as still out until A's record expires (lease_ttl + a sweep +
// timeout, 1.35 s), so it refuses B's requests without a ban, and B
// admits the refill meanwhile.
func TestReviewBanStartsLateWhileASpentLeaseIsStillRecorded(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second} // 20 20/s, ban 1h
	a := newModelTable(m, LeaseSize{tokens: 10}, time.Second)
	defer a.close()
	b := newModelTable(m, LeaseSize{tokens: 10}, time.Second)
	defer b.close()
	var one bucket.State
	var fleet, single int
	var fleetBan, singleBan int64 = -1, -1
	for i := range 2000 { // one request a millisecond for 2 s
		node := a
		if i >= 20 {
			node = b
		}
		res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			fleet++
		}
		if res.Banned && fleetBan < 0 {
			fleetBan = clock.now()
		}
		var r bucket.Result
		if one, r = bucket.Take(one, clock.now(), l, 1); r.Allowed {
			single++
		}
		if r.Banned && singleBan < 0 {
			singleBan = clock.now()
		}
		clock.advance(time.Millisecond)
		if i%250 == 0 { // the sweep, every lease_ttl/4
			for _, n := range []*leaseTable{a, b} {
				if back := n.sweep(clock.now(), false); len(back) > 0 {
					n.giveBackNow(back)
				}
			}
		}
	}
	t.Logf("one bucket admitted %d and banned at %d µs; the fleet admitted %d and banned at %d µs", single, singleBan, fleet, fleetBan)
	if fleet > single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", fleet, single)
	}
	if fleetBan != singleBan {
		t.Errorf("the ban started at %d µs, %d ms after one bucket's first refusal", fleetBan, (fleetBan-singleBan)/1000)
	}
}

// "A ban starts in Redis on the first refusal" (README: "a denied
// request holds its bucket empty"): a client that never exceeded its limit
// is not banned. The README's login limit with leases: 5 attempts 1/h, ban
// 15m, lease 50% (leases of 2), five attempts 100 ms apart, all within
// the capacity. The node spends the last token it holds, and the
// background prefetch that follows, refused, starts the ban, for no
// refused request. An hour later one bucket allows the sixth attempt (one
// token refilled, no ban); the fleet refuses it.
func TestReviewPrefetchBansAClientThatNeverExceededItsLimit(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	var one bucket.State
	for i := range 5 {
		res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
		var r bucket.Result
		one, r = bucket.Take(one, clock.now(), l, 1)
		if err != nil || !res.Allowed || !r.Allowed {
			t.Fatalf("attempt %d of 5: fleet %+v %v, one bucket %+v", i+1, res, err, r)
		}
		clock.advance(100 * time.Millisecond)
	}
	if sh := m.states["k"]; sh.Banned(clock.now()) {
		t.Errorf("after 5 attempts within the capacity of 5, none refused, the shared bucket is banned: %+v", sh.Levels)
	}
	clock.advance(time.Hour)
	res, _ := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
	tableSync(node)
	_, r := bucket.Take(one, clock.now(), l, 1)
	if r.Allowed && !res.Allowed {
		t.Errorf("an hour later: one bucket allows the 6th attempt, the fleet refuses it: %+v", res)
	}
}

// "A refused request's Retry-After is when the shared bucket holds its
// cost, as the node's last call saw it; the node calls Redis again by
// then." A node's refused lease sets a hold-off, capped at the Retry-After
// of the call rounded up to whole seconds from when the call was sent. A
// request refused from memory later in the hold-off is told a shorter
// wait, rounded up from its own time, which can end before the hold-off
// does: the client retries when the shared bucket holds its token, and the
// node refuses it again without asking.
func TestReviewRetryAfterFromMemoryEndsBeforeTheHoldOff(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	rate, err := bucket.ParseRate("5/6s") // a token every 1.2 s
	if err != nil {
		t.Fatal(err)
	}
	l := bucket.Limit{Capacity: 100, Rate: rate}
	node := newModelTable(m, LeaseSize{tokens: 10}, time.Hour)
	node.jitter = func(int64) int64 { return 0 }
	defer node.close()
	key := []byte("k")
	var res bucket.Result
	for range 200 {
		res, _ = node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if !res.Allowed {
			break
		}
	}
	if res.Allowed {
		t.Fatal("200 requests at once from a bucket of 100 all allowed")
	}
	clock.advance(300 * time.Millisecond)
	res, _ = node.take(bg, key, oneLimit(l), 1, nil)
	tableSync(node)
	if res.Allowed {
		t.Fatalf("0.3 s after the bucket ran dry: %+v", res)
	}
	header := max(1, bucket.CeilDiv(res.RetryAfter, 1_000_000))
	clock.advance(time.Duration(header) * time.Second)
	level := m.level("k", l)
	calls := m.calls
	again, _ := node.take(bg, key, oneLimit(l), 1, nil)
	tableSync(node)
	if level >= 1 && !again.Allowed {
		t.Errorf("the client retried after Retry-After: %d s; the shared bucket holds %d, but the node refused it from memory (%d calls): %+v", header, level, m.calls-calls, again)
	}
}

// "A request whose entry was evicted while it waited is not refused"
// (README Guarantees; issue 20 item 11). The existing test uses buckets
// that always cover every call, so a waiter never sees a short call. Here
// the call it waited on is short: it granted 2 of the 8 asked for (the
// shared bucket held 2), the request that made it spent 1, and 1 is left
// for the waiter. Another client's request on the same node evicts the
// entry (a full shard) after the call returns and before the waiter looks
// again: the entry's token goes back to the shared bucket, and the waiter,
// on a new entry, is refused because the call it waited on was short,
// although the shared bucket holds its token and one bucket allows both
// requests. The evicting request is made to come first by holding the
// shard's lock while the call's answer is applied (the hold-off's jitter
// runs under it); a scheduling that lets the waiter in first can only make
// the test pass, never fail.
func TestReviewWaiterOfAShortCallIsRefusedWhenItsEntryIsEvicted(t *testing.T) {
	for attempt := range 5 {
		m := &sharedModel{now: monotonicMicros, states: map[string]*buckettest.Shared{}}
		l := slowLimit(100)
		// 64 entries: one a shard.
		node := newLeaseTable(m, m.now, LeaseSize{tokens: 10}, time.Hour, time.Second, leaseShards, nopLogger)
		a := []byte("a")
		var other []byte
		for i := 0; other == nil; i++ {
			if k := []byte{'b', byte(i), byte(i >> 8)}; node.shard(k) == node.shard(a) {
				other = k
			}
		}
		if res, err := node.take(bg, a, oneLimit(l), 1, nil); err != nil || !res.Allowed {
			t.Fatalf("first request: %+v, %v", res, err)
		}
		tableSync(node)
		sh := node.shard(a)
		sh.mu.Lock()
		sh.m["a"].size = 4 // the node's leases have grown: the next asks for 8
		sh.mu.Unlock()
		// Other nodes leave 2 in the shared bucket.
		m.mu.Lock()
		var out [1]bucket.Result
		if !m.bucket("a", 1).Take(m.now(), []bucket.Limit{l}, 97, out[:]) {
			t.Fatalf("another node's take: %+v", out[0])
		}
		m.mu.Unlock()
		m.gate = make(chan struct{})
		evicted := make(chan struct{})
		var once sync.Once
		node.jitter = func(int64) int64 {
			once.Do(func() {
				go func() {
					defer close(evicted)
					node.take(bg, other, oneLimit(l), 1, nil) // waits for the shard's lock, then evicts "a"
				}()
				time.Sleep(20 * time.Millisecond) // the evicting request is queued on the lock
			})
			return 0
		}
		results := make(chan bucket.Result, 2)
		for range 2 {
			go func() {
				res, _ := node.take(bg, a, oneLimit(l), 1, nil)
				results <- res
			}()
		}
		redistest.WaitFor(t, 5*time.Second, "the second request to join the call", func() bool {
			sh.mu.Lock()
			defer sh.mu.Unlock()
			e := sh.m["a"]
			return e != nil && e.call != nil && e.call.joined == 1
		})
		close(m.gate)
		r1, r2 := <-results, <-results
		<-evicted
		tableSync(node)
		node.close()
		if !r1.Allowed || !r2.Allowed {
			t.Fatalf("attempt %d: the shared bucket held 2 for 2 requests; one bucket allows both, the node answered %+v and %+v", attempt, r1, r2)
		}
	}
}

// "bans_total counts each ban once" (issue 20 item 2; README: "a ban ...
// is counted once"). The handler counts a ban when a refused request
// reports it (module.go finish). A ban that a node's background prefetch
// starts is kept on the entry for the next request to report; when the
// next request comes after the ban, it is allowed, and the ban goes
// uncounted. The README's login limit with leases: 5 attempts 1/h, ban
// 15m, lease 50%; five attempts 100 ms apart start a ban through the
// prefetch (see TestReviewPrefetchBansAClientThatNeverExceededItsLimit),
// and the user comes back 1 h 16 min later, when the ban is over and a
// token has refilled.
func TestReviewBanStartedByAPrefetchGoesUncountedWhenTheNextRequestIsAllowed(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
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

// The window bound under concurrency (a claim that holds, as far as this
// test reaches): the lease model test runs its requests one at a time and
// waits for every call. Here, at each instant of a fake clock, 4 to 16
// requests run at once on 2 to 4 nodes (so they join calls in flight,
// spend while a prefetch is out, and race its answer), then, at the next
// instant, count_status give-backs, sweeps, reloads and outages run at
// once. In every other round the tables hold one entry a shard and other
// clients' requests evict the bucket's entry. Over every window between
// two admissions the fleet takes at most
// C + floor(r*(b-a)) net of give-backs (lease_model_test.go's checkFleet,
// without its ban check, which needs an order within an instant).
func TestReviewConcurrentFleetKeepsTheWindowBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(20, 99))
	rounds := 60
	if testing.Short() {
		rounds = 15
	}
	for round := range rounds {
		r := randomFleetRound(rng, 0)
		if err := runConcurrentFleet(rng, r, 150, round%2 == 1); err != nil {
			t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes): %v", round, r.limit, r.size, r.ttl, r.nodes, err)
		}
	}
	// The harness has teeth: a store that grants one token more than it
	// records is caught.
	for round := range 60 {
		r := randomFleetRound(rng, 0)
		r.mutate = func(_ *buckettest.Shared, res *bucket.LeaseResult) {
			if res.Granted > 0 {
				res.Granted++
			}
		}
		if err := runConcurrentFleet(rng, r, 150, false); err != nil {
			t.Logf("a broken store is caught in round %d: %v", round, err)
			return
		}
	}
	t.Error("no round caught a store that grants one token more than it records")
}

func runConcurrentFleet(rng *rand.Rand, r fleetRound, instants int, tiny bool) error {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000 + rng.Int64N(1_000_000_000))
	l := r.limit
	ls := []bucket.Limit{l}
	key := "bucket"
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}, mutate: r.mutate}
	now := clock.now()
	start := &buckettest.Shared{Levels: []bucket.State{{}}}
	if k := rng.Int64N(l.Capacity + 1); k > 0 {
		start.Levels[0], _ = bucket.Take(bucket.State{}, now, l, k)
	}
	m.states[key] = start
	timeout := time.Duration(rng.IntN(200)) * time.Millisecond
	newTable := func() *leaseTable {
		entries := 1000
		if tiny {
			entries = leaseShards // one entry a shard: another key evicts
		}
		tb := newLeaseTable(m, m.now, r.size, r.ttl, timeout, entries, nopLogger)
		tb.jitter = rand.New(rand.NewPCG(rng.Uint64(), 0)).Int64N
		return tb
	}
	tables := make([]*leaseTable, r.nodes)
	for i := range tables {
		tables[i] = newTable()
	}
	defer func() {
		for _, tb := range tables {
			tb.close()
		}
	}()
	var mu sync.Mutex
	var adm, backs []admission
	m.onReturn = func(n int64) {
		mu.Lock()
		backs = append(backs, admission{at: clock.now(), cost: n})
		mu.Unlock()
	}
	syncAll := func() {
		for _, tb := range tables {
			tableSync(tb)
		}
	}
	for range instants {
		clock.advance(time.Duration(rng.Int64N(int64(r.ttl) / 2)))
		// The requests of this instant, at once.
		var wg sync.WaitGroup
		at := clock.now()
		for range 4 + rng.IntN(13) {
			i := rng.IntN(len(tables))
			tb := tables[i]
			cost := 1 + rng.Int64N(min(3, l.Capacity))
			if tiny && rng.IntN(2) == 0 {
				// Another client: in a table of one entry a shard, one
				// in 64 of these evicts the bucket's entry.
				other := []byte{'o', byte(rng.IntN(256))}
				wg.Go(func() { tb.take(bg, other, oneLimit(l), 1, nil) })
				continue
			}
			wg.Go(func() {
				res, err := tb.take(bg, []byte(key), oneLimit(l), cost, nil)
				if err == nil && res.Allowed {
					mu.Lock()
					adm = append(adm, admission{at: at, due: at + res.Wait, cost: cost, node: i})
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		syncAll()
		// Then, a microsecond later, what runs beside them.
		clock.advance(time.Microsecond)
		at = clock.now()
		var returned []admission
		for k := len(adm) - 1; k >= 0 && k >= len(adm)-20; k-- {
			if !adm[k].returned && adm[k].cost > 0 && rng.IntN(3) == 0 {
				adm[k].returned = true
				returned = append(returned, adm[k])
			}
		}
		for _, a := range returned {
			tb := tables[a.node]
			mu.Lock()
			backs = append(backs, admission{at: at, cost: a.cost})
			mu.Unlock()
			adm = append(adm, admission{at: at, due: at, cost: -a.cost, node: a.node, returned: true})
			wg.Go(func() {
				rest := tb.giveBackHeld([]byte(key), a.cost)
				if rest > 0 {
					m.mu.Lock()
					if !m.down {
						m.bucket(key, 1).GiveBack(m.now(), ls, rest)
					}
					m.mu.Unlock()
				}
			})
		}
		for _, tb := range tables {
			if rng.IntN(4) == 0 {
				wg.Go(func() {
					if back := tb.sweep(clock.now(), false); len(back) > 0 {
						tb.giveBackNow(back)
					}
				})
			}
		}
		wg.Wait()
		if rng.IntN(20) == 0 {
			i := rng.IntN(len(tables))
			tables[i].close()
			tables[i] = newTable()
		}
		if rng.IntN(30) == 0 {
			m.mu.Lock()
			m.down = !m.down
			m.mu.Unlock()
		}
		syncAll()
	}
	return checkFleet(adm, backs, nil, l, r.ttl)
}
