package redisbucket

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"

	"go.uber.org/zap"
)

// Spending the leases of a bucket that is never short: one node's first
// lease is the cost, then they double up to the lease size, so a steady
// client costs about one call per lease, and every request is allowed.
func TestLeasesDoubleUpToTheLeaseSize(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 1000, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}
	node := newModelTable(m, LeaseSize{percent: 10}, time.Second)
	defer node.close()
	var sizes []int64
	for i := range 300 {
		res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d: %+v, %v; want allowed", i, res, err)
		}
		e := node.shard([]byte("k")).m["k"]
		if len(sizes) == 0 || sizes[len(sizes)-1] != e.size {
			sizes = append(sizes, e.size)
		}
		clock.advance(time.Millisecond)
	}
	if got := fmt.Sprint(sizes); got != "[1 2 4 8 16 32 64 100]" {
		t.Errorf("lease sizes %s, want [1 2 4 8 16 32 64 100]", got)
	}
	if m.calls > 300/2 {
		t.Errorf("%d calls for 300 requests, want at most half", m.calls)
	}
	t.Logf("300 requests, %d lease calls", m.calls)
}

// A decision that the tokens held cover makes no allocation and no call:
// the key is built on the stack and looked up without a copy.
// Serial: AllocsPerRun counts every goroutine's allocations.
func TestLeasedDecisionDoesNotAllocate(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: "1000000"})
	l := bucket.Limit{Capacity: 1 << 40, Rate: bucket.Rate{Tokens: 1, Interval: 1}}
	// A tier of two limits and a quota, decided from its lease too.
	ls := []bucket.Limit{l, {Capacity: 1 << 41, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
	qs := []bucket.Quota{{N: 1 << 50, Period: bucket.Month, Loc: time.UTC}}
	// The tiers hold their slices, as a config's do.
	one, tier := oneLimit(l), bucket.Tier{Limits: ls, Quotas: qs}
	var out [3]bucket.Result
	for _, tt := range []struct {
		name string
		take func(b []byte) (bool, error)
	}{
		{"one limit", func(b []byte) (bool, error) { return s.Take(bg, b, one, 1, out[:1]) }},
		{"two limits and a quota", func(b []byte) (bool, error) { return s.Take(bg, b, tier, 1, out[:]) }},
	} {
		b := bucketFor("steady " + tt.name)
		if ok, err := tt.take(b); err != nil || !ok {
			t.Fatalf("%s: first request: %v, %v", tt.name, ok, err)
		}
		s.leases.calls.Wait()
		// Hold a lease as a long-running client would, with no prefetch due.
		key := string(b)
		e := s.leases.shard([]byte(key)).m[key]
		e.tokens, e.size = 1<<30, 1<<30
		calls := srv.Info("commandstats", "cmdstat_evalsha")
		allocs := testing.AllocsPerRun(1000, func() {
			if ok, err := tt.take(b); err != nil || !ok {
				t.Fatalf("%s: %v, %v", tt.name, ok, err)
			}
		})
		if allocs != 0 {
			t.Errorf("%s: %.1f allocations a leased decision, want 0", tt.name, allocs)
		}
		if after := srv.Info("commandstats", "cmdstat_evalsha"); after != calls {
			t.Errorf("%s: leased decisions called Redis: commandstats %q, then %q", tt.name, calls, after)
		}
	}
}

// Two nodes leasing from one real Redis, under a concurrent burst on one
// key with no refill to speak of: every token is spent, held by a node, or
// still in Redis, never two of these, so the nodes admit at most the
// capacity between them; and once both give back, Redis holds every
// token not spent.
func TestLeasingNodesConserveEveryToken(t *testing.T) {
	t.Parallel()
	allowed, _ := conserveTokens(t, 100, 0)
	if allowed > 100 || allowed < 80 {
		t.Errorf("%d allowed of a bucket of 100 over 320 requests, want at most 100 and near it", allowed)
	}
}

// conserveTokens runs 8 clients of 40 requests each through two nodes
// that lease 10% of one bucket of capacity c (refilling a token an hour),
// each allowed request charged up to maxCharge more after it (0: none),
// and checks that no token is made or lost (conserveTier). It returns
// what was allowed and charged.
func conserveTokens(t *testing.T, c, maxCharge int64) (allowed, charged int64) {
	t.Helper()
	return conserveTier(t, bucket.Tier{Limits: []bucket.Limit{{Capacity: c, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}}}, maxCharge)
}

// conserveTier runs 8 clients of 40 requests each through two nodes that
// lease 10% of one bucket of tier tr: a request takes from every limit and
// quota, one of a lone limit as Take does. Each allowed request is charged
// up to maxCharge more after it (0: none). For each limit and quota,
// allowed + charged + held on lease + left in Redis = its size, and again
// once the nodes gave their leases back.
func conserveTier(t *testing.T, tr bucket.Tier, maxCharge int64) (allowed, charged int64) {
	t.Helper()
	srv := redistest.Start(t)
	ls, qs := tr.Limits, tr.Quotas
	lone := len(ls) == 1 && len(qs) == 0
	var nodes [2]*Store
	for i := range nodes {
		nodes[i] = newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: "10%"})
		nodes[i].leases = newLeaseTable(nodes[i], nodes[i].conn.now, LeaseSize{percent: 10}, time.Hour, 5*time.Second, 1000, zap.NewNop())
	}
	b := bucketFor("shared")
	take := func(node *Store) (bool, error) {
		if lone {
			res, err := node.takeLimit(bg, b, ls[0], 1)
			return res.Allowed, err
		}
		return node.takeQuotas(bg, b, ls, qs, 1, make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs)))
	}
	charge := func(node *Store, n int64) error {
		if lone {
			return node.Charge(bg, b, oneLimit(ls[0]), n)
		}
		return node.Charge(bg, b, bucket.Tier{Limits: ls, Quotas: qs}, n)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 25))
			for range 40 {
				node := nodes[g%2]
				ok, err := take(node)
				if err != nil {
					t.Error(err)
					return
				}
				if !ok {
					continue
				}
				var n int64
				if maxCharge > 0 {
					n = rng.Int64N(maxCharge + 1)
					if err := charge(node, n); err != nil {
						t.Error(err)
						return
					}
				}
				mu.Lock()
				allowed++
				charged += n
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	key := string(b)
	held := int64(0)
	for _, n := range nodes {
		n.leases.calls.Wait()
		if e := n.leases.shard([]byte(key)).m[key]; e != nil {
			held += e.tokens
		}
	}
	var sizes []int64
	for _, l := range ls {
		sizes = append(sizes, l.Capacity)
	}
	for _, q := range qs {
		sizes = append(sizes, q.N)
	}
	// A view without leases reads Redis alone: a node's peek counts what
	// it holds too.
	inRedis := NewStore(nodes[0].conn, StoreOptions{})
	left := func() []int64 {
		out, qout := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
		if err := inRedis.peekQuotas(bg, b, ls, qs, out, qout); err != nil {
			t.Fatal(err)
		}
		var l []int64
		for _, r := range append(out, qout...) {
			l = append(l, r.Remaining)
		}
		return l
	}
	for i, x := range left() {
		if got := allowed + charged + held + x; got != sizes[i] {
			t.Errorf("limit or quota %d: allowed %d + charged %d + held %d + in Redis %d = %d, want its size %d", i, allowed, charged, held, x, got, sizes[i])
		}
	}
	for _, n := range nodes {
		n.leases.close()
	}
	for i, x := range left() {
		if got := allowed + charged + x; got != sizes[i] {
			t.Errorf("after both gave back, limit or quota %d: allowed %d + charged %d + in Redis %d = %d, want %d", i, allowed, charged, x, got, sizes[i])
		}
	}
	t.Logf("%d allowed, %d charged, %d held before the give-back", allowed, charged, held)
	return allowed, charged
}

