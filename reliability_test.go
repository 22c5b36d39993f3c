package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"

	"github.com/caddyserver/caddy/v2"
)

// Faults: Redis killed, restarted, paused and slowed under load; Caddy
// reloaded under load; a Cluster primary failing over; and the clocks the
// stores read.

// trafficStats counts what background traffic got.
type trafficStats struct {
	sent, ok, limited, unavailable, other atomic.Int64
	slowest                               atomic.Int64 // nanoseconds
	firstOther                            atomic.Value
}

func (st *trafficStats) record(status int, took time.Duration) {
	st.sent.Add(1)
	for {
		old := st.slowest.Load()
		if int64(took) <= old || st.slowest.CompareAndSwap(old, int64(took)) {
			break
		}
	}
	switch status {
	case 200:
		st.ok.Add(1)
	case 429:
		st.limited.Add(1)
	case 503:
		st.unavailable.Add(1)
	default:
		st.other.Add(1)
		st.firstOther.CompareAndSwap(nil, status)
	}
}

// trafficClient is a client that reports a transport error as status 0
// instead of failing the test from another goroutine.
func trafficClient(timeout time.Duration) *http.Client {
	return &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}, Timeout: timeout}
}

// lastTransportError keeps the latest transport error, for the report.
var lastTransportError atomic.Value

func getFrom(c *http.Client, base, ip string) int {
	req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
	req.Header.Set("X-Forwarded-For", ip)
	resp, err := c.Do(req)
	if err != nil {
		lastTransportError.Store(err.Error())
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// backgroundTraffic sends requests from many clients on n goroutines until
// the returned stop is called.
func backgroundTraffic(c *http.Client, base string, n int, st *trafficStats) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range n {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				start := time.Now()
				status := getFrom(c, base, fmt.Sprintf("127.0.%d.%d", 10+w, i%250+1))
				st.record(status, time.Since(start))
			}
		})
	}
	return func() { close(done); wg.Wait() }
}

// burst sends n concurrent requests as one client and counts the statuses.
func burst(c *http.Client, base, ip string, n int) map[int]int {
	var mu sync.Mutex
	got := map[int]int{}
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			status := getFrom(c, base, ip)
			mu.Lock()
			got[status]++
			mu.Unlock()
		})
	}
	wg.Wait()
	return got
}

