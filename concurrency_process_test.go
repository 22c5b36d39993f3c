package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
)

// The measured claims of issue 23 (concurrency) on real processes: Caddy
// processes built from this checkout (buildCaddy, startCaddyProcess) in
// front of an origin in the test process that counts the requests it
// holds at once, with their slots in one redis-server. Clients are named
// by X-Key.

// heldOrigin is an origin that holds each request, and counts how many it
// holds at once and the most it held.
type heldOrigin struct {
	srv *httptest.Server
	// hold is how long a request is held; a request with X-Hold: long is
	// held until release is closed (or 30 s), one with X-Hold-Ms for that
	// many milliseconds.
	hold    time.Duration
	release chan struct{}
	once    sync.Once

	held, max, hits atomic.Int64

	// keyMax is the most requests of one X-Key held at once, by key.
	mu              sync.Mutex
	keyHeld, keyMax map[string]int64
}

func startHeldOrigin(t *testing.T, hold time.Duration) *heldOrigin {
	t.Helper()
	o := &heldOrigin{hold: hold, release: make(chan struct{}), keyHeld: map[string]int64{}, keyMax: map[string]int64{}}
	o.srv = httptest.NewServer(http.HandlerFunc(o.serve))
	// Cleanups run last first: the held requests are let go before
	// Close, which waits for them.
	t.Cleanup(o.srv.Close)
	t.Cleanup(o.letGo)
	return o
}

// maxOfOneKey is the most requests of one key the origin held at once.
func (o *heldOrigin) maxOfOneKey() int64 {
	o.mu.Lock()
	defer o.mu.Unlock()
	var m int64
	for _, v := range o.keyMax {
		m = max(m, v)
	}
	return m
}

// letGo releases the requests held until the test says so.
func (o *heldOrigin) letGo() { o.once.Do(func() { close(o.release) }) }

func (o *heldOrigin) addr() string { return strings.TrimPrefix(o.srv.URL, "http://") }

func (o *heldOrigin) serve(w http.ResponseWriter, r *http.Request) {
	o.hits.Add(1)
	n := o.held.Add(1)
	for m := o.max.Load(); n > m && !o.max.CompareAndSwap(m, n); m = o.max.Load() {
	}
	key := r.Header.Get("X-Key")
	o.mu.Lock()
	o.keyHeld[key]++
	o.keyMax[key] = max(o.keyMax[key], o.keyHeld[key])
	o.mu.Unlock()
	d := o.hold
	if ms, err := strconv.Atoi(r.Header.Get("X-Hold-Ms")); err == nil {
		d = time.Duration(ms) * time.Millisecond
	}
	if r.Header.Get("X-Hold") == "long" {
		d = 30 * time.Second
	}
	timer := time.NewTimer(d)
	select {
	case <-timer.C:
	case <-o.release:
	case <-r.Context().Done():
	}
	timer.Stop()
	// Let go before answering: once Caddy has the answer, it frees the
	// slot, and the next request may come in.
	o.mu.Lock()
	o.keyHeld[key]--
	o.mu.Unlock()
	o.held.Add(-1)
	_, _ = io.WriteString(w, "origin")
}

// concNode is one Caddy process of a concurrency test.
type concNode struct{ port, admin int }

func (n concNode) base() string      { return fmt.Sprintf("http://127.0.0.1:%d", n.port) }
func (n concNode) adminBase() string { return fmt.Sprintf("http://127.0.0.1:%d", n.admin) }