// BenchmarkRedisLeaseTake is BenchmarkRedisTake's serial and parallel
// decisions with lease 10%, over 1,000 returning clients whose limits are
// never hit, beside strict mode in the same run.
func BenchmarkRedisLeaseTake(b *testing.B) {
	srv := redistest.Start(b)
	l := bucket.Limit{Capacity: 1_000_000, Rate: bucket.Rate{Tokens: 1_000_000, Interval: 1_000_000}} // never denies
	// A tier of two limits and a monthly quota, none of which denies.
	ls := []bucket.Limit{l, {Capacity: 10_000_000, Rate: bucket.Rate{Tokens: 10_000_000, Interval: 60_000_000}}}
	qs := []bucket.Quota{{N: 1 << 40, Period: bucket.Month, Loc: time.UTC}}
	var buckets [1000][]byte
	for i := range buckets {
		buckets[i] = bucketFor("client-" + strconv.Itoa(i))
	}
	one, several := oneLimit(l), bucket.Tier{Limits: ls, Quotas: qs}
	for _, lease := range []string{"1", "10%"} {
		s := newTestStore(b, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Lease: lease})
		name := map[string]string{"1": "strict", "10%": "lease-10%"}[lease]
		for _, tier := range []bool{false, true} {
			take := func(key []byte, out []bucket.Result) error {
				if tier {
					_, err := s.Take(bg, key, several, 1, out)
					return err
				}
				_, err := s.Take(bg, key, one, 1, out)
				return err
			}
			shape := map[bool]string{false: "", true: "/tier"}[tier]
			b.Run(name+shape+"/serial", func(b *testing.B) {
				b.ReportAllocs()
				var out [3]bucket.Result
				i := 0
				for b.Loop() {
					if err := take(buckets[i%len(buckets)], out[:]); err != nil {
						b.Fatal(err)
					}
					i++
				}
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			})
			b.Run(name+shape+"/parallel", func(b *testing.B) {
				b.SetParallelism(16)
				b.RunParallel(func(pb *testing.PB) {
					var out [3]bucket.Result
					for i := 0; pb.Next(); i++ {
						if err := take(buckets[i%len(buckets)], out[:]); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			})
		}
	}
}

// BenchmarkRedisLeaseTakeFromHeldTokens is the Go cost of a request the
// lease table decides from the tokens it holds, as in setup (m) of
// bench/run.sh (`rate_limit 100000000 10000000/s`, `lease 10%`): the
// table is warmed until its leases are large, so that nearly no request
// makes or waits on a call. "one-key" is (m)'s one client; "1000-keys"
// spreads the requests over 1,000 buckets.
func BenchmarkRedisLeaseTakeFromHeldTokens(b *testing.B) {
	srv := redistest.Start(b)
	l := bucket.Limit{Capacity: 100_000_000, Rate: bucket.Rate{Tokens: 10_000_000, Interval: 1_000_000}}
	tr := oneLimit(l)
	for _, n := range []int{1, 1000} {
		s := newTestStore(b, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Lease: "10%"})
		keys := make([][]byte, n)
		for i := range keys {
			keys[i] = bucketFor("client-" + strconv.Itoa(i))
		}
		var out [1]bucket.Result
		for start := time.Now(); time.Since(start) < 300*time.Millisecond; {
			for _, k := range keys {
				if _, err := s.Take(bg, k, tr, 1, out[:]); err != nil {
					b.Fatal(err)
				}
			}
		}
		name := map[int]string{1: "one-key", 1000: "1000-keys"}[n]
		b.Run(name+"/serial", func(b *testing.B) {
			b.ReportAllocs()
			var out [1]bucket.Result
			i := 0
			for b.Loop() {
				if _, err := s.Take(bg, keys[i%n], tr, 1, out[:]); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
		b.Run(name+"/parallel", func(b *testing.B) {
			b.SetParallelism(16)
			b.RunParallel(func(pb *testing.PB) {
				var out [1]bucket.Result
				for i := 0; pb.Next(); i++ {
					if _, err := s.Take(bg, keys[i%n], tr, 1, out[:]); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// An oversubscribed fleet (docs/fleet.md) on the model, with a simulated clock: 4
// nodes share a key at 8x its rate for 4 s (capacity 200, 50/s, lease
// 10%). The fleet admits at most C + r*T and at least 0.9 of it, with
// about one call per lease's worth of refill per node.
func TestOversubscribedFleetAdmitsNearTheBoundWithFewCalls(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	start := clock.now()
	m := newSharedModel(clock.now)
	l := bucket.Limit{Capacity: 200, Rate: bucket.Rate{Tokens: 50, Interval: 1_000_000}}
	const nodes, seconds, perSecond = 4, 4, 400 // 8x the rate
	var fleet [nodes]*leaseTable
	for i := range fleet {
		fleet[i] = newModelTable(m, LeaseSize{percent: 10}, time.Second)
		defer fleet[i].close()
	}
	admitted := int64(0)
	step := time.Second / perSecond
	for i := range seconds * perSecond {
		node := fleet[i%nodes]
		res, err := node.take(bg, []byte("shared"), oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			admitted++
		}
		clock.advance(step)
	}
	bound := l.Capacity + (clock.now()-start)*l.Rate.Tokens/l.Rate.Interval
	if admitted > bound || admitted*10 < bound*9 {
		t.Errorf("%d admitted, want at most the bound %d and at least 0.9 of it", admitted, bound)
	}
	if most := 2*nodes*admitted/20 + 10*nodes; int64(m.calls) > most {
		t.Errorf("%d lease calls, want at most %d", m.calls, most)
	}
	t.Logf("%d of %d admitted (bound %d), %d lease calls", admitted, seconds*perSecond, bound, m.calls)
}

// Requests that wait on a lease call the tokens of which others spent
// first (a node's first leases are small) are not refused while the shared
// bucket still holds tokens: they ask again, as strict mode would allow
// them. Only a short lease, which leaves the shared bucket empty, refuses
// the requests it did not cover.
func TestRequestsWaitingOnASmallLeaseAreNotRefused(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	m.gate = make(chan struct{})
	l := bucket.Limit{Capacity: 200, Rate: bucket.Rate{Tokens: 50, Interval: 1_000_000}}
	node := newModelTable(m, LeaseSize{percent: 10}, time.Second)
	defer node.close()
	const waiting = 5
	results := make(chan bucket.Result, waiting)
	for range waiting {
		go func() {
			res, _ := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
			results <- res
		}()
	}
	// Let every request reach the one call in flight, then answer it.
	redistest.WaitFor(t, 5*time.Second, "the requests to wait on one call", func() bool {
		sh := node.shard([]byte("k"))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m["k"]
		return e != nil && e.call != nil && e.call.joined == waiting-1
	})
	close(m.gate)
	for range waiting {
		if res := <-results; !res.Allowed {
			t.Errorf("a request was refused (%+v) while the shared bucket held %d tokens", res, l.Capacity-waiting)
		}
	}
}

// quotaTier is a tier whose limit never binds, and a daily quota of n in
// UTC: what a request is refused by is the quota.
func quotaTier(n int64, ban int64) bucket.Tier {
	return bucket.Tier{
		Limits: []bucket.Limit{{Capacity: 1000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}, Ban: ban}},
		Quotas: []bucket.Quota{{N: n, Period: bucket.Day, Loc: time.UTC}},
	}
}

// spendQuota takes requests of cost 1 on node until the quota refuses
// one, 1 ms apart, and returns how many it admitted and the refusal.
func spendQuota(t *testing.T, node *leaseTable, clock *fakeClock, tr bucket.Tier) (int64, bucket.Result) {
	t.Helper()
	var admitted int64
	for range 10_000 {
		res, err := node.take(bg, []byte("k"), tr, 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Allowed {
			return admitted, res
		}
		admitted++
		clock.advance(time.Millisecond)
	}
	t.Fatal("the quota never refused")
	return 0, bucket.Result{}
}

// A quota used up by leases refuses until its period ends, not past it:
// the hold-off after the last lease, granted in part, once ran to the end
// of the day plus up to half of it again, so that a day's quota used up at
// noon refused until about 06:00 the next day. Regression test for issue
// 30 (item 1).
func TestAQuotaUsedUpByLeasesAdmitsAgainWhenItsPeriodEnds(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	tr := quotaTier(40, 0)
	_, midnight := tr.Quotas[0].Bounds(1_000_000)
	clock.micros.Store(midnight - 12*3600*second) // noon
	m := newSharedModel(clock.now)
	node := newModelTable(m, LeaseSize{tokens: 20}, time.Second)
	defer node.close()
	node.jitter = func(n int64) int64 { return n - 1 } // the longest jitter
	admitted, refused := spendQuota(t, node, clock, tr)
	if admitted != 40 {
		t.Fatalf("admitted %d of a quota of 40", admitted)
	}
	if want := midnight - clock.now(); refused.RetryAfter < want {
		t.Errorf("Retry-After %d µs, want the %d µs to midnight", refused.RetryAfter, want)
	}
	clock.micros.Store(midnight + 1000)
	if res, err := node.take(bg, []byte("k"), tr, 1, nil); err != nil || !res.Allowed {
		t.Errorf("just after midnight: %+v, %v; want allowed by the new day's quota", res, err)
	}
}

// A ban voids the tokens out on lease; what a node did not spend of them
// goes back to the quotas, whether the node learns of the ban from its
// next lease call or gives them back first: a quota counts what was
// admitted. Regression test for issue 30 (item 7).
func TestAQuotaCountsWhatWasAdmittedWhenABanVoidsLeases(t *testing.T) {
	t.Parallel()
	for _, learn := range []string{"lease call", "give-back"} {
		t.Run(learn, func(t *testing.T) {
			clock := new(fakeClock)
			q := bucket.Quota{N: 1000, Period: bucket.Day, Loc: time.UTC}
			_, midnight := q.Bounds(1_000_000)
			clock.micros.Store(midnight - 3600*second)
			m := newSharedModel(clock.now)
			l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 600 * second}
			tr := bucket.Tier{Limits: []bucket.Limit{l}, Quotas: []bucket.Quota{q}}
			a := newModelTable(m, LeaseSize{tokens: 20}, time.Second)
			b := newModelTable(m, LeaseSize{tokens: 20}, time.Second)
			defer a.close()
			defer b.close()
			key := []byte("k")
			admitted := int64(0)
			take := func(node *leaseTable) bucket.Result {
				res, err := node.take(bg, key, tr, 1, nil)
				tableSync(node)
				if err != nil {
					t.Fatal(err)
				}
				if res.Allowed {
					admitted++
				}
				return res
			}
			for range 4 {
				take(a) // leases of 1, 2 and 4 tokens: 3 held
			}
			if a.snapshot([]byte("k")).tokens == 0 {
				t.Fatal("node a holds nothing")
			}
			// Node b spends the shared level; then a request of b's that the
			// level and a's tokens together cannot cover starts the ban,
			// voiding a's lease.
			for range 100 {
				if res := take(b); !res.Allowed {
					break
				}
			}
			if res, _ := b.take(bg, key, tr, 5, nil); !res.Banned {
				t.Fatalf("a request of 5 with 3 tokens out and the level empty: %+v, want the ban started", res)
			}
			tableSync(b)
			if !m.states["k"].Banned(clock.now()) {
				t.Fatal("no ban started")
			}
			switch learn {
			case "lease call":
				clock.advance(time.Millisecond)
				a.take(bg, key, tr, 5, nil) // more than a holds: a call
			case "give-back":
				clock.advance(time.Second)
				a.giveBackNow(a.sweep(clock.now(), false))
			}
			tableSync(a)
			if a.snapshot([]byte("k")).tokens != 0 {
				t.Fatalf("node a still holds %d tokens after the ban", a.snapshot([]byte("k")).tokens)
			}
			var qout [1]bucket.Result
			m.mu.Lock()
			m.states["k"].PeekQuotas(clock.now(), []bucket.Quota{q}, qout[:])
			m.mu.Unlock()
			if used := q.N - qout[0].Remaining; used != admitted {
				t.Errorf("the quota counts %d, %d were admitted", used, admitted)
			}
		})
	}
}

// A lease that came back short (the fleet had nearly emptied the shared
// bucket) holds the node's calls off until the bucket holds the next
// lease. Once it does, the bucket is no longer oversubscribed: a request
// that finds the node's tokens spent while the prefetch they set off is in
// flight shares that call, as requests with no leased tokens do, and is
// refused only when the call does not cover it. It is not refused at once
// beside a shared bucket that holds its cost (the "oversubscribed" mark of
// the short lease outlives the hold-off that answered it).
func TestAfterAShortLeasesHoldOffARequestBesideThePrefetchSharesIt(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 10, Interval: 1_000_000}}
	node := newModelTable(m, LeaseSize{tokens: 8}, 5*time.Second)
	defer node.close()
	key := []byte("k")
	take := func() bucket.Result {
		t.Helper()
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		if err != nil {
			t.Fatal(err)
		}
		return res
	}
	if res := take(); !res.Allowed {
		t.Fatalf("the first request: %+v", res)
	}
	tableSync(node)
	sh := node.shard(key)
	sh.mu.Lock()
	sh.m["k"].size = 4 // the node's leases have grown: the next asks for 8
	sh.mu.Unlock()
	// Other nodes leave 5 in the shared bucket: the lease of 8 comes back
	// with 5, short, and the node holds 4 after its request.
	m.mu.Lock()
	var out [1]bucket.Result
	if !m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, 14, out[:]) {
		t.Fatalf("the others' take: %+v", out[0])
	}
	m.mu.Unlock()
	if res := take(); !res.Allowed {
		t.Fatalf("the request that leased: %+v", res)
	}
	tableSync(node)
	// The hold-off (until the bucket holds 8: 800 ms, 1.2 s with jitter)
	// ends; the shared bucket refills.
	clock.advance(1300 * time.Millisecond)
	level := m.level("k", l)
	if level < 8 {
		t.Fatalf("the shared bucket holds %d, want at least 8", level)
	}
	// The node spends its tokens; falling to half they set off a prefetch,
	// which is in flight while the next requests come.
	m.gate = make(chan struct{})
	for i := range 4 {
		if res := take(); !res.Allowed {
			t.Fatalf("request %d, from the 4 tokens held: %+v", i, res)
		}
	}
	fifth := make(chan bucket.Result, 1)
	go func() {
		res, _ := node.take(bg, key, oneLimit(l), 1, nil)
		fifth <- res
	}()
	// It is answered at once, or joins the prefetch.
	redistest.WaitFor(t, 5*time.Second, "the fifth request's answer or its joining the call", func() bool {
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m["k"]
		return len(fifth) > 0 || e != nil && e.call != nil && e.call.joined == 1
	})
	close(m.gate)
	res := <-fifth
	tableSync(node)
	if !res.Allowed {
		t.Errorf("a request beside the prefetch in flight was refused (%+v) while the shared bucket held %d tokens", res, level)
	}
}

// A client spread over two nodes, on a tier of a rate limit and a day's
// quota: one node's leases grow with its traffic until one takes what is
// left of the quota, which it holds, idle, once its traffic stops. The
// quota is not used up: those tokens come back within lease_ttl. A
// request on the other node is admitted, or told to retry once they are
// back (as a limit's tokens held elsewhere answer a refill wait); it is
// not sent away until the day ends, which one bucket would never do.
func TestTheLastOfAQuotaOnAnotherNodesLeaseIsNotRefusedUntilThePeriodEnds(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC).UnixMicro())
	m := newSharedModel(clock.now)
	tr := bucket.Tier{Limits: []bucket.Limit{{Capacity: 1000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}}}, Quotas: []bucket.Quota{{N: 50, Period: bucket.Day, Loc: time.UTC}}}
	ttl := time.Second
	a, b := newModelTable(m, LeaseSize{percent: 50}, ttl), newModelTable(m, LeaseSize{percent: 50}, ttl)
	defer a.close()
	defer b.close()
	admitted := 0
	for range 30 {
		if res, err := a.take(bg, []byte("k"), tr, 1, nil); err == nil && res.Allowed {
			admitted++
		}
		tableSync(a)
		clock.advance(time.Millisecond)
	}
	held := a.snapshot([]byte("k")).tokens
	if held == 0 || admitted != 30 {
		t.Fatalf("node a admitted %d of 30 and holds %d; want all admitted and tokens held", admitted, held)
	}
	res, err := b.take(bg, []byte("k"), tr, 1, nil)
	tableSync(b)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Allowed && res.RetryAfter > (ttl+quotaDenyFor).Microseconds() {
		t.Errorf("%d of the quota's 50 admitted, %d idle on node a's lease: node b's request refused with Retry-After %s, the day's end; one bucket would admit it",
			admitted, held, time.Duration(res.RetryAfter)*time.Microsecond)
	}
}

// With a lease, a peek reports each limit's remaining as a take does (the
// X-RateLimit-Remaining of the next request): the shared level and the
// tokens this node holds, which it may spend without Redis. Held says how
// many those are, none once lease_ttl has passed.
func TestAPeekWithALeaseCountsTheTokensThisNodeHolds(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Lease: "5", Timeout: 2 * time.Second})
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	s.leases.now = clock.now
	tr := bucket.Tier{Limits: []bucket.Limit{slowLimit(10), slowLimit(100)}}
	key := bucketFor("holder")
	took := make([]bucket.Result, 2)
	for i := range 3 {
		if ok, err := s.Take(bg, key, tr, 1, took); err != nil || !ok {
			t.Fatalf("take %d: %v, %v", i, ok, err)
		}
		tableSync(s.leases)
	}
	held := s.Held(key)
	if held == 0 {
		t.Fatal("no token held after three takes on a lease of 5")
	}
	peeked := make([]bucket.Result, 2)
	if err := s.Peek(bg, key, tr, peeked); err != nil {
		t.Fatal(err)
	}
	for i := range peeked {
		if peeked[i].Remaining != took[i].Remaining {
			t.Errorf("limit %d: the peek reports %d remaining, the last take %d; want the same (%d of them held here)", i, peeked[i].Remaining, took[i].Remaining, held)
		}
	}
	clock.advance(time.Second)
	if got := s.Held(key); got != 0 {
		t.Errorf("after lease_ttl, %d tokens are held to spend; want none", got)
	}
}

// A request refused from memory during a node's hold-off is told a
// Retry-After rounded up from its own time, which can end before the
// hold-off does: when the client retries then and the shared bucket holds
// its token, the node does not refuse it again without asking.
func TestARetryAtRetryAfterIsNotRefusedFromMemory(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
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

// A request whose entry is evicted while it waits on a short call (2 of the
// 8 asked for granted, 1 spent by the request that made it, 1 left for the
// waiter) is not refused: the entry's token goes back to the shared bucket
// and the waiter takes it there. Another client's request on the same node
// evicts the entry (a full shard) after the call returns and before the
// waiter looks again; it is made to come first by holding the shard's lock
// while the call's answer is applied (the hold-off's jitter runs under it).
// A scheduling that lets the waiter in first can only make the test pass.
func TestAWaiterOfAShortCallIsNotRefusedWhenItsEntryIsEvicted(t *testing.T) {
	t.Parallel()
	for attempt := range 5 {
		m := newSharedModel(monotonicMicros)
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

// With leases, a request the lease does not cover is not refused from
// memory when the node's hold-off (until the shared bucket covers a whole
// lease, plus jitter) is longer than max_wait: when the shared bucket's
// retry time for its own cost is within max_wait, it takes its tokens
// there, waiting, as strict mode does.
func TestLeasesLetWaitWhatStrictModeLetsWaitThroughAHoldOff(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	// capacity 10, 10/s, max_wait 200 ms; leases of 50% (5 tokens).
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 200_000}
	ls := []bucket.Limit{l}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	key := []byte("holdoff")
	strict := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	for i := range 60 {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		var out [1]bucket.Result
		strict.Take(clock.now(), ls, 1, out[:])
		one := out[0]
		if res.Allowed != one.Allowed {
			e := node.shard(key).m[string(key)]
			t.Fatalf("request %d at %d ms: leases %+v, strict mode %+v (node holds %d, hold-off %d µs more, shared level %d)", i, (clock.now()-1_000_000)/1000, res, one, e.tokens, e.holdUntil-clock.now(), m.level(string(key), l))
		}
		if !res.Allowed {
			// Strict refuses too: keep the histories the same.
			clock.advance(10 * time.Millisecond)
			continue
		}
		clock.advance(10 * time.Millisecond)
	}
}

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

// With leases, a ban and max_wait, the refusal that starts the ban says
// retry when the request fits within max_wait once the ban is over, as
// strict mode does (docs/max-wait.md), not when the shared bucket holds
// its cost, a whole cost's refill later: a retry then is admitted,
// waiting, and one a microsecond earlier is refused.
func TestALeasedRefusalThatStartsABanWithMaxWaitSaysWhenTheRetryFits(t *testing.T) {
	t.Parallel()
	// Capacity 1, one token every 10 s, ban 60 s, max_wait 30 s.
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 10 * second}, Ban: 60 * second, MaxWait: 30 * second}
	for _, size := range []LeaseSize{{tokens: 1}, {tokens: 4}} {
		clock, m := newModelStore()
		node := newModelTable(m, size, time.Minute)
		strict := &buckettest.Shared{Levels: make([]bucket.State, 1)}
		key := []byte("k")
		take := func() (bucket.Result, bucket.Result) {
			t.Helper()
			res, err := node.take(bg, key, oneLimit(l), 1, nil)
			tableSync(node)
			if err != nil {
				t.Fatal(err)
			}
			var out [1]bucket.Result
			strict.Take(clock.now(), []bucket.Limit{l}, 1, out[:])
			return res, out[0]
		}
		// The token, then 3 that wait (10, 20, 30 s); the 5th would wait
		// 40 s: refused, and the ban starts.
		for i := range 4 {
			if res, _ := take(); !res.Allowed {
				t.Fatalf("lease %+v: request %d refused: %+v", size, i, res)
			}
		}
		res, want := take()
		if res.Allowed || !res.Banned || !want.Banned {
			t.Fatalf("lease %+v: the 5th: %+v (strict %+v), want refused, starting a ban", size, res, want)
		}
		if res.RetryAfter != want.RetryAfter {
			t.Errorf("lease %+v: the refusal that starts the ban says retry after %d µs, strict mode %d µs", size, res.RetryAfter, want.RetryAfter)
		}
		// A retry a microsecond before strict mode's retry time is
		// refused; one at it is admitted, waiting for its token.
		clock.advance(time.Duration(want.RetryAfter-1) * time.Microsecond)
		if early, _ := take(); early.Allowed {
			t.Fatalf("lease %+v: a retry a microsecond early: %+v, want refused", size, early)
		}
		clock.advance(time.Microsecond)
		if again, _ := take(); !again.Allowed || again.Wait == 0 {
			t.Fatalf("lease %+v: a retry at strict mode's retry time: %+v, want allowed, waiting", size, again)
		}
		node.close()
	}
}

// On random limits with a ban and max_wait, and leases of random sizes, a
// leasing node's refusals during a ban, the one that starts it first, say
// retry when strict mode would on the shared bucket as it then stands: when
// the request would go on within max_wait once the ban is over.
func TestLeasedRefusalsUnderABanWithMaxWaitSayStrictModesRetry(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(41, 0x1ea5e))
	bans := 0
	for c := range 300 {
		rate, err := bucket.ParseRate(buckettest.TraceRates[rng.IntN(len(buckettest.TraceRates))])
		if err != nil {
			t.Fatal(err)
		}
		l := bucket.Limit{Capacity: 1 + rng.Int64N(20), Rate: rate}
		full := bucket.CeilDiv(l.Units(), rate.Tokens)
		l.Ban, l.MaxWait = 1+rng.Int64N(5*full+1), 1+rng.Int64N(2*full+1)
		if err := l.Validate(1); err != nil {
			t.Fatal(err)
		}
		clock, m := newModelStore()
		node := newModelTable(m, LeaseSize{tokens: 1 + rng.Int64N(l.Capacity)}, time.Minute)
		key := []byte("k")
		banned := false
		for step := 0; step < 4*int(l.Capacity)+40; step++ {
			res, err := node.take(bg, key, oneLimit(l), 1, nil)
			tableSync(node)
			if err != nil {
				t.Fatal(err)
			}
			banned = banned || res.Banned
			if !res.Allowed && banned {
				m.mu.Lock()
				sh := m.bucket(string(key), 1)
				strict := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
				var out [1]bucket.Result
				strict.Take(clock.now(), []bucket.Limit{l}, 1, out[:])
				m.mu.Unlock()
				if res.RetryAfter != out[0].RetryAfter {
					t.Fatalf("case %d step %d, %+v: leased refusal %+v, strict mode's on the shared bucket %+v", c, step, l, res, out[0])
				}
				if res.Banned {
					bans++
				}
			}
			clock.advance(time.Duration(rng.Int64N(full/4+1)) * time.Microsecond)
		}
		node.close()
	}
	if bans < 100 {
		t.Fatalf("only %d bans started of 300 cases", bans)
	}
}

// Against a real redis-server: the refusal that starts a ban on a tier with
// max_wait says the same Retry-After with leases as in strict mode: the
// ban's length here (the request fits within max_wait as the ban ends,
// long before the cost is back), counted from the ban's start in Redis;
// a leasing node counts from when its call was sent, so its figure may be
// short by the call's round trip.
func TestARedisBanWithMaxWaitSaysTheSameRetryWithLeasesAsStrict(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	// Capacity 4, one token every 10 s, ban 60 s, max_wait 30 s: after
	// the ban, the bucket is full 40 s later, and a request's token is
	// due 30 s after the ban, within max_wait.
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 10 * second}, Ban: 60 * second, MaxWait: 30 * second}
	for _, lease := range []string{"", "2"} {
		s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: lease})
		if leased := s.Leasing(oneLimit(l), 1); leased != (lease != "") {
			t.Fatalf("lease %q: decided from leases: %v", lease, leased)
		}
		key := bucketFor("ban with max_wait, lease " + lease)
		var res bucket.Result
		for range 20 {
			var err error
			if res, err = s.takeLimit(bg, key, l, 1); err != nil {
				t.Fatal(err)
			}
			if !res.Allowed {
				break
			}
		}
		if res.Allowed || !res.Banned {
			t.Fatalf("lease %q: 20 requests at once: the last %+v; want one refused, starting a ban", lease, res)
		}
		if res.RetryAfter > l.Ban || res.RetryAfter < l.Ban-second/10 {
			t.Errorf("lease %q: the refusal that starts the ban says retry after %d µs, want the ban's %d µs", lease, res.RetryAfter, l.Ban)
		}
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