// TestRedisKilledAndRestartedUnderConcurrentLoad is TestRedisDownModes with
// eight clients sending at once: while Redis is killed and restarted, in
// each on_store_error mode, no request fails (no transport error, no 5xx
// but deny's 503), and a concurrent burst from one client is limited
// exactly before, during (local) and after the outage.
func TestRedisKilledAndRestartedUnderConcurrentLoad(t *testing.T) {
	skipUnderShort(t, "fault injection under load")
	// Long enough that no decision times out while Redis is up, even
	// under -race on two cores: a timeout would send it to on_store_error,
	// and the bursts below would not be exact. A killed Redis refuses
	// connections at once, so the outage is not slowed by it.
	const timeout = time.Second
	for _, mode := range []string{"local", "allow", "deny"} {
		t.Run(mode, func(t *testing.T) {
			srv := startRedis(t)
			s := serveOnRedis(t, srv, timeout, mode)
			var st trafficStats
			c := trafficClient(10 * time.Second)
			stop := backgroundTraffic(c, s.base, 8, &st)

			exact := func(phase, ip string) {
				t.Helper()
				if got := burst(c, s.base, ip, 12); got[200] != 3 || got[429] != 9 {
					t.Fatalf("%s: 12 concurrent requests from one client got %v, want exactly 3 200s and 9 429s", phase, got)
				}
			}
			exact("Redis up", "127.0.4.1")

			srv.kill()
			time.Sleep(300 * time.Millisecond) // traffic flows against a dead Redis
			got := burst(c, s.base, "127.0.4.2", 12)
			switch mode {
			case "local":
				if got[200] != 3 || got[429] != 9 {
					t.Fatalf("Redis killed: a burst got %v, want the local limit: 3 200s, 9 429s", got)
				}
			case "allow":
				if got[200] != 12 {
					t.Fatalf("Redis killed: a burst got %v, want 12 200s", got)
				}
			case "deny":
				if got[503] != 12 {
					t.Fatalf("Redis killed: a burst got %v, want 12 503s", got)
				}
			}

			srv.start()
			waitFor(t, 10*time.Second, "Redis to hold buckets again", func() bool {
				return srv.do("DBSIZE").(int64) > 0
			})
			// The breaker may still be letting single probes through;
			// wait until a request from a new client is answered by Redis.
			waitFor(t, 10*time.Second, "the breaker to close", func() bool {
				before := srv.do("DBSIZE").(int64)
				getFrom(c, s.base, "127.0.5."+strconv.Itoa(int(before%250)+1))
				return srv.do("DBSIZE").(int64) > before
			})
			exact("Redis restarted", "127.0.4.3")
			stop()

			t.Logf("%s: %d background requests: %d 200, %d 429, %d 503, %d other; slowest %s",
				mode, st.sent.Load(), st.ok.Load(), st.limited.Load(), st.unavailable.Load(), st.other.Load(), time.Duration(st.slowest.Load()))
			if st.other.Load() != 0 {
				t.Fatalf("%d requests failed (first: status %v; 0 is a transport error)", st.other.Load(), st.firstOther.Load())
			}
			if mode != "deny" && st.unavailable.Load() != 0 {
				t.Fatalf("%d 503s in mode %s", st.unavailable.Load(), mode)
			}
			// Under -race on two cores, eight senders queue behind each
			// other; the timeout itself is checked one request at a time
			// in TestSlowRedisTimesOutAndOpensTheBreaker.
			if slowest := time.Duration(st.slowest.Load()); slowest > timeout+2*time.Second {
				t.Fatalf("slowest request %s, timeout %s", slowest, timeout)
			}
		})
	}
}

// TestSlowRedisTimesOutAndOpensTheBreaker makes Redis slow in two ways,
// CLIENT PAUSE and DEBUG SLEEP, with requests flowing one at a time through
// Caddy. No request waits past the timeout (plus 250 ms for scheduling);
// after the breaker's threshold of timeouts, requests no longer wait at all;
// and once Redis answers again, the store uses it again.
func TestSlowRedisTimesOutAndOpensTheBreaker(t *testing.T) {
	skipUnderShort(t, "fault injection")
	const timeout = 100 * time.Millisecond
	for _, c := range []struct {
		name string
		slow func(srv *redisServer)
	}{
		{"CLIENT PAUSE", func(srv *redisServer) { srv.do("CLIENT", "PAUSE", 1500, "ALL") }},
		{"DEBUG SLEEP", func(srv *redisServer) {
			// DEBUG SLEEP blocks the connection that sends it too.
			go func() {
				cl := srv.client()
				defer cl.Close()
				_ = cl.Do(context.Background(), "DEBUG", "SLEEP", "1.5").Err()
			}()
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			srv := startRedis(t, "--enable-debug-command", "yes")
			s := serve(t, fmt.Sprintf(`
	rate_limit 1000 1/h {
		store redis {
			address %s
			timeout %s
		}
	}
	respond "ok"`, srv.url(), timeout))
			waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
				v, _ := srv.do("SCRIPT", "EXISTS", redisbucket.ScriptHash()).([]any)
				return len(v) == 1 && v[0] == int64(1)
			})
			if r := s.from("127.0.6.1", "/"); r.status != 200 {
				t.Fatalf("before: %d", r.status)
			}
			c.slow(srv)
			time.Sleep(20 * time.Millisecond) // let the pause or sleep begin

			// One request at a time for 1 s, each from a new client so
			// that no deny cache answers.
			var took []time.Duration
			end := time.Now().Add(time.Second)
			for i := 0; time.Now().Before(end); i++ {
				start := time.Now()
				r := s.from("127.0.7."+strconv.Itoa(i%250+1), "/")
				d := time.Since(start)
				took = append(took, d)
				if r.status != 200 {
					t.Fatalf("request %d: status %d, want 200 from the local fallback", i+1, r.status)
				}
				if d > timeout+250*time.Millisecond {
					t.Fatalf("request %d took %s, timeout %s", i+1, d, timeout)
				}
			}
			// The first requests wait for the timeout; after the
			// breaker's threshold, none does.
			slow := 0
			for _, d := range took {
				if d >= timeout*8/10 {
					slow++
				}
			}
			// The last 10 say whether the breaker is open: their median,
			// not one request that a loaded machine may pause (50 ms was
			// seen with three suites on two cores).
			if len(took) < slow+10 {
				t.Fatalf("%d requests, %d of them slow: the breaker did not make them fast", len(took), slow)
			}
			last := slices.Clone(took[len(took)-10:])
			slices.Sort(last)
			t.Logf("%d requests during the slowdown: %d waited for the timeout, the rest took at most %s each (median of the last 10 %s)",
				len(took), slow, fastest(took, timeout), last[5])
			if slow < redisbucket.DefaultBreakerFailures || slow > redisbucket.DefaultBreakerFailures+1 {
				t.Fatalf("%d requests waited for the timeout, want the breaker's threshold %d (+1 probe at most)", slow, redisbucket.DefaultBreakerFailures)
			}
			if last[5] > timeout/2 {
				t.Fatalf("the last 10 requests took %v: the breaker did not make them fast", last)
			}
			// Redis is back within 1.5 s; after the cool-down a probe
			// closes the breaker, and buckets are written again.
			waitFor(t, 10*time.Second, "Redis to take decisions again", func() bool {
				before := srv.do("DBSIZE").(int64)
				s.from("127.0.8."+strconv.Itoa(int(before%250)+1), "/")
				return srv.do("DBSIZE").(int64) > before
			})
		})
	}
}

