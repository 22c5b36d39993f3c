package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"
)

// max_wait end to end: real Caddy configs, a real origin that records when
// each request reaches it, in every store mode.

// waitOrigin is an origin that notes when each request reaches it.
type waitOrigin struct {
	srv *httptest.Server
	mu  sync.Mutex
	at  []time.Time
}

func newWaitOrigin(t *testing.T) *waitOrigin {
	t.Helper()
	o := &waitOrigin{}
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		o.mu.Lock()
		o.at = append(o.at, time.Now())
		o.mu.Unlock()
		w.Write([]byte("ok"))
	}))
	t.Cleanup(o.srv.Close)
	return o
}

// arrivals are the times requests reached the origin, in order.
func (o *waitOrigin) arrivals() []time.Time {
	o.mu.Lock()
	defer o.mu.Unlock()
	at := slices.Clone(o.at)
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	return at
}

// outcome is what one request of a test got.
type waitOutcome struct {
	status int
	retry  string
	err    error
	sent   time.Time
	took   time.Duration
}

// send sends a GET as client key, under ctx.
func (s *testServer) send(ctx context.Context, key string) waitOutcome {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.base+"/", nil)
	if err != nil {
		panic(err)
	}
	req.Header.Set("X-Key", key)
	o := waitOutcome{sent: time.Now()}
	resp, err := s.client.Do(req)
	o.took = time.Since(o.sent)
	if err != nil {
		o.err = err
		return o
	}
	resp.Body.Close()
	o.status, o.retry = resp.StatusCode, resp.Header.Get("Retry-After")
	return o
}