// A request the lease refuses for its rate limit tells each quota's
// remaining as strict mode does: what the period has left, not the
// tokens this node holds. A quota with room left is not said used up
// until its period ends.
func TestARequestRefusedWithLeasesReportsEachQuotaAsStrictModeDoes(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	q, err := bucket.ParseQuota("12/day", time.UTC)
	if err != nil {
		t.Fatal(err)
	}
	tr := bucket.Tier{Limits: []bucket.Limit{slowLimit(10)}, Quotas: []bucket.Quota{q}}
	refused := map[string]bucket.Result{}
	for _, lease := range []string{"", "2"} {
		s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: lease})
		key := bucketFor("quota beside a limit, lease " + lease)
		for i := range 11 {
			out := make([]bucket.Result, tr.Parts())
			allowed, err := s.Take(bg, key, tr, 1, out)
			if err != nil {
				t.Fatal(err)
			}
			if allowed != (i < 10) {
				t.Fatalf("lease %q, request %d: allowed %v; want the 10 of the limit, then refused", lease, i+1, allowed)
			}
			if !allowed {
				refused[lease] = out[1]
			}
		}
	}
	if strict, leased := refused[""], refused["2"]; strict.Remaining != 2 || leased.Remaining != strict.Remaining {
		t.Errorf("the refused request's quota: %d left with leases, %d in strict mode; want 2 in both (12 a day, 10 taken)", leased.Remaining, strict.Remaining)
	}
}

