package ratelimit

import (
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// Regression tests for the guarantees that review found broken: a
// give-back never lifts a ban or forgives a debt, never creates tokens
// under an older limit, a request of cost 0 waits out a ban or a debt, and
// leases never admit more than one bucket.

const second = int64(1_000_000)

// The README's setup, `rate_limit 200 50/s` with `lease 10%` and
// `lease_ttl 1s` on 4 nodes: 4 requests on each, a 0.8 s pause, then a
// burst from all. The tokens the nodes hold stay out of the refill, so the
// burst gets at most the capacity, and the fleet no more than one bucket
// on the same arrivals (it admitted 212 in the burst, 228 in all, against
// 216).
func TestBurstAfterARefillGetsNoMoreThanTheCapacity(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*bucket.Shared{}}
	l := bucket.Limit{Capacity: 200, Rate: bucket.Rate{Tokens: 50, Interval: second}}
	var fleet [4]*leaseTable
	for i := range fleet {
		fleet[i] = newModelTable(m, leaseSize{percent: 10}, time.Second)
		defer fleet[i].close()
	}
	var one bucket.State
	var fleetAdmitted, oneAdmitted int64
	request := func(node int) (admitted bool) {
		res, err := fleet[node].take(bg, []byte("k"), l, 1)
		tableSync(fleet[node])
		if err != nil {
			t.Fatal(err)
		}
		var r bucket.Result
		if one, r = bucket.Take(one, clock.now(), l, 1); r.Allowed {
			oneAdmitted++
		}
		if res.Allowed {
			fleetAdmitted++
		}
		return res.Allowed
	}
	for node := range fleet {
		for range 4 {
			request(node)
			clock.advance(time.Millisecond)
		}
	}
	clock.advance(800 * time.Millisecond)
	burst := 0
	for i := range 400 {
		if request(i % 4) {
			burst++
		}
	}
	if burst > 200 {
		t.Errorf("the burst after the refill got %d, more than the capacity 200", burst)
	}
	if fleetAdmitted > oneAdmitted {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", fleetAdmitted, oneAdmitted)
	}
	if burst < 190 {
		t.Errorf("the burst got %d, want near the capacity, 200", burst)
	}
	t.Logf("burst %d, in all %d; one bucket %d", burst, fleetAdmitted, oneAdmitted)
}

// DESIGN's ban with leases, on 4 nodes: 100 at 1/s, ban 10m, lease 10%, 10
// requests a second for 60 s. The ban starts in the shared store on the
// first refusal, other nodes spend at most what they hold, and their
// give-backs do not end it: the fleet admits no more than one bucket on
// the same arrivals (111; it admitted 157), and one request reports the
// ban that started, for bans_total, even when a prefetch started it.
func TestBanHoldsOnEveryLeasingNode(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*bucket.Shared{}}
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: second}, Ban: 600 * second}
	var fleet [4]*leaseTable
	for i := range fleet {
		fleet[i] = newModelTable(m, leaseSize{percent: 10}, time.Second)
		defer fleet[i].close()
	}
	var one bucket.State
	var fleetAdmitted, oneAdmitted, bans int
	for i := range 600 {
		node := fleet[i%4]
		res, err := node.take(bg, []byte("k"), l, 1)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			fleetAdmitted++
		}
		if res.Banned {
			bans++
		}
		var r bucket.Result
		if one, r = bucket.Take(one, clock.now(), l, 1); r.Allowed {
			oneAdmitted++
		}
		clock.advance(100 * time.Millisecond)
		if i%2 == 0 { // the sweep, every 250 ms with lease_ttl 1s
			for _, n := range fleet {
				if back := n.sweep(clock.now(), false); len(back) > 0 {
					n.giveBackNow(back)
				}
			}
		}
	}
	if fleetAdmitted > oneAdmitted {
		t.Errorf("the fleet admitted %d, one bucket %d on the same arrivals", fleetAdmitted, oneAdmitted)
	}
	if bans != 1 {
		t.Errorf("%d requests reported a ban that started, want 1", bans)
	}
	t.Logf("fleet %d, one bucket %d", fleetAdmitted, oneAdmitted)
}