// fastest is the slowest of the requests that did not wait for the timeout.
func fastest(took []time.Duration, timeout time.Duration) time.Duration {
	var m time.Duration
	for _, d := range took {
		if d < timeout*8/10 {
			m = max(m, d)
		}
	}
	return m
}

// TestReloadUnderLoadKeepsBucketsAndFailsNoRequest reloads a changed config
// five times while eight goroutines send requests: no request fails, and
// local buckets carry across: an exhausted client stays denied, and one
// that spent part of its bucket gets exactly the rest.
func TestReloadUnderLoadKeepsBucketsAndFailsNoRequest(t *testing.T) {
	skipUnderShort(t, "load")
	port := freePort(t)
	caddyfile := func(body string) string {
		return fmt.Sprintf(`{
	admin off
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
	rate_limit 3 1/h {
		name reload
	}
	respond %q
}
`, port, body)
	}
	s := serveCaddyfile(t, port, caddyfile("config 0"))
	for range 3 {
		s.from("127.0.9.1", "/") // exhausted
	}
	s.from("127.0.9.2", "/") // one of three spent

	// Caddy on Linux opens each config's listener with SO_REUSEPORT and
	// closes the old one when the old config stops: connections still in
	// the old socket's accept queue are reset by the kernel, and those the
	// old server accepted but had read nothing from are closed. Clients
	// see a few transport errors per reload on GETs that the server never
	// read, which HTTP lets them retry. The limiter can neither see nor
	// cause these; the test retries them, counts them, and requires that
	// every request is answered, none with a 5xx.
	retried := new(atomic.Int64)
	c := &http.Client{Transport: retryTransport{http.DefaultTransport, retried}, Timeout: 10 * time.Second}
	var st trafficStats
	stop := backgroundTraffic(c, s.base, 8, &st)
	for i := 1; i <= 5; i++ {
		time.Sleep(100 * time.Millisecond)
		cfg, err := adaptCaddyfile(caddyfile("config " + strconv.Itoa(i)))
		if err != nil {
			t.Fatal(err)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("reload %d: %v", i, err)
		}
		if status := getFrom(c, s.base, "127.0.9.1"); status != 429 {
			t.Fatalf("after reload %d: the exhausted client got %d, want 429", i, status)
		}
	}
	time.Sleep(100 * time.Millisecond)
	stop()
	s.client.Transport.(*http.Transport).CloseIdleConnections()
	if r := s.get("/"); r.body != "config 5" {
		t.Fatalf("the last config is not in effect: %q", r.body)
	}
	for i, want := range []int{200, 200, 429} {
		if status := getFrom(c, s.base, "127.0.9.2"); status != want {
			t.Fatalf("the client that spent one token, request %d after the reloads: %d, want %d", i+1, status, want)
		}
	}
	t.Logf("%d requests during 5 reloads: %d 200, %d 429, %d failed; %d transport errors retried",
		st.sent.Load(), st.ok.Load(), st.limited.Load(), st.other.Load()+st.unavailable.Load(), retried.Load())
	if st.other.Load() != 0 || st.unavailable.Load() != 0 {
		t.Fatalf("%d requests failed during reloads (first: status %v; 0 is a transport error: %v)", st.other.Load()+st.unavailable.Load(), st.firstOther.Load(), lastTransportError.Load())
	}
}