// A request the lease refuses names the same binding limit or quota as
// strict mode does: the one used up, not one with room left, whose
// remaining the X-RateLimit fields would show on a refusal.
func TestARequestRefusedWithLeasesBindsWhatRefusedIt(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	q, err := bucket.ParseQuota("3/day", time.UTC)
	if err != nil {
		t.Fatal(err)
	}
	tr := bucket.Tier{Limits: []bucket.Limit{slowLimit(10)}, Quotas: []bucket.Quota{q}}
	for _, lease := range []string{"", "2"} {
		s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: lease})
		key := bucketFor("quota used up, lease " + lease)
		for i := range 4 {
			out := make([]bucket.Result, tr.Parts())
			allowed, err := s.Take(bg, key, tr, 1, out)
			if err != nil {
				t.Fatal(err)
			}
			if allowed != (i < 3) {
				t.Fatalf("lease %q, request %d: allowed %v; want the 3 of the quota, then refused", lease, i+1, allowed)
			}
			if allowed {
				continue
			}
			if j := bucket.Binding(out, false); j != 1 || out[j].Remaining != 0 || out[j].RetryAfter <= 0 {
				t.Errorf("lease %q: the refusal binds part %d, %+v of %+v; want the quota (1), used up, with a retry", lease, j, out[j], out)
			}
		}
	}
}