// concCaddyfile is a node's config: policy "conc", tier "all" of
// concurrency n only, keyed by X-Key, in front of origin; store is a store
// block, "" for local. /ready is outside the limit.
func concCaddyfile(node concNode, n int, store, origin string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
}
http://127.0.0.1:%d {
	bind 127.0.0.1
	handle /ready {
		respond "ready"
	}
	@limited not path /ready
	rate_limit @limited {
		name conc
		key header X-Key
		tier all {
			concurrency %d
		}
		%s
	}
	reverse_proxy %s
}
`, node.admin, node.port, n, store, origin)
}

// concRedisStore is the store block for Redis at srv with slot_ttl, and
// a timeout of a third of it (slot_ttl's least).
func concRedisStore(srv *redisServer, slotTTL time.Duration) string {
	return fmt.Sprintf(`store redis {
			address %s
			timeout %s
			slot_ttl %s
		}`, srv.url(), slotTTL/3, slotTTL)
}

func newConcNode(t *testing.T) concNode {
	return concNode{port: freePort(t), admin: freePort(t)}
}

// inFlightSample is the line of the in_flight gauge of policy "conc", tier
// "all", in a node's /metrics.
const inFlightSample = `caddy_http_rate_limit_in_flight{policy="conc",tier="all"}`

// scrapeInFlight reads a node's in_flight gauge of policy "conc", tier
// "all"; found is false when /metrics has no such sample. It does not fail
// the test, so that goroutines may call it.
func scrapeInFlight(client *http.Client, node concNode) (v float64, found bool, err error) {
	resp, err := client.Get(node.adminBase() + "/metrics")
	if err != nil {
		return 0, false, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, false, err
	}
	if resp.StatusCode != 200 {
		return 0, false, fmt.Errorf("GET /metrics: %d", resp.StatusCode)
	}
	for line := range strings.SplitSeq(string(body), "\n") {
		rest, ok := strings.CutPrefix(line, inFlightSample)
		if !ok {
			continue
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64)
		return v, err == nil, err
	}
	return 0, false, nil
}

// slotKeys is the slot sets (<bucket key>:c) Redis holds.
func slotKeys(srv *redisServer) []string {
	var keys []string
	for _, k := range srv.do("KEYS", "*:c").([]any) {
		keys = append(keys, fmt.Sprint(k))
	}
	slices.Sort(keys)
	return keys
}

// concAnswer is one request as the client saw it.
type concAnswer struct {
	status     int // 0: a transport error
	retryAfter string
	err        error
}

func concGet(ctx context.Context, client *http.Client, url, key string, headers ...string) concAnswer {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return concAnswer{err: err}
	}
	req.Header.Set("X-Key", key)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return concAnswer{err: err}
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return concAnswer{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), err: err}
}

// TestConcurrencyHoldsAcrossThreeCaddyProcesses sends 200 requests of one
// client at once, spread over Caddy processes with `concurrency 10`, to an
// origin that holds each 500 ms: the origin never holds more than 10 and
// does reach 10; every request reaches the origin or is refused with 429
// and Retry-After: 1. Then 200 clients retry for 2 s, so that slots are
// freed and taken again across the nodes: the same holds. Afterwards
// Redis holds no slot set and every node's in_flight gauge reads 0 (and
// never passed 10 while the load ran). On 3 processes sharing one redis-server, on one
// process with the same Redis store, and on one process with the local
// store.
func TestConcurrencyHoldsAcrossThreeCaddyProcesses(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process")
	for _, tc := range []struct {
		name  string
		nodes int
		redis bool
	}{
		{"3 processes, one redis-server", 3, true},
		{"1 process, redis", 1, true},
		{"1 process, local", 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const limit, requests = 10, 200
			origin := startHeldOrigin(t, 500*time.Millisecond)
			var srv *redisServer
			store := ""
			if tc.redis {
				srv = startRedis(t)
				store = concRedisStore(srv, 5*time.Second)
			}
			var nodes []concNode
			for range tc.nodes {
				node := newConcNode(t)
				nodes = append(nodes, node)
				startCaddyProcess(t, node.port, concCaddyfile(node, limit, store, origin.addr()))
			}
			transport := &http.Transport{MaxIdleConnsPerHost: requests, MaxConnsPerHost: 0}
			client := &http.Client{Transport: transport, Timeout: 20 * time.Second}
			t.Cleanup(transport.CloseIdleConnections)
			admin := &http.Client{Timeout: 5 * time.Second}

			// Warm up every node on another key, so that connections to
			// Redis and the origin are open and the script is loaded.
			for _, node := range nodes {
				if a := concGet(context.Background(), client, node.base()+"/", "warm-up", "X-Hold-Ms", "0"); a.status != 200 {
					t.Fatalf("warm-up through node %d: %d %v", node.port, a.status, a.err)
				}
			}
			waitFor(t, 5*time.Second, "the warm-up slots to be freed", func() bool {
				return !tc.redis || len(slotKeys(srv)) == 0
			})
			// Sample the nodes' gauges while the load runs. The sum is of
			// scrapes one after another, not of one instant: a slot freed
			// on a node scraped already and taken on one scraped next
			// counts twice, so only each node's gauge is held to the limit.
			stopSampling := make(chan struct{})
			var maxGaugeSum, maxGaugeNode atomic.Int64
			var sampling sync.WaitGroup
			raise := func(a *atomic.Int64, v int64) {
				for m := a.Load(); v > m && !a.CompareAndSwap(m, v); m = a.Load() {
				}
			}
			sampling.Go(func() {
				for {
					var sum float64
					for _, node := range nodes {
						v, _, _ := scrapeInFlight(admin, node)
						sum += v
						raise(&maxGaugeNode, int64(v))
					}
					raise(&maxGaugeSum, int64(sum))
					select {
					case <-stopSampling:
						return
					case <-time.After(50 * time.Millisecond):
					}
				}
			})

			// check reports a phase's answers against the origin's count.
			check := func(phase string, out []concAnswer, hits int64, took time.Duration) {
				t.Helper()
				statuses := map[int]int{}
				var bad []string
				for i, a := range out {
					statuses[a.status]++
					if a.status != 200 && (a.status != 429 || a.retryAfter != "1") && len(bad) < 10 {
						bad = append(bad, fmt.Sprintf("request %d: status %d, Retry-After %q, error %v", i, a.status, a.retryAfter, a.err))
					}
				}
				t.Logf("%s: %d requests of one key over %d node(s) in %s: statuses %v; origin reached %d times, held at most %d at once so far; in_flight gauge peaked at %d on one node, at %d summed over the nodes' scrapes",
					phase, len(out), len(nodes), took.Round(time.Millisecond), statuses, hits, origin.max.Load(), maxGaugeNode.Load(), maxGaugeSum.Load())
				if m := origin.max.Load(); m != limit {
					t.Errorf("%s: the origin held at most %d requests at once, want exactly %d (never more, and reaching it)", phase, m, limit)
				}
				if len(bad) > 0 {
					t.Errorf("%s: want every request answered 200 or 429 with Retry-After: 1; got:\n%s", phase, strings.Join(bad, "\n"))
				}
				if int64(statuses[200]) != hits {
					t.Errorf("%s: %d requests answered 200, but the origin was reached %d times: every 200 must have reached it", phase, statuses[200], hits)
				}
				if g := maxGaugeNode.Load(); g > limit {
					t.Errorf("%s: a node's in_flight gauge reached %d, want at most %d", phase, g, limit)
				}
			}

			// Phase 1: 200 requests at once.
			hitsBefore := origin.hits.Load()
			out := make([]concAnswer, requests)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range requests {
				node := nodes[i%len(nodes)]
				wg.Go(func() {
					<-start
					out[i] = concGet(context.Background(), client, node.base()+"/", "one-client")
				})
			}
			began := time.Now()
			close(start)
			wg.Wait()
			check("200 at once", out, origin.hits.Load()-hitsBefore, time.Since(began))

			// Phase 2: 200 clients retry for 2 s, 50 ms after each refusal,
			// so that slots are freed and taken again, across the nodes.
			hitsBefore = origin.hits.Load()
			var mu sync.Mutex
			out = out[:0]
			began = time.Now()
			for i := range requests {
				node := nodes[i%len(nodes)]
				wg.Go(func() {
					var mine []concAnswer
					for time.Since(began) < 2*time.Second {
						a := concGet(context.Background(), client, node.base()+"/", "one-client")
						mine = append(mine, a)
						if a.status != 200 {
							time.Sleep(50 * time.Millisecond)
						}
					}
					mu.Lock()
					out = append(out, mine...)
					mu.Unlock()
				})
			}
			wg.Wait()
			hits := origin.hits.Load() - hitsBefore
			check("200 clients retrying for 2 s", out, hits, time.Since(began))
			if hits < 2*limit {
				t.Errorf("200 clients retrying for 2 s: the origin was reached %d times, want at least %d: slots freed must be taken again", hits, 2*limit)
			}
			close(stopSampling)
			sampling.Wait()

			// Afterwards: no slot set left in Redis, every gauge at 0.
			end := time.Now()
			var keys []string
			gauges := make([]string, len(nodes))
			clean := false
			for time.Since(end) < 2*time.Second {
				clean = true
				if tc.redis {
					keys = slotKeys(srv)
					clean = len(keys) == 0
				}
				for i, node := range nodes {
					v, found, err := scrapeInFlight(admin, node)
					gauges[i] = fmt.Sprintf("node %d: %v (found %v, error %v)", node.port, v, found, err)
					clean = clean && found && err == nil && v == 0
				}
				if clean {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if !clean {
				t.Errorf("2 s after the last answer: slot sets in Redis %q (want none); in_flight gauges: %s (want 0 on every node)", keys, strings.Join(gauges, "; "))
			} else {
				t.Logf("clean %s after the last answer: no slot set in Redis (redis store: %v), every gauge 0", time.Since(end).Round(time.Millisecond), tc.redis)
			}
		})
	}
}

// killableCaddy is a Caddy process the test can kill -9.
// TestConcurrencySlotsOfAKilledNodeComeBack fills a key's 10 slots through
// node A with requests the origin holds, checks that node B refuses the key
// and that A keeps the slots past slot_ttl by renewing them, then kills A
// with SIGKILL: B admits the key again within slot_ttl + 1 s.
func TestConcurrencySlotsOfAKilledNodeComeBack(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process")
	const limit = 10
	const slotTTL = 2 * time.Second
	origin := startHeldOrigin(t, 0)
	srv := startRedis(t)
	store := concRedisStore(srv, slotTTL)
	a, b := newConcNode(t), newConcNode(t)
	procA := startCaddyProcess(t, a.port, concCaddyfile(a, limit, store, origin.addr()))
	startCaddyProcess(t, b.port, concCaddyfile(b, limit, store, origin.addr()))
	transport := &http.Transport{MaxIdleConnsPerHost: 32}
	client := &http.Client{Transport: transport, Timeout: 60 * time.Second}
	t.Cleanup(transport.CloseIdleConnections)
	admin := &http.Client{Timeout: 5 * time.Second}
	probe := func(node concNode) concAnswer {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return concGet(ctx, client, node.base()+"/", "slow-client")
	}

	// 10 long requests through A.
	longs := make([]concAnswer, limit)
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(origin.letGo)
	for i := range limit {
		wg.Go(func() {
			longs[i] = concGet(context.Background(), client, a.base()+"/", "slow-client", "X-Hold", "long")
		})
	}
	waitFor(t, 10*time.Second, "the origin to hold 10 requests through A", func() bool { return origin.held.Load() == limit })
	keys := slotKeys(srv)
	if len(keys) != 1 {
		t.Fatalf("slot sets in Redis: %q, want one", keys)
	}
	if n := srv.do("ZCARD", keys[0]); n != int64(limit) {
		t.Fatalf("ZCARD %s = %v, want %d", keys[0], n, limit)
	}
	if r := probe(b); r.status != 429 || r.retryAfter != "1" {
		t.Fatalf("B with the key full: status %d, Retry-After %q, error %v; want 429 with Retry-After: 1", r.status, r.retryAfter, r.err)
	}
	if v, found, err := scrapeInFlight(admin, a); v != limit || !found || err != nil {
		t.Errorf("A's in_flight gauge: %v (found %v, error %v), want %d", v, found, err, limit)
	}

	// A renews its slots: past slot_ttl, the key is still full.
	time.Sleep(slotTTL + slotTTL/4)
	if r := probe(b); r.status != 429 {
		t.Fatalf("B %s after the key filled, A alive and holding: status %d, error %v; want 429 (A renews its slots every slot_ttl/3)", slotTTL+slotTTL/4, r.status, r.err)
	}
	if n := srv.do("ZCARD", keys[0]); n != int64(limit) {
		t.Fatalf("ZCARD %s = %v past slot_ttl with A alive, want %d", keys[0], n, limit)
	}
	if h := origin.held.Load(); h != limit {
		t.Fatalf("the origin holds %d requests before the kill, want %d", h, limit)
	}

	// kill -9 A, and poll B every 50 ms.
	killed := time.Now()
	if err := procA.Kill(); err != nil {
		t.Fatalf("kill -9 A: %v", err)
	}
	var firstStatus, polls int
	var back time.Duration
	for {
		r := probe(b)
		polls++
		if polls == 1 {
			firstStatus = r.status
		}
		if r.status == 200 {
			back = time.Since(killed)
			break
		}
		if r.status != 429 {
			t.Fatalf("B after the kill: status %d, error %v; want 429 then 200", r.status, r.err)
		}
		if time.Since(killed) > 10*time.Second {
			t.Fatalf("B still refuses the key 10 s after A was killed (slot_ttl %s); slot sets %q", slotTTL, slotKeys(srv))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("A killed holding %d slots (slot_ttl %s): B admitted the key after %s (%d polls, the first answered %d)", limit, slotTTL, back.Round(time.Millisecond), polls, firstStatus)
	if back > slotTTL+time.Second {
		t.Errorf("the slots of the killed node came back after %s, want within slot_ttl + 1 s = %s", back.Round(time.Millisecond), slotTTL+time.Second)
	}
	if firstStatus != 429 {
		t.Errorf("the first request through B after the kill: %d, want 429: the killed node's slots live until they expire", firstStatus)
	}

	// The killed node's client requests fail; the origin lets go of them.
	wg.Wait()
	for i, l := range longs {
		if l.status != 0 {
			t.Errorf("long request %d through the killed node: status %d, want a transport error", i, l.status)
		}
	}
	waitFor(t, 5*time.Second, "the origin to let go of A's requests", func() bool { return origin.held.Load() == 0 })
	waitFor(t, 2*time.Second, "no slot set left in Redis", func() bool { return len(slotKeys(srv)) == 0 })
	if v, found, err := scrapeInFlight(admin, b); v != 0 || !found || err != nil {
		t.Errorf("B's in_flight gauge: %v (found %v, error %v), want 0", v, found, err)
	}
}

// TestConcurrencyHangUpsLeaveNothingBehind sends 10,000 requests of 50
// keys, concurrency 5 each, through Caddy in this process on the Redis
// store, to an origin that holds each 0-20 ms; a tenth of the clients hang
// up after a few milliseconds. Afterwards the in_flight gauge reads 0 and
// Redis holds no slot set.
func TestConcurrencyHangUpsLeaveNothingBehind(t *testing.T) {
	skipUnderShort(t, "real-process")
	const (
		requests = 10_000
		keys     = 50
		limit    = 5
		workers  = 300 // 6 clients a key, for 5 slots
		policy   = "conc_hangups"
		tier     = "all"
	)
	origin := startHeldOrigin(t, 0)
	srv := startRedis(t)
	s := serve(t, fmt.Sprintf(`
	bind 127.0.0.1
	rate_limit {
		name %s
		key header X-Key
		tier %s {
			concurrency %d
		}
		store redis {
			address %s
			timeout 2s
			slot_ttl 30s
		}
	}
	reverse_proxy %s`, policy, tier, limit, srv.url(), origin.addr()))
	transport := &http.Transport{MaxIdleConnsPerHost: workers}
	client := &http.Client{Transport: transport, Timeout: 10 * time.Second}
	t.Cleanup(transport.CloseIdleConnections)
	if a := concGet(context.Background(), client, s.base+"/", "warm-up", "X-Hold-Ms", "0"); a.status != 200 {
		t.Fatalf("warm-up: %d %v", a.status, a.err)
	}
	storeErrorsBefore := storeErrorCount(t)

	var next atomic.Int64
	var hungUp, ok, refused, other atomic.Int64
	var otherSample sync.Map
	var wg sync.WaitGroup
	began := time.Now()
	for range workers {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= requests {
					return
				}
				key := "client-" + strconv.Itoa(int(i%keys))
				hold := strconv.Itoa(rand.IntN(21))
				ctx, cancel := context.WithCancel(context.Background())
				hangUp := rand.IntN(10) == 0
				var timer *time.Timer
				if hangUp {
					timer = time.AfterFunc(time.Duration(1+rand.IntN(5))*time.Millisecond, cancel)
				}
				a := concGet(ctx, client, s.base+"/", key, "X-Hold-Ms", hold)
				if timer != nil {
					timer.Stop()
				}
				cancel()
				switch {
				case hangUp && errors.Is(a.err, context.Canceled):
					hungUp.Add(1)
				case a.status == 200 && a.err == nil:
					ok.Add(1)
				case a.status == 429 && a.retryAfter == "1":
					refused.Add(1)
				default:
					other.Add(1)
					otherSample.Store(fmt.Sprintf("status %d, Retry-After %q, error %v", a.status, a.retryAfter, a.err), true)
				}
			}
		})
	}
	wg.Wait()
	took := time.Since(began)
	t.Logf("%d requests of %d keys in %s: %d allowed, %d refused (429), %d hung up, %d other; origin held at most %d at once, %d of one key (a hung-up request may linger at the origin after its slot is freed); store errors %.0f (clients that hung up while their slot was asked of Redis)",
		requests, keys, took.Round(time.Millisecond), ok.Load(), refused.Load(), hungUp.Load(), other.Load(), origin.max.Load(), origin.maxOfOneKey(), storeErrorCount(t)-storeErrorsBefore)
	if other.Load() > 0 {
		var samples []string
		otherSample.Range(func(k, _ any) bool { samples = append(samples, k.(string)); return len(samples) < 10 })
		t.Errorf("%d requests neither allowed, refused with Retry-After: 1, nor hung up:\n%s", other.Load(), strings.Join(samples, "\n"))
	}
	if m := origin.max.Load(); m > keys*limit {
		t.Errorf("the origin held %d requests at once, want at most %d keys x %d", m, keys, limit)
	}
	if hungUp.Load() == 0 {
		t.Errorf("no client hung up: the test tested nothing")
	}

	end := time.Now()
	var gauge float64
	var left []string
	for {
		gauge, left = inFlightNow(t, policy, tier), slotKeys(srv)
		if gauge == 0 && len(left) == 0 || time.Since(end) > 2*time.Second {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if gauge != 0 || len(left) != 0 {
		var sets []string
		for _, k := range left {
			members, _ := srv.do("ZRANGE", k, 0, -1, "WITHSCORES").([]any)
			sets = append(sets, fmt.Sprintf("%s: %v", k, members))
		}
		t.Errorf("2 s after the last answer: in_flight gauge %v (want 0); %d slot sets left in Redis (want none), redis TIME %v:\n%s",
			gauge, len(left), srv.do("TIME"), strings.Join(sets, "\n"))
	} else {
		t.Logf("clean %s after the last answer: gauge 0, no slot set in Redis", time.Since(end).Round(time.Millisecond))
	}
}

// storeErrorCount is this process's store errors counter for the Redis store.
func storeErrorCount(t *testing.T) float64 {
	t.Helper()
	var m dto.Metric
	if err := storeErrorsTotal.WithLabelValues("redis").Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}