// retryTransport retries a GET that failed before any response, up to
// three times, and counts the retries.
type retryTransport struct {
	base    http.RoundTripper
	retries *atomic.Int64
}

func (rt retryTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	for attempt := 0; ; attempt++ {
		resp, err := rt.base.RoundTrip(req)
		if err == nil || req.Method != http.MethodGet || attempt == 3 {
			return resp, err
		}
		rt.retries.Add(1)
	}
}

// TestRedisClusterFailoverKeepsLimiting adds a replica to one master of a
// three-master cluster, empties buckets on that master, and fails it over
// with CLUSTER FAILOVER on the replica: the buckets emptied before stay
// empty, and new clients on those slots are limited exactly.
func TestRedisClusterFailoverKeepsLimiting(t *testing.T) {
	skipUnderShort(t, "fault injection")
	nodes := startCluster(t, 3)
	master := nodes[0]
	replica := startRedisOn(t, clusterPort(t), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
	replica.do("CLUSTER", "MEET", "127.0.0.1", master.Port)
	masterID := master.do("CLUSTER", "MYID").(string)
	waitFor(t, 15*time.Second, "the new node to join", func() bool {
		nodesText, _ := replica.do("CLUSTER", "NODES").(string)
		return strings.Contains(nodesText, masterID)
	})
	master.do("CONFIG", "SET", "repl-diskless-sync-delay", "0")
	waitFor(t, 15*time.Second, "CLUSTER REPLICATE to be accepted", func() bool {
		c := replica.client()
		defer c.Close()
		return c.Do(context.Background(), "CLUSTER", "REPLICATE", masterID).Err() == nil
	})
	waitFor(t, 20*time.Second, "the replica to sync", func() bool {
		return replica.info("replication", "master_link_status") == "up"
	})
	// A manual failover needs the master to know the replica as its own,
	// which it learns by gossip.
	replicaID := replica.do("CLUSTER", "MYID").(string)
	waitFor(t, 20*time.Second, "every node to know the replica", func() bool {
		for _, n := range nodes {
			text, _ := n.do("CLUSTER", "NODES").(string)
			if !strings.Contains(text, replicaID) || !strings.Contains(text, "slave "+masterID) {
				return false
			}
		}
		return true
	})

	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.url())
	}
	s := newRedisStoreFor(t, &RedisStore{Addresses: addrs, Timeout: caddy.Duration(2 * time.Second)})

	// Clients whose buckets live on the master that will fail.
	var onMaster []*Bucket
	for i := 0; len(onMaster) < 5; i++ {
		b := bucketFor("failover-" + strconv.Itoa(i))
		for n := range 4 {
			res, err := takeLimit(bg, s, b, slowLimit(3), 1)
			if err != nil {
				t.Fatal(err)
			}
			if res.Allowed != (n < 3) {
				t.Fatalf("take %d: %+v", n+1, res)
			}
		}
		if holdsKey(master, s.keyOf(b)) {
			onMaster = append(onMaster, b)
		}
	}
	if n := master.do("WAIT", 1, 2000).(int64); n != 1 {
		t.Fatalf("WAIT: %d replicas acknowledged, want 1", n)
	}

	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range []*redisServer{replica, master} {
				log := n.Log()
				t.Logf("%s log:\n%s", n.addr(), log[max(0, len(log)-1500):])
			}
		}
	})
	// A manual failover gives up after 5 s when the other masters' votes
	// come late, as they can on a loaded machine; an operator asks again.
	promoted := func() bool {
		return replica.info("replication", "role") == "master" && master.info("replication", "role") == "slave"
	}
	for attempt := 1; !promoted(); attempt++ {
		if attempt > 3 {
			t.Fatal("the replica did not become master after 3 manual failovers")
		}
		c := replica.client()
		if err := c.Do(bg, "CLUSTER", "FAILOVER").Err(); err != nil {
			t.Logf("CLUSTER FAILOVER, attempt %d: %v", attempt, err)
		}
		c.Close()
		for deadline := time.Now().Add(12 * time.Second); !promoted() && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
		}
	}

	// The store follows the MOVED redirections to the new master.
	waitFor(t, 20*time.Second, "the store to reach the new master", func() bool {
		_, err := peekLimit(bg, s, onMaster[0], slowLimit(3))
		return err == nil
	})
	for i, b := range onMaster {
		res, err := takeLimit(bg, s, b, slowLimit(3), 1)
		if err != nil || res.Allowed {
			t.Fatalf("client %d, emptied before the failover: %+v, %v; want denied", i, res, err)
		}
		if !holdsKey(replica, s.keyOf(b)) {
			t.Fatalf("client %d's bucket is not on the new master", i)
		}
	}
	// New clients on the new master's slots get exactly the capacity.
	fresh := 0
	for i := 0; fresh < 5; i++ {
		b := bucketFor("after-" + strconv.Itoa(i))
		allowed := 0
		for range 5 {
			res, err := takeLimit(bg, s, b, slowLimit(3), 1)
			if err != nil {
				t.Fatal(err)
			}
			if res.Allowed {
				allowed++
			}
		}
		if allowed != 3 {
			t.Fatalf("client after-%d: %d allowed, want 3", i, allowed)
		}
		if holdsKey(replica, s.keyOf(b)) {
			fresh++
		}
	}
}