// With leases, a ban and max_wait, a refusal during the ban says retry when
// a request of its cost goes on within max_wait on the shared bucket, even
// while another node's record, which the ban voided, still holds its
// tokens out: the level refills no higher than the capacity less them
// until the record goes (buckettest.Shared's settle), so a request whose
// cost needs them waits for that too. A retry at the answer is admitted,
// one a microsecond earlier is not, in strict mode and with leases.
func TestABanRetryWithMaxWaitCountsTheTokensOutOnLease(t *testing.T) {
	t.Parallel()
	// Capacity 4, one token every 10 s, ban 20 s, max_wait 30 s; records
	// live 10 min.
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 10 * second}, Ban: 20 * second, MaxWait: 30 * second}
	ls := []bucket.Limit{l}
	hold := 600 * second
	sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	// Node a holds 2 tokens (half the capacity); node b's response is
	// charged 20 more; its request of cost 3 is refused and bans.
	if g := sh.Lease(0, ls, bucket.LeaseAsk{Node: "a", Seq: 1, Cost: 1, Want: 2, Hold: hold}); g.Granted != 2 {
		t.Fatalf("node a's lease: %+v, want 2 tokens", g)
	}
	sh.Charge(0, ls, 20)
	const cost = 3
	refused := sh.Lease(0, ls, bucket.LeaseAsk{Node: "b", Seq: 1, Cost: cost, Want: cost, Spend: cost, Hold: hold})
	if refused.Granted != 0 || !refused.Banned || sh.Out() != 2 {
		t.Fatalf("node b's lease of %d: %+v, %d out; want refused, starting a ban, 2 tokens still out", cost, refused, sh.Out())
	}
	var out [1]bucket.Result
	strict := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
	strict.Take(0, ls, cost, out[:])
	if refused.RetryAfter != out[0].RetryAfter {
		t.Errorf("the leased refusal says retry after %d µs, strict mode %d µs", refused.RetryAfter, out[0].RetryAfter)
	}
	for _, retry := range []int64{refused.RetryAfter, out[0].RetryAfter} {
		at := func(when int64) bucket.Result {
			c := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
			var r [1]bucket.Result
			c.Take(when, ls, cost, r[:])
			return r[0]
		}
		if r := at(retry); !r.Allowed {
			t.Errorf("a retry at the answer, %d µs: %+v, want admitted", retry, r)
		}
		if r := at(retry - 1); r.Allowed {
			t.Errorf("a retry a microsecond before the answer, %d µs: %+v, want refused", retry, r)
		}
	}
}

