package ratelimit

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// sharedModel is the shared store as a plain model: bucket.go's Lease and
// GiveBack on one state per key, on an injected clock. It counts its calls.
type sharedModel struct {
	mu     sync.Mutex
	now    func() int64
	states map[string]State
	calls  int
	down   bool
}

func (m *sharedModel) lease(key string, l Limit, cost, want int64) (LeaseResult, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.down {
		return LeaseResult{}, errBreakerOpen
	}
	st, res := Lease(m.states[key], m.now(), l, cost, want)
	m.states[key] = st
	return res, nil
}

func (m *sharedModel) giveBack(back []giveBack) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.down {
		return 0, errBreakerOpen
	}
	var n int64
	for _, g := range back {
		m.states[g.key] = GiveBack(m.states[g.key], m.now(), g.limit, g.tokens)
		n += g.tokens
	}
	return n, nil
}

// newModelTable is a lease table on the model, whose calls finish before
// the test goes on: tableSync waits for them.
func newModelTable(m *sharedModel, size leaseSize, ttl time.Duration) *leaseTable {
	return newLeaseTable(m, m.now, size, ttl, 1000, zap.NewNop())
}

func tableSync(t *leaseTable) { t.calls.Wait() }

// For random interleavings of requests on several nodes, clock steps,
// give-backs of expired leases, reloads (a node's table closed, giving all
// back, and a new one made) and outages of the shared store, the fleet
// never admits more than C + floor(r*T) from a full bucket.
func TestLeasesNeverAdmitMoreThanTheBound(t *testing.T) {
	rng := rand.New(rand.NewPCG(14, 9))
	rounds := 300
	if testing.Short() {
		rounds = 60
	}
	for round := range rounds {
		clock := new(fakeClock)
		clock.micros.Store(1_000_000)
		start := clock.now()
		m := &sharedModel{now: clock.now, states: map[string]State{}}
		rate := Rate{Tokens: 1 + rng.Int64N(20), Interval: 1_000_000}
		l := Limit{Capacity: 1 + rng.Int64N(200), Rate: rate}
		size := leaseSize{percent: []float64{5, 10, 50, 100}[rng.IntN(4)]}
		if rng.IntN(3) == 0 {
			size = leaseSize{tokens: 1 + rng.Int64N(l.Capacity)}
		}
		ttl := time.Duration(50+rng.IntN(2000)) * time.Millisecond
		nodes := make([]*leaseTable, 2+rng.IntN(4))
		for i := range nodes {
			nodes[i] = newModelTable(m, size, ttl)
		}
		key := []byte("bucket")
		var admitted int64
		for step := range 2000 {
			switch op := rng.IntN(100); {
			case op < 70:
				node := nodes[rng.IntN(len(nodes))]
				cost := 1 + rng.Int64N(min(3, l.Capacity))
				res, err := node.take(bg, key, l, cost)
				tableSync(node)
				if err == nil && res.Allowed {
					admitted += cost
				}
			case op < 88:
				clock.advance(time.Duration(rng.Int64N(int64(ttl))))
			case op < 94:
				node := nodes[rng.IntN(len(nodes))]
				if back := node.sweep(clock.now(), false); len(back) > 0 {
					node.giveBackNow(back)
				}
			case op < 97:
				i := rng.IntN(len(nodes))
				nodes[i].close()
				nodes[i] = newModelTable(m, size, ttl)
			default:
				m.mu.Lock()
				m.down = !m.down
				m.mu.Unlock()
			}
			bound := l.Capacity + (clock.now()-start)*rate.Tokens/rate.Interval
			if admitted > bound {
				t.Fatalf("round %d step %d (limit %+v, lease %+v, ttl %s, %d nodes): %d admitted, more than the bound %d", round, step, l, size, ttl, len(nodes), admitted, bound)
			}
		}
		for _, n := range nodes {
			n.close()
		}
	}
}

// Spending the leases of a bucket that is never short: one node's first
// lease is the cost, then they double up to the lease size, so a steady
// client costs about one call per lease, and every request is allowed.
func TestLeasesDoubleUpToTheLeaseSize(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]State{}}
	l := Limit{Capacity: 1000, Rate: Rate{Tokens: 100, Interval: 1_000_000}}
	node := newModelTable(m, leaseSize{percent: 10}, time.Second)
	defer node.close()
	var sizes []int64
	for i := range 300 {
		res, err := node.take(bg, []byte("k"), l, 1)
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

// A refused or partial lease makes the node wait until the shared bucket
// covers its next lease: meanwhile it answers from memory, with no call.
func TestRefusedLeaseHoldsOffCalls(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]State{}}
	l := Limit{Capacity: 10, Rate: Rate{Tokens: 1, Interval: 1_000_000}} // 1/s
	node := newModelTable(m, leaseSize{tokens: 5}, time.Minute)
	defer node.close()
	key := []byte("k")
	allowed := 0
	for range 40 {
		res, _ := node.take(bg, key, l, 1)
		tableSync(node)
		if res.Allowed {
			allowed++
		}
	}
	if allowed != 10 {
		t.Fatalf("%d allowed from a bucket of 10 with no time passing, want 10", allowed)
	}
	calls := m.calls
	res, _ := node.take(bg, key, l, 1)
	if res.Allowed || res.RetryAfter <= 0 {
		t.Fatalf("after the bucket ran dry: %+v, want denied with a retry time", res)
	}
	if m.calls != calls {
		t.Errorf("a denial within the hold-off made %d calls, want none", m.calls-calls)
	}
	clock.advance(time.Duration(res.RetryAfter) * time.Microsecond)
	if res, _ := node.take(bg, key, l, 1); !res.Allowed {
		t.Errorf("after the hold-off: %+v, want allowed", res)
	}
}