// holdsKey reports whether a cluster node holds the key itself (a node
// that does not own the key's slot answers MOVED).
func holdsKey(node *redisServer, key string) bool {
	c := node.client()
	defer c.Close()
	n, err := c.Exists(context.Background(), key).Result()
	return err == nil && n == 1
}

// TestLocalStoreReadsOnlyTheMonotonicClock shows by construction that a
// jump of the wall clock cannot reach local buckets: the tables read
// localClock, which is monotonicMicros, which is time.Since of a reading
// that carries the monotonic clock, and Go computes time.Since from the
// monotonic readings alone when both times carry one. A test cannot jump
// this machine's wall clock (that needs root and disturbs everything else
// on it), so this checks the construction.
func TestLocalStoreReadsOnlyTheMonotonicClock(t *testing.T) {
	if reflect.ValueOf(localClock).Pointer() != reflect.ValueOf(monotonicMicros).Pointer() {
		t.Fatal("local bucket tables do not read monotonicMicros")
	}
	if !strings.Contains(processStart.String(), " m=") {
		t.Fatalf("processStart %s carries no monotonic reading", processStart)
	}
	if reflect.ValueOf(localOptions(10).Now).Pointer() != reflect.ValueOf(monotonicMicros).Pointer() {
		t.Fatal("a new table does not read the monotonic clock")
	}
	// The clock never goes back, and starts above 0, where the zero State
	// (a full bucket) lies.
	prev := monotonicMicros()
	if prev < 1 {
		t.Fatalf("monotonicMicros() = %d, want at least 1", prev)
	}
	for range 100_000 {
		now := monotonicMicros()
		if now < prev {
			t.Fatalf("monotonicMicros went back from %d to %d", prev, now)
		}
		prev = now
	}
}