// On random tiers of 1 to 3 limits with a ban and max_wait (huge figures
// too), with nodes holding tokens on lease, charges, strict takes,
// give-backs and reloads of the ban and max_wait: every refusal while a ban holds, by a lease call or a strict
// take, says retry at the first moment a strict take on the shared bucket
// is admitted, as it then stands (records out included): one then is,
// one a microsecond earlier is not, and never before the ban ends. A lease
// call says strict mode's retry.
func TestEveryRefusalUnderABanWithMaxWaitSaysTheFirstMomentARetryIsAdmitted(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(41, 0xba9))
	nodes := []string{"a", "b", "c"}
	checked, held := 0, 0
	for c := range 600 {
		ls := make([]bucket.Limit, 1+rng.IntN(3))
		for i := range ls {
			ls[i] = modelLimit(rng)
		}
		full := refillOf(ls[0])
		ls = modelValid(ls, 1+rng.Int64N(3*full+1), 1+rng.Int64N(2*full+1))
		if ls[0].MaxWait == 0 {
			continue // a capacity of 2^52 units leaves max_wait no room
		}
		minCap := ls[0].Capacity
		for _, l := range ls {
			minCap = min(minCap, l.Capacity)
		}
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		var now int64
		seq := map[string]int64{}
		// check holds a refusal at now, retry after retry, to the property.
		check := func(what string, cost, retry int64) {
			t.Helper()
			if !sh.Banned(now) {
				return
			}
			at := func(when int64) bool {
				cl := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
				out := make([]bucket.Result, len(ls))
				return cl.Take(when, ls, cost, out)
			}
			var end int64
			for i, l := range ls {
				if s := sh.Levels[i]; s.Banned && s.Overdrawn(now, l) {
					end = max(end, s.FullAt-(l.Units()+s.Slack)/l.Rate.Tokens)
				}
			}
			if !at(now+retry) || at(now+retry-1) || now+retry < end {
				t.Fatalf("case %d, %s of %d at %d, limits %+v, %d out on lease: retry after %d µs (the ban ends at %d); a take then admitted %v, a µs before %v",
					c, what, cost, now, ls, sh.Out(), retry, end, at(now+retry), at(now+retry-1))
			}
			checked++
			if sh.Out() > 0 {
				held++
			}
		}
		for range 30 {
			now += rng.Int64N(full/2 + 1)
			cost := 1 + rng.Int64N(minCap)
			if rng.IntN(2) == 0 {
				cost = 1 + rng.Int64N(min(minCap, 3))
			}
			switch rng.IntN(7) {
			case 6:
				// A reload sets another ban and max_wait, mid-ban or not.
				if next := modelValid(slices.Clone(ls), 1+rng.Int64N(3*full+1), 1+rng.Int64N(2*full+1)); next[0].MaxWait > 0 {
					ls = next
				}
			case 0, 1:
				node := nodes[rng.IntN(len(nodes))]
				seq[node]++
				a := bucket.LeaseAsk{Node: node, Seq: seq[node], Cost: cost, Want: cost + rng.Int64N(minCap), Hold: 1 + rng.Int64N(4*full+1)}
				if rng.IntN(2) == 0 {
					a.Spend = cost
				}
				lr := sh.Lease(now, ls, a)
				if lr.Granted == 0 && lr.BanHolds {
					cl := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
					out := make([]bucket.Result, len(ls))
					cl.Take(now, ls, cost, out)
					if r := out[bucket.Binding(out, false)]; r.RetryAfter != lr.RetryAfter {
						t.Fatalf("case %d: a refused lease of %d at %d, limits %+v: retry after %d µs, strict mode %+v", c, cost, now, ls, lr.RetryAfter, out)
					}
					check("a lease", cost, lr.RetryAfter)
				}
			case 2, 3:
				out := make([]bucket.Result, len(ls))
				if !sh.Take(now, ls, cost, out) {
					check("a take", cost, out[bucket.Binding(out, false)].RetryAfter)
				}
			case 4:
				sh.Charge(now, ls, rng.Int64N(3*minCap+1))
			case 5:
				node := nodes[rng.IntN(len(nodes))]
				sh.Return(now, ls, node, seq[node], 1+rng.Int64N(minCap))
			}
		}
	}
	if checked < 300 || held < 100 {
		t.Fatalf("only %d refusals under a ban checked, %d with tokens out on lease", checked, held)
	}
	t.Logf("%d refusals under a ban checked, %d with tokens out on lease", checked, held)
}