// burst sends n requests of one client at once, and returns what each got.
func (s *testServer) burst(n int, key string) []waitOutcome {
	out := make([]waitOutcome, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range n {
		wg.Go(func() {
			<-start
			out[i] = s.send(context.Background(), key)
		})
	}
	close(start)
	wg.Wait()
	return out
}

// warm opens n connections to s, so that a burst's requests do not wait
// on dials.
func (s *testServer) warm(n int) {
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if resp, err := s.client.Get(s.base + "/warm"); err == nil {
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
}

const waitSite = `rate_limit /warm* 1000000 1000000/s {
		name %[1]s_warm
	}
	rate_limit %[2]d %[3]s {
		name %[1]s
		key header X-Key
		max_wait %[4]s
		%[5]s
	}
	reverse_proxy %[6]s`

// serveWaiting serves policy with capacity C, 10/s and max_wait 1s in the
// store block given, before an origin that notes arrivals; its
// connections are open and nothing has arrived yet.
func serveWaiting(t *testing.T, policy string, capacity int, store string) (*waitOrigin, *testServer) {
	t.Helper()
	origin := newWaitOrigin(t)
	s := serve(t, fmt.Sprintf(waitSite, policy, capacity, "10/s", "1s", store, origin.srv.Listener.Addr()))
	s.warm(32)
	origin.mu.Lock()
	origin.at = nil
	origin.mu.Unlock()
	return origin, s
}

// rate 10/s, capacity 1, max_wait 1s, 30 requests of one client at once:
// 11 reach the origin, the k-th after k x 100 ms (+-20 ms), and 19 are
// refused at once with Retry-After.
func TestMaxWaitSpacesABurstAtTheRate(t *testing.T) {
	skipUnderShort(t, "real-time")
	for i, mode := range storeModes(startRedis(t)) {
		t.Run(mode.name, func(t *testing.T) {
			origin, s := serveWaiting(t, fmt.Sprint("spaced_", i), 1, mode.store)
			// The counts must hold every time. The timings are the
			// machine's too: a timer that fires late under a loaded CI
			// runner gets one more round, on a fresh client.
			var late error
			for round := range 2 {
				if late = burstSpacedAtTheRate(t, s, origin, fmt.Sprint("burst-", i, "-", round)); late == nil {
					return
				}
				t.Logf("round %d: %v", round, late)
				origin.mu.Lock()
				origin.at = nil
				origin.mu.Unlock()
			}
			t.Error(late)
		})
	}
}

// burstSpacedAtTheRate sends the burst of TestMaxWaitSpacesABurstAtTheRate
// as client key, fails the test on a wrong count, and reports a timing
// out of bounds.
func burstSpacedAtTheRate(t *testing.T, s *testServer, origin *waitOrigin, key string) error {
	t.Helper()
	t0 := time.Now()
	out := s.burst(30, key)
	var served, refused int
	var refusals []time.Duration
	atOnce := time.Hour
	for _, o := range out {
		switch {
		case o.err != nil:
			t.Fatalf("request failed: %v", o.err)
		case o.status == 200:
			served++
			atOnce = min(atOnce, o.took)
		case o.status == 429:
			refused++
			refusals = append(refusals, o.took)
			if o.retry != "1" {
				t.Errorf("a refusal's Retry-After %q, want 1", o.retry)
			}
		default:
			t.Fatalf("status %d", o.status)
		}
	}
	slices.Sort(refusals)
	if served != 11 || refused != 19 {
		// A burst sent over more than 100 ms (a loaded machine, the race
		// detector) meets one more token for each 100 ms: late, not wrong,
		// when the last refusal came that late.
		spread := refusals[len(refusals)-1]
		if served < 11 || served > 11+int(spread/(100*time.Millisecond)) || served+refused != 30 {
			t.Fatalf("%d served, %d refused, the last refusal %v after the burst was sent; want 11 and 19", served, refused, spread)
		}
		return fmt.Errorf("%d served, %d refused: the burst took %v to be decided, more than a token's 100 ms", served, refused, spread)
	}
	at := origin.arrivals()
	if len(at) != 11 {
		t.Fatalf("%d requests reached the origin, want 11", len(at))
	}
	t.Logf("refusals: median %v, slowest %v, served at once %v; arrivals %v", refusals[len(refusals)/2], refusals[len(refusals)-1], atOnce, offsets(at, t0))
	// Refused at once: no refusal waits for a token (100 ms). The 30
	// requests share this process's 2 CPUs with Caddy, so a refusal costs
	// what half the burst costs to send and answer, as the request served
	// at once does: the median refusal comes within 5 ms of it (25 under
	// the race detector, which slows each request 3 to 5 times).
	bound := 5 * time.Millisecond
	if raceEnabled {
		bound = 25 * time.Millisecond
	}
	if median, slowest := refusals[len(refusals)/2], refusals[len(refusals)-1]; median > atOnce+bound || slowest > 50*time.Millisecond {
		return fmt.Errorf("refusals took %v (median %v, slowest %v), the request served at once %v; want the median within %v of it", refusals, median, slowest, atOnce, bound)
	}
	// The first goes on at once (as fast as the request served at once
	// comes back); the k-th k x 100 ms after it, +- 20 ms.
	if first := at[0].Sub(t0); first > atOnce+20*time.Millisecond {
		return fmt.Errorf("the first reached the origin %v after the burst was sent, the request served at once took %v", first, atOnce)
	}
	for k, a := range at {
		if d := a.Sub(at[0]) - time.Duration(k)*100*time.Millisecond; d < -20*time.Millisecond || d > 20*time.Millisecond {
			return fmt.Errorf("request %d reached the origin %v after the first, want %v +- 20 ms (all: %v)", k, a.Sub(at[0]), time.Duration(k)*100*time.Millisecond, offsets(at, t0))
		}
	}
	return nil
}

func offsets(at []time.Time, t0 time.Time) []time.Duration {
	var d []time.Duration
	for _, a := range at {
		d = append(d, a.Sub(t0).Round(time.Millisecond))
	}
	return d
}

// The 5 last of 11 waiters hang up at 250 ms: their tokens go back, so 5
// requests sent at 300 ms are all served (without the give-back only 3
// would fit), and the origin never sees requests faster than one bucket
// admits.
func TestAWaiterThatHangsUpGivesItsTokensBack(t *testing.T) {
	skipUnderShort(t, "real-time")
	for i, mode := range storeModes(startRedis(t)) {
		t.Run(mode.name, func(t *testing.T) {
			origin, s := serveWaiting(t, fmt.Sprint("hangup_", i), 1, mode.store)
			key := fmt.Sprint("hangup-", i)
			t0 := time.Now()
			gone, hangUp := context.WithCancel(context.Background())
			first := make([]waitOutcome, 11)
			var wg sync.WaitGroup
			for i := range 11 {
				ctx := context.Background()
				if i >= 6 {
					ctx = gone
				}
				wg.Go(func() { first[i] = s.send(ctx, key) })
				// In order: the i-th takes the i-th slot.
				time.Sleep(3 * time.Millisecond)
			}
			time.Sleep(time.Until(t0.Add(250 * time.Millisecond)))
			hangUp()
			time.Sleep(time.Until(t0.Add(300 * time.Millisecond)))
			later := s.burst(5, key)
			wg.Wait()
			for i, o := range first {
				if i < 6 && o.status != 200 || i >= 6 && o.err == nil {
					t.Errorf("request %d of the first 11: %d, %v; want the first 6 served, the last 5 gone", i, o.status, o.err)
				}
			}
			for i, o := range later {
				if o.err != nil || o.status != 200 {
					t.Errorf("request %d sent at 300 ms: %d, %v; want 200 (the hung-up waiters gave their tokens back)", i, o.status, o.err)
				}
			}
			at := origin.arrivals()
			if len(at) != 11 {
				t.Fatalf("%d requests reached the origin, want 11 (6, then the 5 sent at 300 ms): %v", len(at), offsets(at, t0))
			}
			if err := fasterThanOneBucket(at, t0, 1, 100*time.Millisecond); err != nil {
				t.Error(err)
			}
		})
	}
}

// With leases of many tokens: capacity 10, 10/s, lease 50%, max_wait 1s,
// 30 at once: the lease serves the first at once, the rest take their
// tokens in the shared bucket and wait; 20 in all, as one bucket allows,
// and never faster than it over any window.
func TestMaxWaitWithLeasesOfManyTokens(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	block := fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\ttimeout 2s\n\t\t\tlease 50%%\n\t\t}", srv.url())
	origin, s := serveWaiting(t, "leased", 10, block)
	t0 := time.Now()
	out := s.burst(30, "leased")
	served := 0
	for _, o := range out {
		if o.err != nil {
			t.Fatal(o.err)
		}
		if o.status == 200 {
			served++
		}
	}
	at := origin.arrivals()
	if served != len(at) || served > 20 || served < 18 {
		t.Fatalf("%d served, %d at the origin; want 20 (10 at once, 10 waiting), never more: %v", served, len(at), offsets(at, t0))
	}
	if err := fasterThanOneBucket(at, t0, 10, 100*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d served: %v", served, offsets(at, t0))
}

// A flood of 100,000 requests that could all wait (max_wait 200h at one
// token in 10 minutes, so that no waiter is done during the flood), with
// max_waiting 1000: 1000 wait, the rest are refused at once and take
// nothing; goroutines and heap stay bounded; when the waiters' clients go,
// every token comes back.
func TestMaxWaitingBoundsAFlood(t *testing.T) {
	// Serial: it counts the process's goroutines and heap.
	skipUnderShort(t, "heavy load")
	h, done := provisionedHandler(t, `{"name":"flood","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":720000000000000,"max_waiting":1000,"tiers":[{"name":"default","capacity":100,"refill":"1/10m"}]}`)
	defer done()
	var stats runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&stats)
	heapBefore, goroutinesBefore := stats.HeapInuse, runtime.NumGoroutine()

	gone, hangUp := context.WithCancel(context.Background())
	defer hangUp()
	var waiters sync.WaitGroup
	var mu sync.Mutex
	count := map[int]int{}
	var peakWaiting int64
	var peakGoroutines int
	var peakHeap uint64
	serveOne := func() {
		r := benchRequest("127.0.0.1").WithContext(gone)
		r.Header.Set("X-Key", "flood")
		w := httptest.NewRecorder()
		err := h.ServeHTTP(w, r, nopHandler)
		status := w.Code
		if err != nil {
			status = 429
		}
		mu.Lock()
		count[status]++
		mu.Unlock()
	}
	const flood = 100_000
	sent := 0
	// The first 100 take the full bucket; the next 1000 wait; then the
	// rest, 8 at a time, are refused at once.
	for ; sent < 1100; sent++ {
		waiters.Go(serveOne)
	}
	for h.waiting.Load() < 1000 {
		time.Sleep(time.Millisecond)
	}
	var flooders sync.WaitGroup
	per := (flood - sent) / 8
	for range 8 {
		flooders.Go(func() {
			for i := range per {
				serveOne()
				if i%1000 == 0 {
					mu.Lock()
					peakWaiting = max(peakWaiting, h.waiting.Load())
					peakGoroutines = max(peakGoroutines, runtime.NumGoroutine())
					var m runtime.MemStats
					runtime.ReadMemStats(&m)
					peakHeap = max(peakHeap, m.HeapInuse)
					mu.Unlock()
				}
			}
		})
	}
	flooders.Wait()
	sent += 8 * per
	mu.Lock()
	refused := count[429]
	mu.Unlock()
	if peakWaiting != 1000 || refused != sent-1100 {
		t.Fatalf("peak waiting %d, %d of %d refused; want 1000 waiting and every other one refused", peakWaiting, refused, sent)
	}
	if extra := peakGoroutines - goroutinesBefore; extra > 1100+8+50 {
		t.Errorf("%d goroutines more during the flood: the waiters are not bounded", extra)
	}
	if growth := int64(peakHeap) - int64(heapBefore); growth > 64<<20 {
		t.Errorf("the heap grew %d MiB during the flood", growth>>20)
	}
	t.Logf("flood of %d: %d refused at once; peak waiting %d, goroutines +%d, heap +%.1f MiB", sent, refused, peakWaiting, peakGoroutines-goroutinesBefore, float64(int64(peakHeap)-int64(heapBefore))/(1<<20))

	// The waiters' clients go: each gives its tokens back, and the
	// refused took none, so the bucket is as the 100 allowed left it: the
	// next request waits one token's refill, 10 minutes (less the time
	// the test took), not 1000 x 10.
	hangUp()
	waiters.Wait()
	if n := h.waiting.Load(); n != 0 {
		t.Fatalf("%d still counted as waiting after every client went", n)
	}
	if count[499] != 1000 {
		t.Errorf("%d waiters answered 499, want 1000", count[499])
	}
	res, err := takeLimit(context.Background(), h.store, &Bucket{Policy: "flood", Tier: "default", Keyer: "header/X-Key", Value: []byte("flood")}, h.Tiers[0].limits[0], 1)
	if err != nil {
		t.Fatal(err)
	}
	if wait := time.Duration(res.Wait) * time.Microsecond; !res.Allowed || wait > 10*time.Minute || wait < 9*time.Minute {
		t.Fatalf("after every waiter went, the next request: %+v; want it to wait one token's 10 minutes", res)
	}
}

// fasterThanOneBucket reports arrivals at that one bucket of capacity,
// full at t0 and refilling a token every interval, could not have let
// through. Two checks:
//   - from t0: the k-th arrival (from 0) comes no sooner than
//     t0 + (k+1-capacity) x interval, since no more tokens were there by
//     then. A request late on its trip from the handler to the origin (a
//     scheduler's whim, or the whole process stalled) only makes this
//     looser, so no lateness is allowed for: two let go together are
//     caught however late the others are.
//   - every window: at most C + floor(T/interval) in a window T long, for
//     a bucket that refills to its capacity between bursts; a request's
//     trip may be late and shorten the window it starts, and 150 ms is
//     allowed for that (a run stalled about 100 ms under -race at load 6).
func fasterThanOneBucket(at []time.Time, t0 time.Time, capacity int, interval time.Duration) error {
	for k, a := range at {
		if due := t0.Add(time.Duration(k+1-capacity) * interval); a.Before(due) {
			return fmt.Errorf("request %d reached the origin %v after the start, before one bucket of %d at one token every %v had its token (%v): %v", k, a.Sub(t0), capacity, interval, due.Sub(t0), offsets(at, t0))
		}
	}
	const late = 150 * time.Millisecond
	for i := range at {
		for j := i; j < len(at); j++ {
			span := at[j].Sub(at[i]) + late
			if n, bound := j-i+1, capacity+int(span/interval); n > bound {
				return fmt.Errorf("%d requests reached the origin within %v, more than one bucket of %d at one token every %v allows (%d): %v", n, at[j].Sub(at[i]), capacity, interval, bound, offsets(at, t0))
			}
		}
	}
	return nil
}

// The window check passes arrivals at the rate with a late one among them,
// and fails two let go together or a burst beyond the capacity.
func TestFasterThanOneBucketCatchesWhatTheBucketForbids(t *testing.T) {
	t.Parallel()
	t0 := time.Now()
	ms := func(offsets ...int) []time.Time {
		var at []time.Time
		for _, o := range offsets {
			at = append(at, t0.Add(time.Duration(o)*time.Millisecond))
		}
		return at
	}
	for _, c := range []struct {
		name     string
		capacity int
		at       []time.Time
		fails    bool
	}{
		{"at the rate, one 28 ms late", 1, ms(1, 102, 206, 328, 403, 502), false},
		{"at the rate, one 102 ms late beside the next", 1, ms(1, 102, 202, 302, 402, 602, 602, 702), false},
		{"two let go together", 1, ms(1, 102, 206, 210, 403), true},
		{"two let go together after a stall", 1, ms(1, 102, 202, 402, 402, 403), true},
		{"a full bucket after a pause, twice over", 2, ms(0, 1, 500, 501, 502, 503), true},
		{"a full bucket, then the rate", 3, ms(0, 1, 2, 100, 200), false},
		{"one more than the capacity at once", 3, ms(0, 1, 2, 3), true},
		{"a second full bucket too soon", 3, ms(0, 1, 2, 150, 151, 152), true},
	} {
		if err := fasterThanOneBucket(c.at, t0, c.capacity, 100*time.Millisecond); (err != nil) != c.fails {
			t.Errorf("%s: %v, want a failure %v", c.name, err, c.fails)
		}
	}
}