// A refused request is told when the shared bucket holds its cost, not the
// node's next lease, and the node calls again by then: lease 10% of 100 at
// 1/s is a lease of 10 tokens, 10 s of refill, but one request waits 1 s.
// With a ban, it waits the ban and one request's refill, as the README
// says.
func TestLeaseRetryAfterIsTheRequestsWait(t *testing.T) {
	for _, ban := range []int64{0, 60 * second} {
		clock := new(fakeClock)
		clock.micros.Store(1_000_000)
		m := &sharedModel{now: clock.now, states: map[string]*bucket.Shared{}}
		l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: second}, Ban: ban}
		node := newModelTable(m, leaseSize{percent: 10}, time.Hour)
		var res bucket.Result
		for range 200 {
			var err error
			if res, err = node.take(bg, []byte("k"), l, 1); err != nil {
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
		clock.advance(time.Duration(secondsUp(res.RetryAfter)) * time.Second)
		if again, _ := node.take(bg, []byte("k"), l, 1); !again.Allowed {
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
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*bucket.Shared{}}
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 600 * second}
	node := newModelTable(m, leaseSize{tokens: 20}, time.Hour)
	defer node.close()
	key := []byte("k")
	for range 2 { // leases of 1 and 2 tokens: one is left
		if res, _ := node.take(bg, key, l, 1); !res.Allowed {
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
	if res, _ := node.take(bg, key, l, 1); !res.Allowed || res.Banned {
		t.Fatalf("the request on the last token held: %+v", res)
	}
	tableSync(node)
	if sh := m.states["k"]; sh.Banned(clock.now()) {
		t.Fatal("a refused prefetch started a ban")
	}
	if res, _ := node.take(bg, key, l, 1); res.Allowed || !res.Banned {
		t.Fatalf("the next request: %+v, want refused, reporting the ban it started", res)
	}
}

// A lease table under eviction pressure never refuses a request that the
// shared bucket covers: a request whose entry was evicted while it waited
// on a call starts again on a new one. It used to be refused, with
// Retry-After 1.
func TestEvictedWaiterIsNotRefused(t *testing.T) {
	m := &sharedModel{now: monotonicMicros, states: map[string]*bucket.Shared{}}
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1 << 20, Interval: 1}}
	node := newLeaseTable(m, m.now, leaseSize{percent: 10}, time.Second, time.Second, leaseShards, nopLogger)
	defer node.close()
	done := make(chan int, 8)
	for g := range 8 {
		go func() {
			refused := 0
			rng := rand.New(rand.NewPCG(uint64(g), 1))
			for range 2000 {
				key := []byte{byte('a' + rng.IntN(26)), byte('a' + rng.IntN(26))}
				if res, err := node.take(bg, key, l, 1); err != nil || !res.Allowed {
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
	m := &sharedModel{now: monotonicMicros, states: map[string]*bucket.Shared{}}
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1 << 20, Interval: 1}}
	for range 20 {
		node := newLeaseTable(m, m.now, leaseSize{percent: 10}, time.Second, time.Second, leaseShards, nopLogger)
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
				node.take(bg, []byte{byte(i), byte(i >> 8)}, l, 1)
				takes.Add(1)
			}
		}()
		waitFor(t, 5*time.Second, "requests through the table", func() bool { return takes.Load() > 100 })
		node.close()
		m.mu.Lock()
		calls := m.calls
		m.mu.Unlock()
		closedAt := takes.Load()
		waitFor(t, 5*time.Second, "requests after close", func() bool { return takes.Load() > closedAt+100 })
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

// The README's login setup, in every store mode: a right password admitted
// before the ban and answered after it (a 200, which does not count) gives
// its token back into a banned bucket, which keeps the ban; the next wrong
// password is refused. The give-back used to end the ban, and a fourth
// wrong password reached the origin 0.4 s into a one-hour ban.
func TestSlowRightPasswordDoesNotLiftTheBan(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			release := make(chan struct{})
			arrived := make(chan struct{}, 1)
			origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("X-Password") != "right" {
					w.WriteHeader(http.StatusUnauthorized)
					return
				}
				arrived <- struct{}{}
				<-release
				w.WriteHeader(http.StatusOK)
			}))
			defer origin.Close()
			s := serve(t, fmt.Sprintf(`rate_limit 10 1/h {
				key header X-User
				count_status 401
				ban 1h
				%s
			}
			reverse_proxy %s`, tt.store, strings.TrimPrefix(origin.URL, "http://")))
			right, wrong := []string{"X-User: ann", "X-Password: right"}, []string{"X-User: ann", "X-Password: wrong"}
			done := make(chan response, 1)
			go func() { done <- s.get("/", right...) }()
			<-arrived
			for i := range 9 {
				if r := s.get("/", wrong...); r.status != 401 {
					t.Fatalf("wrong password %d: %d, want 401", i+1, r.status)
				}
			}
			if r := s.get("/", wrong...); r.status != 429 {
				t.Fatalf("the wrong password that bans: %d, want 429", r.status)
			}
			close(release)
			if r := <-done; r.status != 200 {
				t.Fatalf("the right password: %d, want 200", r.status)
			}
			if r := s.get("/", wrong...); r.status != 429 {
				t.Fatalf("a wrong password after the right one came back: %d, want 429: the ban holds", r.status)
			}
		})
	}
}