// Three leasing nodes on one bucket, with a ban and max_wait (longer than
// the ban, or shorter), a tier of one or two limits, random lease sizes
// and costs: whichever node's refusal started the ban, every request a
// node refuses while the ban holds, the first on each node and those its
// table refuses after it, says retry when a strict take on the shared
// bucket, as it then stands, is admitted (one a microsecond earlier is
// not), and no node's hold-off (banUntil) ends before the ban does.
func TestEveryNodesRefusalsUnderAnotherNodesBanWithMaxWaitSayWhenARetryIsAdmitted(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(41, 0x3e0de53))
	checked, others := 0, 0
	for c := range 200 {
		rate, err := bucket.ParseRate(buckettest.TraceRates[rng.IntN(len(buckettest.TraceRates))])
		if err != nil {
			t.Fatal(err)
		}
		first := bucket.Limit{Capacity: 2 + rng.Int64N(12), Rate: rate}
		full := bucket.CeilDiv(first.Units(), rate.Tokens)
		ls := []bucket.Limit{first}
		if rng.IntN(2) == 0 {
			// A second limit, which refills faster or slower.
			ls = append(ls, bucket.Limit{Capacity: 1 + rng.Int64N(2*first.Capacity), Rate: bucket.Rate{Tokens: rate.Tokens * (1 + rng.Int64N(3)), Interval: rate.Interval * (1 + rng.Int64N(3))}})
		}
		ls = modelValid(ls, 1+rng.Int64N(3*full+1), 1+rng.Int64N(3*full+1))
		tr := bucket.Tier{Limits: ls}
		minCap := min(ls[0].Capacity, ls[len(ls)-1].Capacity)
		clock, m := newModelStore()
		var nodes []*leaseTable
		for range 3 {
			nodes = append(nodes, newModelTable(m, LeaseSize{tokens: 1 + rng.Int64N(minCap)}, time.Duration(1+rng.Int64N(2*full))*time.Microsecond))
		}
		key := []byte("k")
		starter := -1
		for step := 0; step < 12*int(minCap)+40; step++ {
			i := rng.IntN(len(nodes))
			cost := int64(1)
			if rng.IntN(3) == 0 {
				cost = 1 + rng.Int64N(minCap)
			}
			before := banUntilOf(nodes, key)
			res, err := nodes[i].take(bg, key, tr, cost, make([]bucket.Result, len(ls)))
			for _, n := range nodes {
				tableSync(n)
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Banned {
				starter = i
			}
			now := clock.now()
			m.mu.Lock()
			sh := m.bucket(string(key), len(ls))
			var end int64
			for j, l := range ls {
				if s := sh.Levels[j]; s.Banned && s.Overdrawn(now, l) {
					end = max(end, s.FullAt-(l.Units()+s.Slack)/l.Rate.Tokens)
				}
			}
			at := func(when int64) bool {
				cl := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held)}
				return cl.Take(when, ls, cost, make([]bucket.Result, len(ls)))
			}
			if !res.Allowed && end > now {
				if !at(now+res.RetryAfter) || at(now+res.RetryAfter-1) || now+res.RetryAfter < end {
					t.Fatalf("case %d step %d: node %d (the ban's starter: node %d) refused %d at %d, limits %+v, %d out: %+v (the ban ends at %d); a take then admitted %v, a µs before %v",
						c, step, i, starter, cost, now, ls, sh.Out(), res, end, at(now+res.RetryAfter), at(now+res.RetryAfter-1))
				}
				checked++
				if i != starter {
					others++
				}
			}
			m.mu.Unlock()
			// A call that found the ban holds its node off until it ends
			// at least.
			for j, u := range banUntilOf(nodes, key) {
				if u != before[j] && u > 0 && u < end {
					t.Fatalf("case %d step %d: node %d's call found a ban ending at %d; it holds off until %d", c, step, j, end, u)
				}
			}
			clock.advance(time.Duration(rng.Int64N(full/3+1)) * time.Microsecond)
		}
		for _, n := range nodes {
			n.close()
		}
	}
	if checked < 500 || others < 200 {
		t.Fatalf("only %d refusals under a ban checked, %d on a node that did not start it", checked, others)
	}
	t.Logf("%d refusals under a ban checked, %d on a node that did not start it", checked, others)
}

// banUntilOf is each node's banUntil for key, 0 for none.
func banUntilOf(nodes []*leaseTable, key []byte) []int64 {
	out := make([]int64, len(nodes))
	for j, n := range nodes {
		sh := n.shard(key)
		sh.mu.Lock()
		if e := sh.m[string(key)]; e != nil {
			out[j] = e.banUntil
		}
		sh.mu.Unlock()
	}
	return out
}
