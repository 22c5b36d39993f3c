package redisbucket

import (
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Regression tests for what was once broken in leases: a burst after
// a refill, bans on leasing nodes, Retry-After, and the lease table's
// edges.

// docs/fleet.md's setup, `rate_limit 200 50/s` with `lease 10%` and
// `lease_ttl 1s` on 4 nodes: 4 requests on each, a 0.8 s pause, then a
// burst from all. The tokens the nodes hold stay out of the refill, so the
// burst gets at most the capacity, and the fleet no more than one bucket
// on the same arrivals (it admitted 212 in the burst, 228 in all, against
// 216).
func TestBurstAfterARefillGetsNoMoreThanTheCapacity(t *testing.T) {
	t.Parallel()
	f := newSideBySide(t, bucket.Limit{Capacity: 200, Rate: bucket.Rate{Tokens: 50, Interval: second}})
	var fleet [4]*leaseTable
	for i := range fleet {
		fleet[i] = f.node(LeaseSize{percent: 10}, time.Second)
	}
	for node := range fleet {
		for range 4 {
			f.request(fleet[node])
			f.clock.advance(time.Millisecond)
		}
	}
	f.clock.advance(800 * time.Millisecond)
	burst := 0
	for i := range 400 {
		if f.request(fleet[i%4]).Allowed {
			burst++
		}
	}
	if burst > 200 {
		t.Errorf("the burst after the refill got %d, more than the capacity 200", burst)
	}
	if f.fleet > f.single {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", f.fleet, f.single)
	}
	if burst < 190 {
		t.Errorf("the burst got %d, want near the capacity, 200", burst)
	}
	t.Logf("burst %d, in all %d; one bucket %d", burst, f.fleet, f.single)
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

// A refused request is told when the shared bucket holds its cost, not the
// node's next lease, and the node calls again by then: lease 10% of 100 at
// 1/s is a lease of 10 tokens, 10 s of refill, but one request waits 1 s.
// With a ban, it waits the ban and one request's refill, as docs/fleet.md
// says.
func TestLeaseRetryAfterIsTheRequestsWait(t *testing.T) {
	t.Parallel()
	for _, ban := range []int64{0, 60 * second} {
		clock, m := newModelStore()
		l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: second}, Ban: ban}
		node := newModelTable(m, LeaseSize{percent: 10}, time.Hour)
		var res bucket.Result
		for range 200 {
			var err error
			if res, err = node.take(bg, []byte("k"), oneLimit(l), 1, nil); err != nil {
				t.Fatal(err)
			}
			tableSync(node)
			if !res.Allowed {
				break
			}
		}
		if res.Allowed {
			t.Fatalf("ban %d: 200 requests at once from a bucket of 100 all allowed", ban)
		}
		want := ban + second
		if res.RetryAfter > want || res.RetryAfter < want-second/10 {
			t.Errorf("ban %d s: Retry-After %d µs, want about %d: the request's own wait", ban/second, res.RetryAfter, want)
		}
		clock.advance(time.Duration(bucket.CeilDiv(res.RetryAfter, 1_000_000)) * time.Second)
		if again, _ := node.take(bg, []byte("k"), oneLimit(l), 1, nil); !again.Allowed {
			t.Errorf("ban %d s: at Retry-After: %+v, want allowed", ban/second, again)
		}
		tableSync(node)
		node.close()
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

// A lease table under eviction pressure never refuses a request that the
// shared bucket covers: a request whose entry was evicted while it waited
// on a call starts again on a new one. It used to be refused, with
// Retry-After 1.
func TestEvictedWaiterIsNotRefused(t *testing.T) {
	t.Parallel()
	m := newSharedModel(monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1 << 20, Interval: 1}}
	node := newLeaseTable(m, m.now, LeaseSize{percent: 10}, time.Second, time.Second, leaseShards, nopLogger)
	defer node.close()
	done := make(chan int, 8)
	for g := range 8 {
		go func() {
			refused := 0
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range 2000 {
				key := []byte{byte('a' + rng.IntN(26)), byte('a' + rng.IntN(26))}
				if res, err := node.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
					refused++
				}
			}
			done <- refused
		}()
	}
	for range 8 {
		if n := <-done; n > 0 {
			t.Errorf("%d requests refused while every shared bucket held plenty", n)
		}
	}
}

// A table closed by a reload while requests still run through it starts no
// eviction, give-back or lease after close returns (it used to call
// WaitGroup.Add beside Wait and give back on a closed client), and a
// count_status give-back that reaches it goes to the shared bucket.
func TestClosedLeaseTableStartsNothingAndPassesGiveBacksOn(t *testing.T) {
	t.Parallel()
	m := newSharedModel(monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1 << 20, Interval: 1}}
	rounds := 20
	if testing.Short() {
		rounds = 4
	}
	for range rounds {
		node := newLeaseTable(m, m.now, LeaseSize{percent: 10}, time.Second, time.Second, leaseShards, nopLogger)
		var takes atomic.Int64
		stop := make(chan struct{})
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				node.take(bg, []byte{byte(i), byte(i >> 8)}, oneLimit(l), 1, nil)
				takes.Add(1)
			}
		}()
		redistest.WaitFor(t, 5*time.Second, "requests through the table", func() bool { return takes.Load() > 100 })
		node.close()
		m.mu.Lock()
		calls := m.calls
		m.mu.Unlock()
		closedAt := takes.Load()
		redistest.WaitFor(t, 5*time.Second, "requests after close", func() bool { return takes.Load() > closedAt+100 })
		close(stop)
		<-finished
		m.mu.Lock()
		after := m.calls
		m.mu.Unlock()
		if after != calls {
			t.Fatalf("%d lease calls after close returned", after-calls)
		}
		if rest := node.giveBackHeld([]byte{0, 0}, 3); rest != 3 {
			t.Fatalf("a give-back to a closed table kept %d of 3, want none: they go to the shared bucket", 3-rest)
		}
	}
}