// Tokens leased and unused go back after lease_ttl, and all of them when
// the table closes (a reload or shutdown).
func TestUnusedLeasedTokensGoBack(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]State{}}
	l := Limit{Capacity: 100, Rate: Rate{Tokens: 1, Interval: 3_600_000_000}} // no refill to speak of
	level := func() int64 {
		return Peek(m.states["k"], clock.now(), l).Remaining
	}
	node := newModelTable(m, leaseSize{tokens: 40}, time.Second)
	for range 20 {
		node.take(bg, []byte("k"), l, 1)
		tableSync(node)
	}
	held := node.shard([]byte("k")).m["k"].tokens
	if got := level() + held + 20; got != 100 {
		t.Fatalf("shared %d + held %d + spent 20 = %d, want 100", level(), held, got)
	}
	clock.advance(time.Second)
	if back := node.sweep(clock.now(), false); len(back) != 1 {
		t.Fatalf("sweep after lease_ttl gave back %v", back)
	} else {
		node.giveBackNow(back)
	}
	if level() != 80 {
		t.Errorf("after lease_ttl the shared bucket holds %d, want 80", level())
	}
	node.take(bg, []byte("k"), l, 1)
	tableSync(node)
	node.close()
	if level() != 79 {
		t.Errorf("after close the shared bucket holds %d, want 79", level())
	}
}

func TestLeaseSizes(t *testing.T) {
	for _, tt := range []struct {
		setting  string
		capacity int64
		want     int64
	}{
		{"", 100, 1}, {"1", 100, 1}, {"20", 100, 20}, {"500", 100, 100},
		{"10%", 200, 20}, {"10%", 5, 1}, {"100%", 7, 7}, {"2.5%", 1000, 25},
	} {
		z, err := parseLeaseSize(tt.setting)
		if err != nil {
			t.Fatalf("%q: %v", tt.setting, err)
		}
		if got := z.of(Limit{Capacity: tt.capacity}); got != tt.want {
			t.Errorf("lease %q of capacity %d: %d, want %d", tt.setting, tt.capacity, got, tt.want)
		}
	}
	for _, bad := range []string{"0", "-3", "0%", "101%", "ten", "%"} {
		if _, err := parseLeaseSize(bad); err == nil || !strings.Contains(err.Error(), strconv.Quote(bad)) {
			t.Errorf("lease %q: error %v, want one naming the value", bad, err)
		}
	}
}

// The lease and give-back scripts apply bucket.go's Lease and GiveBack to
// the unit, on random traces against a real redis-server.
func TestRedisLeaseScriptsMatchTheModel(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second)})
	rdb := srv.client()
	defer rdb.Close()
	rng := rand.New(rand.NewPCG(3, 14))
	for i := range 30 {
		tr := newRandomTrace(rng)
		l := tr.limit
		key := s.key(bucketFor("lease-" + strconv.Itoa(i)))
		var st State
		for j := range tr.gaps {
			s.clockOffset += tr.gaps[j]
			cost := min(tr.costs[j], l.Capacity)
			if rng.IntN(4) == 0 {
				n := 1 + rng.Int64N(l.Capacity)
				vals, err := s.call(bg, giveBackBucketScript, key, []any{l.Capacity, l.Rate.Tokens, l.Rate.Interval, n, s.clockOffset}, false)
				if err != nil {
					t.Fatal(err)
				}
				st = GiveBack(st, vals[4], l, n)
			} else {
				want := cost + rng.Int64N(l.Capacity-cost+1)
				vals, err := s.call(bg, leaseBucketScript, key, []any{l.Capacity, l.Rate.Tokens, l.Rate.Interval, cost, s.clockOffset, want}, false)
				if err != nil {
					t.Fatal(err)
				}
				var res LeaseResult
				st, res = Lease(st, vals[4], l, cost, want)
				got := LeaseResult{Granted: vals[0], Remaining: vals[1], HoldOff: vals[2], ResetAfter: vals[3]}
				if got != res {
					t.Fatalf("trace %d step %d (limit %+v, cost %d, want %d): Redis %+v, Lease %+v", i, j, l, cost, want, got, res)
				}
			}
			v, err := rdb.Get(bg, key).Result()
			if err == nil && v != fmt.Sprintf("%d %d", st.FullAt, st.Slack) {
				t.Fatalf("trace %d step %d: stored %q, the model's state %+v", i, j, v, st)
			}
		}
	}
}