// A tier that goes from one limit to several keeps its first limit's
// bucket in Redis: the key does not move, so a reload refills no client.
func TestRedisBucketKeepsItsKeyAcrossLimitCounts(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second)})
	b := bucketFor("switch")
	l := slowLimit(10)
	for range 4 {
		if res, err := s.Take(bg, b, l, 1); err != nil || !res.Allowed {
			t.Fatalf("take: %+v, %v", res, err)
		}
	}
	out := make([]bucket.Result, 2)
	allowed, err := s.TakeAll(bg, b, []bucket.Limit{l, slowLimit(100)}, 1, out)
	if err != nil || !allowed {
		t.Fatalf("take on two limits: %v, %v", allowed, err)
	}
	if out[0].Remaining != 5 || out[1].Remaining != 99 {
		t.Fatalf("after a reload to two limits: %+v, want 5 left of the first (it kept its 4) and 99 of the new", out)
	}
	res, err := s.Take(bg, b, l, 1)
	if err != nil || res.Remaining != 4 {
		t.Fatalf("back to one limit: %+v, %v; want 4 left", res, err)
	}
}

// A count_status give-back that reaches a node after a reload closed its
// lease table goes to the shared bucket instead of being lost.
func TestGiveBackAfterAReloadReachesTheSharedBucket(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second), Lease: "20%"})
	l := slowLimit(100)
	b := bucketFor("reloaded")
	for range 10 {
		if res, err := s.Take(bg, b, l, 1); err != nil || !res.Allowed {
			t.Fatalf("take: %+v, %v", res, err)
		}
	}
	s.leases.close() // the reload: what is held goes back
	level := func() int64 {
		res, err := s.Peek(bg, b, l)
		if err != nil {
			t.Fatal(err)
		}
		return res.Remaining
	}
	before := level()
	if err := s.GiveBack(bg, b, l, 1); err != nil {
		t.Fatal(err)
	}
	if after := level(); after != before+1 {
		t.Fatalf("the shared bucket holds %d after a give-back through a closed table, want %d", after, before+1)
	}
}

// A request admitted under one config and answered after a reload gives
// its tokens back as the running config counts them: `rate_limit 10 1/h`
// becomes `rate_limit 1000 100/h`, and the right password (a 200, which
// does not count) gives back one token, not the 100 that an hour of the
// old refill is worth under the new one.
func TestGiveBackAfterAReloadCountsInTheRunningLimit(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			release := make(chan struct{})
			var released sync.Once
			free := func() { released.Do(func() { close(release) }) }
			defer free() // so that Caddy can stop when the test fails early
			arrived := make(chan struct{}, 1)
			origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("X-Password") != "right" {
					w.WriteHeader(http.StatusUnauthorized)
					return
				}
				arrived <- struct{}{}
				<-release
			}))
			defer origin.Close()
			port := freePort(t)
			site := func(limit string) string {
				return fmt.Sprintf(`{
	admin off
	skip_install_trust
}
http://127.0.0.1:%d {
	rate_limit %s {
		name reload
		key header X-User
		count_status 401
		%s
	}
	reverse_proxy %s
}
`, port, limit, tt.store, strings.TrimPrefix(origin.URL, "http://"))
			}
			s := serveCaddyfile(t, port, site("10 1/h"))
			// A connection of its own for the held request, and none kept
			// across the reload for the others.
			held := *s
			held.client = &http.Client{Timeout: time.Minute}
			s.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
			done := make(chan response, 1)
			go func() { done <- held.get("/", "X-User: ann", "X-Password: right") }()
			<-arrived
			cfg, err := adaptCaddyfile(site("1000 100/h"))
			if err != nil {
				t.Fatal(err)
			}
			// The reload returns once the old server has drained, which
			// waits for the request held at the origin.
			loaded := make(chan error, 1)
			go func() { loaded <- caddy.Load(cfg, true) }()
			var last response
			waitFor(t, 10*time.Second, "the new config", func() bool {
				// A connection that meets the old server as it closes
				// fails; the next one reaches the new.
				req, _ := http.NewRequest(http.MethodGet, s.base+"/", nil)
				req.Header.Set("X-User", "probe")
				resp, err := s.client.Do(req)
				if err != nil {
					return false
				}
				resp.Body.Close()
				return resp.Header.Get("X-RateLimit-Limit") == "1000"
			})
			// The old config's token is an hour of refill: 100 under the
			// new one. 100 failures leave 800. (Per hour, so that Redis's
			// real clock refills nothing to speak of meanwhile.)
			for range 100 {
				if last = s.get("/", "X-User: ann", "X-Password: wrong"); last.status != 401 {
					t.Fatalf("a wrong password under the new config: %d", last.status)
				}
			}
			if got := last.header.Get("X-RateLimit-Remaining"); got != "800" {
				t.Fatalf("after the reload and 100 failures: %s left, want 800", got)
			}
			free()
			if r := <-done; r.status != 200 {
				t.Fatalf("the right password: %d", r.status)
			}
			if err := <-loaded; err != nil {
				t.Fatal(err)
			}
			// With leases the header is this node's view, which may lag;
			// it must still show no token created.
			got, _ := strconv.Atoi(s.get("/", "X-User: ann", "X-Password: wrong").header.Get("X-RateLimit-Remaining"))
			if got > 800 || got != 800 && !strings.Contains(tt.store, "lease") {
				t.Errorf("after the old config's request gave its token back and one more failure: %d left, want 800 (801 - 1)", got)
			}
		})
	}
}
