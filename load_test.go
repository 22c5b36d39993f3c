package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// loadDuration is how long TestLoadThroughCaddyAndRedis sends traffic: 10 s
// in CI, or RATELIMIT_LOAD_SECONDS for a soak.
func loadDuration(t *testing.T) time.Duration {
	s := os.Getenv("RATELIMIT_LOAD_SECONDS")
	if s == "" {
		return 10 * time.Second
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 1 {
		t.Fatalf("RATELIMIT_LOAD_SECONDS=%q: want a whole number of seconds", s)
	}
	return time.Duration(n) * time.Second
}

// runtimeFigures is what Caddy's admin API says about its process, after a
// garbage collection.
type runtimeFigures struct {
	heapAlloc, heapInuse uint64
	goroutines           int
}

func readRuntime(t *testing.T, admin string) runtimeFigures {
	t.Helper()
	get := func(path string) []byte {
		resp, err := http.Get(admin + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("GET %s: %d %v", path, resp.StatusCode, err)
		}
		return b
	}
	// The heap profile's gc=1 runs a collection first, so the figures that
	// follow are of the live heap, not of garbage not yet collected.
	get("/debug/pprof/heap?gc=1")
	var vars struct {
		Memstats struct{ HeapAlloc, HeapInuse uint64 } `json:"memstats"`
	}
	if err := json.Unmarshal(get("/debug/vars"), &vars); err != nil {
		t.Fatal(err)
	}
	first, _, _ := strings.Cut(string(get("/debug/pprof/goroutine?debug=1")), "\n")
	n, err := strconv.Atoi(strings.TrimPrefix(first, "goroutine profile: total "))
	if err != nil {
		t.Fatalf("goroutine profile starts %q", first)
	}
	return runtimeFigures{vars.Memstats.HeapAlloc, vars.Memstats.HeapInuse, n}
}

// keyCount is what one client sent and got.
type keyCount struct{ sent, allowed, denied atomic.Int64 }

// TestLoadThroughCaddyAndRedis sends mixed traffic through a real Caddy
// process with the Redis store: thousands of clients of two tiers, some
// sending a few requests and a few flooding. Every bucket refills at 1/h,
// so every client's admissions are exactly min(sent, capacity): the test
// checks that for every client, not a sample. There is no 5xx, and Caddy's
// live heap and goroutines, through its admin API, do not grow.
func TestLoadThroughCaddyAndRedis(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "load")
	duration := loadDuration(t)
	srv := startRedis(t)
	port, adminPort := freePort(t), freePort(t)
	admin := fmt.Sprintf("http://127.0.0.1:%d", adminPort)
	startCaddyProcess(t, port, fmt.Sprintf(`{
	admin 127.0.0.1:%d
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
	handle /ready {
		respond "ready"
	}
	rate_limit 5 1/h {
		name load
		key header X-API-Key
		tier gold 50 1/h {
			match {
				header X-Plan gold
			}
		}
		tier bulk 20 1/h {
			match {
				path /bulk/*
			}
			cost 4
		}
		store redis {
			address %s
			timeout 2s
		}
	}
	respond "ok"
}
`, adminPort, port, srv.url()))

	const (
		workers  = 16
		plain    = 3000 // default tier: 5, 1/h
		gold     = 300  // gold tier: 50, 1/h
		bulk     = 300  // bulk tier: 20 tokens at 4 a request, 1/h
		flooders = 4    // default-tier clients that never stop, besides one gold
	)
	type client struct {
		key, path string
		gold      bool
		allowed   int64 // exactly this many of its requests may pass
		count     keyCount
	}
	var clients []*client
	for i := range plain {
		clients = append(clients, &client{key: "plain-" + strconv.Itoa(i), path: "/", allowed: 5})
	}
	for i := range gold {
		clients = append(clients, &client{key: "gold-" + strconv.Itoa(i), path: "/", gold: true, allowed: 50})
	}
	for i := range bulk {
		clients = append(clients, &client{key: "bulk-" + strconv.Itoa(i), path: "/bulk/x", allowed: 5})
	}
	// The first plain clients flood, and so does one gold client.
	flood := append(clients[:flooders:flooders], clients[plain])

	transport := &http.Transport{MaxIdleConnsPerHost: workers}
	hc := &http.Client{Transport: transport, Timeout: 10 * time.Second}
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	send := func(c *client) (int, error) {
		req, _ := http.NewRequest(http.MethodGet, base+c.path, nil)
		req.Header.Set("X-API-Key", c.key)
		if c.gold {
			req.Header.Set("X-Plan", "gold")
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}

	// Warm up: the process's pools, Redis connections and the script, then
	// a baseline with this client's connections closed.
	warm := &client{key: "warm-up", path: "/"}
	for range 50 {
		if _, err := send(warm); err != nil {
			t.Fatal(err)
		}
	}
	transport.CloseIdleConnections()
	before := readRuntime(t, admin)

	var (
		total, errorsSeen, fivexx, other atomic.Int64
		firstProblem                     atomic.Value
	)
	deadline := time.Now().Add(duration)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for time.Now().Before(deadline) {
				var c *client
				if rng.IntN(4) == 0 {
					c = flood[rng.IntN(len(flood))]
				} else {
					c = clients[rng.IntN(len(clients))]
				}
				status, err := send(c)
				total.Add(1)
				c.count.sent.Add(1)
				switch {
				case err != nil:
					errorsSeen.Add(1)
					firstProblem.CompareAndSwap(nil, err.Error())
				case status == 200:
					c.count.allowed.Add(1)
				case status == 429:
					c.count.denied.Add(1)
				case status >= 500:
					fivexx.Add(1)
					firstProblem.CompareAndSwap(nil, "status "+strconv.Itoa(status))
				default:
					other.Add(1)
					firstProblem.CompareAndSwap(nil, "status "+strconv.Itoa(status))
				}
			}
		})
	}
	wg.Wait()
	transport.CloseIdleConnections()

	// Once the server has seen this client's connections close, its
	// goroutines must be back to where they were.
	var after runtimeFigures
	waitFor(t, 15*time.Second, "Caddy's goroutines to settle", func() bool {
		after = readRuntime(t, admin)
		return after.goroutines <= before.goroutines+5
	})

	t.Logf("%d requests in %s (%.0f/s): %d transport errors, %d 5xx, %d other",
		total.Load(), duration, float64(total.Load())/duration.Seconds(), errorsSeen.Load(), fivexx.Load(), other.Load())
	t.Logf("Caddy heap after GC: HeapAlloc %d KiB -> %d KiB, HeapInuse %d KiB -> %d KiB; goroutines %d -> %d",
		before.heapAlloc>>10, after.heapAlloc>>10, before.heapInuse>>10, after.heapInuse>>10, before.goroutines, after.goroutines)
	if errorsSeen.Load() != 0 || fivexx.Load() != 0 || other.Load() != 0 {
		t.Fatalf("%d transport errors, %d 5xx, %d other statuses; first: %v", errorsSeen.Load(), fivexx.Load(), other.Load(), firstProblem.Load())
	}

	// Every client got exactly min(sent, capacity/cost).
	var sampled []string
	// Besides the clients: the warm-up client's bucket, and the bucket of
	// startCaddyProcess's readiness probe, keyed by its IP.
	wrong, buckets := 0, int64(2)
	for _, c := range clients {
		sent, allowed := c.count.sent.Load(), c.count.allowed.Load()
		if sent == 0 {
			continue
		}
		buckets++
		want := min(sent, c.allowed)
		if allowed != want || allowed+c.count.denied.Load() != sent {
			wrong++
			if wrong <= 5 {
				t.Errorf("client %s: sent %d, allowed %d, denied %d; want exactly %d allowed", c.key, sent, allowed, c.count.denied.Load(), want)
			}
		}
	}
	for _, c := range []*client{clients[0], clients[1], clients[flooders], clients[plain], clients[plain+1], clients[plain+gold], clients[plain+gold+1]} {
		sampled = append(sampled, fmt.Sprintf("%s sent %d allowed %d (want %d)", c.key, c.count.sent.Load(), c.count.allowed.Load(), min(c.count.sent.Load(), c.allowed)))
	}
	t.Logf("sampled clients: %s", strings.Join(sampled, "; "))
	if wrong > 0 {
		t.Fatalf("%d of %d clients were not limited exactly", wrong, len(clients))
	}
	// One Redis key per client that was allowed once, none naming it.
	if n := srv.do("DBSIZE").(int64); n != buckets {
		t.Fatalf("%d keys in Redis, want one per client that sent: %d", n, buckets)
	}
	keys, _ := srv.do("KEYS", "*").([]any)
	for _, k := range keys {
		if s := fmt.Sprint(k); strings.Contains(s, "plain-") || strings.Contains(s, "gold-") || strings.Contains(s, "bulk-") {
			t.Fatalf("Redis key %q names the client", s)
		}
	}

	if after.heapAlloc > 2*before.heapAlloc+16<<20 {
		t.Fatalf("Caddy's live heap grew from %d to %d bytes", before.heapAlloc, after.heapAlloc)
	}
	if after.goroutines > before.goroutines+5 {
		t.Fatalf("Caddy's goroutines grew from %d to %d", before.goroutines, after.goroutines)
	}
}
