package ratelimit

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// The measured claims of docs/fleet.md's "Sharing limits across edge nodes", on real processes: Caddy
// processes built from this checkout share one policy on one redis-server,
// reached through a faultProxy that delays each direction by wanDelay, as
// an edge PoP far from its Redis. Clients are named by X-Key, so the test
// chooses each request's bucket.

// wanDelay is the proxy's delay in each direction: a strict decision costs
// at least twice this.
const wanDelay = 20 * time.Millisecond

// fleetPolicy is the rate_limit every node of a fleet serves.
type fleetPolicy struct {
	capacity int
	refill   string // tokens per second, e.g. "50/s"
	lease    string // "10%" or "20"; "" is strict mode
	timeout  string // per decision
	more     string // more lines for the store block
	ban      string // the ban setting, "" for none
	key      string // the header that names the client, X-Key for ""
	fallback string // on_store_error, deny for ""
	// limits are the tier's limits after the first, each "<capacity>
	// <refill>" for a `limit` line, such as "100 1/m".
	limits []string
}

// refillPerSecond is the policy's refill as a rate.
func (p fleetPolicy) refillPerSecond(t *testing.T) float64 {
	t.Helper()
	n, ok := strings.CutSuffix(p.refill, "/s")
	r, err := strconv.ParseFloat(n, 64)
	if !ok || err != nil {
		t.Fatalf("refill %q: want <n>/s", p.refill)
	}
	return r
}

// leaseFleet is Caddy processes serving one policy on one Redis.
type leaseFleet struct {
	t     *testing.T
	redis *redisServer
	// proxy is the first node's way to Redis; nodes at the same delay
	// share one.
	proxy     *faultProxy
	nodes     []fleetNode
	transport *http.Transport
	client    *http.Client
}

type fleetNode struct {
	port, admin int
	proxy       *faultProxy // the node's way to Redis
}

func (n fleetNode) base() string      { return fmt.Sprintf("http://127.0.0.1:%d", n.port) }
func (n fleetNode) adminBase() string { return fmt.Sprintf("http://127.0.0.1:%d", n.admin) }

// startLeaseFleet starts a redis-server, a proxy to it with the given delay
// each way, and n Caddy processes serving p through the proxy.
func startLeaseFleet(t *testing.T, n int, delay time.Duration, p fleetPolicy) *leaseFleet {
	t.Helper()
	delays := make([]time.Duration, n)
	for i := range delays {
		delays[i] = delay
	}
	return startLeaseFleetAt(t, delays, p)
}

// startLeaseFleetAt is startLeaseFleet with a node for each delay: nodes
// at different distances from Redis, one proxy for each distance.
func startLeaseFleetAt(t *testing.T, delays []time.Duration, p fleetPolicy) *leaseFleet {
	t.Helper()
	f := newLeaseFleet(t, startRedis(t))
	proxies := map[time.Duration]*faultProxy{}
	for _, delay := range delays {
		if proxies[delay] == nil {
			proxies[delay] = startFaultProxy(t, f.redis.addr(), delay)
		}
		node := fleetNode{port: freePort(t), admin: freePort(t), proxy: proxies[delay]}
		f.nodes = append(f.nodes, node)
		startCaddyProcess(t, node.port, f.caddyfile(node, p))
	}
	f.proxy = f.nodes[0].proxy
	return f
}

// newLeaseFleet is a fleet of no nodes yet on the Redis redis, with the
// client that sends its requests.
func newLeaseFleet(t *testing.T, redis *redisServer) *leaseFleet {
	t.Helper()
	f := &leaseFleet{t: t, redis: redis}
	f.transport = &http.Transport{MaxIdleConnsPerHost: 128}
	f.client = &http.Client{Transport: f.transport, Timeout: 10 * time.Second}
	t.Cleanup(f.transport.CloseIdleConnections)
	return f
}

// caddyfile is one node's config: p on every path but /ready.
func (f *leaseFleet) caddyfile(node fleetNode, p fleetPolicy) string {
	return nodeCaddyfile(node, `@limited not path /ready
	`+p.rateLimit("fleet", "@limited", node.proxy.addr())+`
	respond "ok"`)
}

// nodeCaddyfile is a node's config: its admin API, and a site on its port
// that serves routes, and /ready outside them, so that neither
// startCaddyProcess nor a reload touches Redis.
func nodeCaddyfile(node fleetNode, routes string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
}
http://127.0.0.1:%d {
	handle /ready {
		respond "ready"
	}
	%s
}
`, node.admin, node.port, routes)
}

// rateLimit is p's rate_limit directive, the policy name, on the Redis at
// address, for the requests matcher names (all for "").
func (p fleetPolicy) rateLimit(name, matcher, address string) string {
	lease := ""
	if p.lease != "" {
		lease = "lease " + p.lease + "\n\t\t\tlease_ttl 1s"
	}
	ban := ""
	if p.ban != "" {
		ban = "ban " + p.ban
	}
	var limits strings.Builder
	for _, l := range p.limits {
		limits.WriteString("\n\t\tlimit " + l)
	}
	return fmt.Sprintf(`rate_limit %s %d %s {
		name %s
		key header %s
		store redis {
			address redis://%s
			timeout %s
			%s
			%s
		}
		on_store_error %s
		%s%s
	}`, matcher, p.capacity, p.refill, name, cmp.Or(p.key, "X-Key"), address, p.timeout, lease, p.more, cmp.Or(p.fallback, "deny"), ban, limits.String())
}

// reload loads p on every node through its admin API, forcing a reload
// even when the config is unchanged.
func (f *leaseFleet) reload(p fleetPolicy) {
	f.t.Helper()
	for i := range f.nodes {
		f.reloadNode(i, p)
	}
}

// reloadNode loads p on node i.
func (f *leaseFleet) reloadNode(i int, p fleetPolicy) {
	f.t.Helper()
	node := f.nodes[i]
	req, _ := http.NewRequest(http.MethodPost, node.adminBase()+"/load", strings.NewReader(f.caddyfile(node, p)))
	req.Header.Set("Content-Type", "text/caddyfile")
	req.Header.Set("Cache-Control", "must-revalidate")
	resp, err := f.client.Do(req)
	if err != nil {
		f.t.Fatalf("reloading node %d: %v", node.port, err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		f.t.Fatalf("reloading node %d: %d %s", node.port, resp.StatusCode, body)
	}
}

// answer is one request as the client saw it.
type answer struct {
	node   int
	sent   time.Time
	done   time.Time
	status int // 0: a transport error
	// retryAfter is the Retry-After header in seconds, 0 when absent.
	retryAfter int
}

func (o answer) took() time.Duration { return o.done.Sub(o.sent) }

// get sends one request for key to node i.
func (f *leaseFleet) get(i int, key string) answer { return f.getAt(i, "/", "X-Key", key) }

// getAt sends one request for path to node i, the client named by header.
func (f *leaseFleet) getAt(i int, path, header, value string) answer {
	req, _ := http.NewRequest(http.MethodGet, f.nodes[i].base()+path, nil)
	req.Header.Set(header, value)
	o := answer{node: i, sent: time.Now()}
	resp, err := f.client.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		o.status = resp.StatusCode
		o.retryAfter, _ = strconv.Atoi(resp.Header.Get("Retry-After"))
	}
	o.done = time.Now()
	return o
}

// paced sends requests for key at rate per second for d, round-robin over
// the nodes, each on its own goroutine, so that a slow answer does not
// hold back the next request. It returns them in the order sent.
func (f *leaseFleet) paced(key string, rate float64, d time.Duration) []answer {
	return f.pacedOn(nil, key, rate, d)
}

// pacedOn is paced over the nodes numbered in nodes, or all for nil.
func (f *leaseFleet) pacedOn(nodes []int, key string, rate float64, d time.Duration) []answer {
	return f.pacedWith(nodes, rate, d, func(i, _ int) answer { return f.get(i, key) })
}

// pacedWith is pacedOn with send making the nth request, to node i.
func (f *leaseFleet) pacedWith(nodes []int, rate float64, d time.Duration, send func(i, n int) answer) []answer {
	if nodes == nil {
		for i := range f.nodes {
			nodes = append(nodes, i)
		}
	}
	n := int(rate * d.Seconds())
	out := make([]answer, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		time.Sleep(time.Until(start.Add(time.Duration(float64(i) / rate * float64(time.Second)))))
		wg.Go(func() { out[i] = send(nodes[i%len(nodes)], i) })
	}
	wg.Wait()
	return out
}

// warmUp waits until every node has allowed a request, so that its
// connections to Redis are open and its scripts loaded: a cold start costs
// several round trips, which a short timeout would count as Redis down.
func (f *leaseFleet) warmUp() { f.warmUpOn("warm-up") }

// warmUpOn is warmUp with requests for key: a policy that a few warm-ups
// would exhaust needs a fresh key for each.
func (f *leaseFleet) warmUpOn(key string) {
	f.t.Helper()
	f.warmUpWith(func(i int) answer { return f.get(i, key) })
}

// warmUpWith is warmUp with send making each request, to node i.
func (f *leaseFleet) warmUpWith(send func(i int) answer) {
	f.t.Helper()
	for i, node := range f.nodes {
		waitFor(f.t, 10*time.Second, fmt.Sprintf("node %d to allow a request", node.port), func() bool {
			return send(i).status == 200
		})
	}
}

// scriptCalls counts the script calls Redis has run (EVALSHA and EVAL).
func (f *leaseFleet) scriptCalls() int { return scriptCalls(f.redis) }

// metric sums, over the nodes, the samples of a Prometheus metric whose
// labels contain label (any labels when label is "").
func (f *leaseFleet) metric(name, label string) float64 {
	f.t.Helper()
	var sum float64
	for i := range f.nodes {
		sum += f.nodeMetric(i, name, label)
	}
	return sum
}

// nodeMetric is metric on node i alone.
func (f *leaseFleet) nodeMetric(i int, name, label string) float64 {
	f.t.Helper()
	var sum float64
	text := f.adminGet(f.nodes[i], "/metrics")
	for line := range strings.SplitSeq(text, "\n") {
		rest, ok := strings.CutPrefix(line, name)
		if !ok || (rest != "" && rest[0] != '{' && rest[0] != ' ') || !strings.Contains(rest, label) {
			continue
		}
		fields := strings.Fields(rest)
		v, err := strconv.ParseFloat(fields[len(fields)-1], 64)
		if err == nil {
			sum += v
		}
	}
	return sum
}

// leaseCounts reads the lease counters of the fleet.
func (f *leaseFleet) leaseCounts() string {
	return fmt.Sprintf("leases granted %.0f, partial %.0f, refused %.0f; tokens returned %.0f",
		f.metric("caddy_http_rate_limit_leases_total", `result="granted"`),
		f.metric("caddy_http_rate_limit_leases_total", `result="partial"`),
		f.metric("caddy_http_rate_limit_leases_total", `result="refused"`),
		f.metric("caddy_http_rate_limit_lease_tokens_returned_total", ""))
}

// goroutines is the number of goroutines in a node's process.
func (f *leaseFleet) goroutines(node fleetNode) int {
	f.t.Helper()
	first, _, _ := strings.Cut(f.adminGet(node, "/debug/pprof/goroutine?debug=1"), "\n")
	n, err := strconv.Atoi(strings.TrimPrefix(first, "goroutine profile: total "))
	if err != nil {
		f.t.Fatalf("goroutine profile of node %d: %q", node.port, first)
	}
	return n
}

func (f *leaseFleet) adminGet(node fleetNode, path string) string {
	f.t.Helper()
	resp, err := f.client.Get(node.adminBase() + path)
	if err != nil {
		f.t.Fatalf("GET %s on node %d's admin API: %v", path, node.port, err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	if _, err := io.Copy(&b, bufio.NewReader(resp.Body)); err != nil || resp.StatusCode != 200 {
		f.t.Fatalf("GET %s on node %d's admin API: %d %v", path, node.port, resp.StatusCode, err)
	}
	return b.String()
}

// tally counts outcomes by status.
func tally(out []answer) map[int]int {
	m := map[int]int{}
	for _, o := range out {
		m[o.status]++
	}
	return m
}

// medianTook is the median time to answer of the outcomes that keep holds
// for, and how many there were.
func medianTook(out []answer, keep func(answer) bool) (time.Duration, int) {
	var ds []time.Duration
	for _, o := range out {
		if keep(o) {
			ds = append(ds, o.took())
		}
	}
	if len(ds) == 0 {
		return 0, 0
	}
	slices.Sort(ds)
	return ds[len(ds)/2], len(ds)
}

// span is the time from the first request sent to the last answer
// received, and to the last request sent.
func span(out []answer) (wall, sending time.Duration) {
	first, lastSent, lastDone := out[0].sent, out[0].sent, out[0].done
	for _, o := range out {
		if o.sent.Before(first) {
			first = o.sent
		}
		if o.sent.After(lastSent) {
			lastSent = o.sent
		}
		if o.done.After(lastDone) {
			lastDone = o.done
		}
	}
	return lastDone.Sub(first), lastSent.Sub(first)
}

// allowance is what strict mode admits at most over d: C + floor(r*d).
func allowance(p fleetPolicy, r float64, d time.Duration) int {
	return p.capacity + int(math.Floor(r*d.Seconds()))
}

// afterGiveBacks waits until leased tokens left unused have gone back to
// Redis (lease_ttl is 1s), so that the script calls counted include them.
func afterGiveBacks() { time.Sleep(1500 * time.Millisecond) }

// TestLeaseKeyUnderItsLimitIsDecidedLocally spreads one key under its limit
// (400 requests against a capacity of 1000) over 4 nodes, 20 ms each way
// from Redis, sent one after another and then paced at 200/s so that
// requests overlap: every request is allowed, the median answer takes
// under 5 ms (a strict decision takes 40), and Redis runs at most one
// script call for every two requests, give-backs included.
func TestLeaseKeyUnderItsLimitIsDecidedLocally(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	p := fleetPolicy{capacity: 1000, refill: "100/s", lease: "10%", timeout: "1s"}
	f := startLeaseFleet(t, 4, wanDelay, p)
	const requests = 400
	for _, tc := range []struct {
		name string
		send func(key string) []answer
	}{
		{"one after another", func(key string) []answer {
			out := make([]answer, requests)
			for i := range requests {
				out[i] = f.get(i%len(f.nodes), key)
			}
			return out
		}},
		{"paced at 200/s", func(key string) []answer { return f.paced(key, 200, 2*time.Second) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.scriptCalls()
			out := tc.send("under-limit-" + tc.name)
			calls := f.scriptCalls() - before
			afterGiveBacks()
			callsAll := f.scriptCalls() - before

			counts := tally(out)
			median, _ := medianTook(out, func(answer) bool { return true })
			wall, _ := span(out)
			t.Logf("%d requests over %d nodes in %s: statuses %v; median %s; script calls %d during the load, %d after lease_ttl; %s (fleet totals so far)",
				len(out), len(f.nodes), wall.Round(time.Millisecond), counts, median, calls, callsAll, f.leaseCounts())
			if counts[200] != len(out) {
				t.Errorf("statuses %v: want all %d allowed; not allowed: %s", counts, len(out), notAllowed(f, out))
			}
			if median >= 5*time.Millisecond {
				t.Errorf("median latency %s, want < 5ms", median)
			}
			if callsAll > len(out)/2 {
				t.Errorf("%d script calls for %d requests (give-backs included), want at most %d", callsAll, len(out), len(out)/2)
			}
		})
	}
}

// notAllowed describes the answers that were not 200.
func notAllowed(f *leaseFleet, out []answer) string {
	var s []string
	for _, o := range out {
		if o.status != 200 {
			s = append(s, fmt.Sprintf("%d on node %d, sent at %s, answered in %s",
				o.status, f.nodes[o.node].port, o.sent.Sub(out[0].sent).Round(time.Millisecond), o.took().Round(time.Millisecond)))
		}
	}
	return strings.Join(s, "; ")
}

// TestLeaseSharedKeyAtEightTimesItsRate floods one key at 8x its refill
// rate over 4 nodes for 4 s. The fleet admits no more than strict mode
// could (C + floor(r*T)) and at least 0.9 of it; allowed requests after
// the first second are answered from memory (median < 5 ms); and Redis
// runs at most 2 x nodes x admitted / lease script calls, plus 10 per node.
// Strict mode's median for the same flood is logged beside it.
func TestLeaseSharedKeyAtEightTimesItsRate(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	p := fleetPolicy{capacity: 200, refill: "50/s", lease: "10%", timeout: "1s"}
	const lease = 20 // 10% of 200
	f := startLeaseFleet(t, 4, wanDelay, p)
	r := p.refillPerSecond(t)
	rate := 8 * r

	before := f.scriptCalls()
	out := f.paced("shared-8x", rate, 4*time.Second)
	calls := f.scriptCalls() - before
	afterGiveBacks()
	callsAll := f.scriptCalls() - before

	counts := tally(out)
	admitted := counts[200]
	wall, sending := span(out)
	most, least := allowance(p, r, wall), allowance(p, r, sending)
	first := out[0].sent
	median, n := medianTook(out, func(o answer) bool { return o.status == 200 && o.sent.Sub(first) >= time.Second })
	maxCalls := 2*len(f.nodes)*admitted/lease + 10*len(f.nodes)
	t.Logf("%d requests at %.0f/s over %d nodes, wall span %s (sending %s): statuses %v; admitted %d, allowance %d (wall) / %d (sending), %.3f of it; median of the %d allowed after the first second %s; script calls %d during the load, %d after lease_ttl, bound %d; %s",
		len(out), rate, len(f.nodes), wall.Round(time.Millisecond), sending.Round(time.Millisecond), counts,
		admitted, most, least, float64(admitted)/float64(least), n, median, calls, callsAll, maxCalls, f.leaseCounts())
	if counts[200]+counts[429] != len(out) {
		t.Errorf("statuses %v: want only 200 and 429", counts)
	}
	if admitted > most {
		t.Errorf("admitted %d, more than strict mode's allowance %d over %s", admitted, most, wall)
	}
	if float64(admitted) < 0.9*float64(least) {
		t.Errorf("admitted %d, less than 0.9 of the allowance %d over %s", admitted, least, sending)
	}
	if n == 0 || median >= 5*time.Millisecond {
		t.Errorf("median latency of the %d requests allowed after the first second: %s, want < 5ms", n, median)
	}
	if callsAll > maxCalls {
		t.Errorf("%d script calls (give-backs included) for %d admitted, want at most %d", callsAll, admitted, maxCalls)
	}

	// The same flood, strict mode, for one second: the comparison.
	p.lease = ""
	f.reload(p)
	out = f.paced("shared-8x-strict", rate, time.Second)
	counts = tally(out)
	median, n = medianTook(out, func(o answer) bool { return o.status == 200 })
	wall, _ = span(out)
	t.Logf("strict mode, the same flood for 1 s: statuses %v; median of the %d allowed %s", counts, n, median)
	if most := allowance(p, r, wall); counts[200] > most {
		t.Errorf("strict mode admitted %d, more than its allowance %d", counts[200], most)
	}
	if n == 0 || median < 2*wanDelay {
		t.Errorf("strict mode's median %s (of %d allowed): want at least the round trip through the proxy, %s", median, n, 2*wanDelay)
	}
}

// TestLeaseKeysSeenOnceCostOneCallEach sends 100 keys once each over 4
// nodes: each costs at most one script call, as in strict mode, give-backs
// included.
func TestLeaseKeysSeenOnceCostOneCallEach(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes)")
	p := fleetPolicy{capacity: 1000, refill: "100/s", lease: "10%", timeout: "1s"}
	f := startLeaseFleet(t, 4, 0, p)
	const keys = 100
	before := f.scriptCalls()
	out := make([]answer, keys)
	for i := range keys {
		out[i] = f.get(i%len(f.nodes), "once-"+strconv.Itoa(i))
	}
	afterGiveBacks()
	calls := f.scriptCalls() - before
	counts := tally(out)
	t.Logf("%d keys once each over %d nodes: statuses %v; script calls %d, give-backs included; %s",
		keys, len(f.nodes), counts, calls, f.leaseCounts())
	if counts[200] != keys {
		t.Errorf("statuses %v: want all %d allowed", counts, keys)
	}
	if calls > keys {
		t.Errorf("%d script calls for %d keys seen once, want at most %d", calls, keys, keys)
	}
}

// TestLeaseRedisOutageMidLoad floods one key at 3.2x its rate over 4 nodes
// while the link to Redis goes dark (a black hole) and is then cut (every
// connection closed and refused, as a killed Redis looks), and comes back:
//   - up: every request is allowed (the bucket is not yet empty);
//   - dark: each node spends its leased tokens, then on_store_error deny
//     rules: a 503, and no request allowed after a node's first 503;
//   - cut: nothing but 200 (tokens still leased) and 503;
//   - back: every node admits again;
//   - over the whole run the key is admitted at most C + floor(r*T) times;
//   - reloading each node a few times leaves no goroutine behind.
func TestLeaseRedisOutageMidLoad(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "fault injection (4 Caddy processes, a dark then cut Redis link)")
	// timeout 400ms: ten round trips through the proxy, so that the up
	// phase's calls fit it on a loaded runner (at 200ms, 6 of 160 were
	// answered 503 there once, under -race with other suites running).
	p := fleetPolicy{capacity: 200, refill: "50/s", lease: "10%", timeout: "400ms",
		more: "breaker_cooldown 300ms"}
	const lease = 20 // 10% of 200
	f := startLeaseFleet(t, 4, wanDelay, p)
	r := p.refillPerSecond(t)
	rate := 3.2 * r
	phases := []struct {
		name  string
		lasts time.Duration
		do    func()
	}{
		{"up", time.Second, func() {}},
		{"dark", 1500 * time.Millisecond, f.proxy.blackhole},
		{"cut", time.Second, f.proxy.cut},
		{"back", 2500 * time.Millisecond, f.proxy.restore},
	}
	var total time.Duration
	for _, ph := range phases {
		total += ph.lasts
	}
	f.warmUp()
	var out []answer
	loaded := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(loaded)
		out = f.paced("outage", rate, total)
	}()
	var begins []time.Time
	end := start
	for _, ph := range phases {
		begins = append(begins, time.Now())
		ph.do()
		end = end.Add(ph.lasts)
		time.Sleep(time.Until(end))
	}
	<-loaded
	f.proxy.restore()

	// Each answer, by the phase it was sent in.
	byPhase := make([][]answer, len(phases))
	for _, o := range out {
		i := len(begins) - 1
		for i > 0 && o.sent.Before(begins[i]) {
			i--
		}
		byPhase[i] = append(byPhase[i], o)
	}
	for i, ph := range phases {
		t.Logf("%s (%s): %d requests, statuses %v", ph.name, ph.lasts, len(byPhase[i]), tally(byPhase[i]))
	}
	up, dark, cut, back := byPhase[0], byPhase[1], byPhase[2], byPhase[3]
	if c := tally(up); c[200] != len(up) {
		t.Errorf("before the outage, statuses %v: want all %d allowed; not allowed: %s", c, len(up), notAllowed(f, up))
	}
	for i, node := range f.nodes {
		var allowed, failed int
		var allowedAfterFailure []time.Duration
		for _, o := range dark {
			switch {
			case o.node != i:
			case o.status == 200 && failed > 0:
				allowedAfterFailure = append(allowedAfterFailure, o.sent.Sub(begins[1]))
				allowed++
			case o.status == 200:
				allowed++
			case o.status == 503:
				failed++
			default:
				t.Errorf("node %d, Redis dark: status %d, want 200 (leased) or 503 (on_store_error deny)", node.port, o.status)
			}
		}
		t.Logf("node %d, Redis dark: %d allowed from its lease, %d denied by on_store_error", node.port, allowed, failed)
		if allowed == 0 || failed == 0 {
			t.Errorf("node %d, Redis dark: %d allowed, %d answered 503; want its leased tokens spent, then 503", node.port, allowed, failed)
		}
		if len(allowedAfterFailure) > 0 {
			t.Errorf("node %d, Redis dark: %d requests allowed after its first 503, sent at %v into the outage", node.port, len(allowedAfterFailure), allowedAfterFailure)
		}
	}
	if c := tally(dark); c[200] > 2*len(f.nodes)*lease {
		t.Errorf("Redis dark: %d allowed, more than nodes x lease, twice over (%d)", c[200], 2*len(f.nodes)*lease)
	}
	if c := tally(cut); c[200]+c[503] != len(cut) {
		t.Errorf("Redis cut: statuses %v, want only 200 and 503", c)
	}
	for i, node := range f.nodes {
		if !slices.ContainsFunc(back, func(o answer) bool { return o.node == i && o.status == 200 }) {
			t.Errorf("node %d admits nothing in the %s after Redis came back", node.port, phases[3].lasts)
		}
	}
	admitted := tally(out)[200]
	wall, _ := span(out)
	if most := allowance(p, r, wall); admitted > most {
		t.Errorf("admitted %d over %s, more than strict mode's allowance %d", admitted, wall, most)
	} else {
		t.Logf("admitted %d over %s: allowance %d; %s", admitted, wall.Round(time.Millisecond), most, f.leaseCounts())
	}

	reloadsLeaveNoGoroutines(t, f, p)
}

// reloadsLeaveNoGoroutines reloads every node a few times with the same
// config, each time with a lease held for a fresh key, and checks that each
// process ends with as many goroutines as before.
func reloadsLeaveNoGoroutines(t *testing.T, f *leaseFleet, p fleetPolicy) {
	t.Helper()
	const reloads, slack = 5, 2
	afterGiveBacks()
	f.transport.CloseIdleConnections()
	before := make([]int, len(f.nodes))
	for i, node := range f.nodes {
		before[i] = f.goroutines(node)
	}
	for n := range reloads {
		for i := range f.nodes {
			for range 5 {
				f.get(i, "reload-"+strconv.Itoa(n))
			}
		}
		f.reload(p)
	}
	f.transport.CloseIdleConnections()
	for i, node := range f.nodes {
		var now int
		deadline := time.Now().Add(5 * time.Second)
		for now = f.goroutines(node); now > before[i]+slack && time.Now().Before(deadline); now = f.goroutines(node) {
			time.Sleep(100 * time.Millisecond)
		}
		t.Logf("node %d: %d goroutines before %d reloads, %d after", node.port, before[i], reloads, now)
		if now > before[i]+slack {
			t.Errorf("node %d: %d goroutines after %d reloads, %d before: a leak", node.port, now, reloads, before[i])
		}
	}
}

// limit is the policy's bucket, for the bucket math.
func (p fleetPolicy) limit(t *testing.T) bucket.Limit {
	t.Helper()
	rate, err := bucket.ParseRate(p.refill)
	if err != nil {
		t.Fatal(err)
	}
	l := bucket.Limit{Capacity: int64(p.capacity), Rate: rate}
	if p.ban != "" {
		d, err := time.ParseDuration(p.ban)
		if err != nil {
			t.Fatal(err)
		}
		l.Ban = d.Microseconds()
	}
	return l
}

// tier is the policy's limits, for the bucket math: its first limit, then
// those of its `limit` lines.
func (p fleetPolicy) tier(t *testing.T) []bucket.Limit {
	t.Helper()
	ls := []bucket.Limit{p.limit(t)}
	for _, line := range p.limits {
		capacity, refill, _ := strings.Cut(line, " ")
		c, err := strconv.ParseInt(capacity, 10, 64)
		rate, rerr := bucket.ParseRate(refill)
		if err != nil || rerr != nil {
			t.Fatalf("limit %q: want <capacity> <refill>", line)
		}
		ls = append(ls, bucket.Limit{Capacity: c, Rate: rate})
	}
	return ls
}

// strictAdmits is what one bucket of limits ls, full at the start, admits
// of the requests in out, each a unit of cost arriving when it was sent
// and taken from every limit or none.
func strictAdmits(ls []bucket.Limit, out []answer) int {
	sent := make([]time.Time, len(out))
	for i, o := range out {
		sent[i] = o.sent
	}
	slices.SortFunc(sent, func(a, b time.Time) int { return a.Compare(b) })
	states := make([]bucket.State, len(ls))
	results := make([]bucket.Result, len(ls))
	admitted := 0
	for _, at := range sent {
		if bucket.TakeAll(states, at.Sub(sent[0]).Microseconds(), ls, 1, results) {
			admitted++
		}
	}
	return admitted
}

// openConns leaves n open connections to each node in the client's pool,
// so that a burst does not wait on dialing.
func (f *leaseFleet) openConns(n int) {
	var wg sync.WaitGroup
	for _, node := range f.nodes {
		for range n {
			wg.Go(func() {
				resp, err := f.client.Get(node.base() + "/ready")
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
	}
	wg.Wait()
}

// burst sends perNode requests for key to every node, all at once.
func (f *leaseFleet) burst(key string, perNode int) []answer {
	return f.burstWith(perNode, func(i int) answer { return f.get(i, key) })
}

// burstWith is burst with send making each request, to node i.
func (f *leaseFleet) burstWith(perNode int, send func(i int) answer) []answer {
	out := make([]answer, perNode*len(f.nodes))
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range out {
		wg.Go(func() {
			<-start
			out[i] = send(i % len(f.nodes))
		})
	}
	close(start)
	wg.Wait()
	return out
}

// sharedLevel is the whole tokens left in key's shared bucket, as node i
// reads it from Redis through the admin API.
func (f *leaseFleet) sharedLevel(i int, key string) int64 {
	f.t.Helper()
	var b bucketState
	text := f.adminGet(f.nodes[i], "/rate_limit/buckets?policy=fleet&keyer=header&value="+url.QueryEscape(key))
	if err := json.Unmarshal([]byte(text), &b); err != nil {
		f.t.Fatalf("bucket %q: %v in %s", key, err, text)
	}
	return b.Remaining
}

// TestLeaseBurstAfterRefillLeavesOutWhatNodesHold plays docs/fleet.md's
// policy (200 at 50/s, lease 10%, lease_ttl 1s) on 4 nodes, 20 ms each way
// from Redis: 4 requests on each node, so that each holds a few leased
// tokens, a 0.8 s pause in which the shared bucket refills, then 100
// requests at once on each node. Before the fix the level refilled to the
// capacity over the tokens the nodes held, and the burst got both (212).
// Now the level stays below the capacity by what is out on lease, and the
// burst gets the capacity plus the refill while it is being decided: its
// lease calls take a few round trips, in which the bucket refills.
func TestLeaseBurstAfterRefillLeavesOutWhatNodesHold(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	p := fleetPolicy{capacity: 200, refill: "50/s", lease: "10%", timeout: "1s"}
	f := startLeaseFleet(t, 4, wanDelay, p)
	r := p.refillPerSecond(t)
	f.warmUp()
	f.openConns(100)
	const key = "burst-after-refill"

	first := make([]answer, 4*len(f.nodes))
	var wg sync.WaitGroup
	for i := range f.nodes {
		wg.Go(func() {
			for j := range 4 {
				first[4*i+j] = f.get(i, key)
			}
		})
	}
	wg.Wait()
	_, lastFirst := span(first)
	time.Sleep(time.Until(first[0].sent.Add(lastFirst + 700*time.Millisecond)))
	level := f.sharedLevel(0, key)
	time.Sleep(time.Until(first[0].sent.Add(lastFirst + 800*time.Millisecond)))
	burst := f.burst(key, 100)
	all := append(slices.Clone(first), burst...)

	// Every admission of the burst was decided between its first request
	// and its last admitted answer.
	burstStart, decidedBy := burst[0].sent, burst[0].sent
	for _, o := range burst {
		if o.sent.Before(burstStart) {
			burstStart = o.sent
		}
		if o.status == 200 && o.done.After(decidedBy) {
			decidedBy = o.done
		}
	}
	decided := decidedBy.Sub(burstStart)
	_, sending := span(burst)
	burstAdmitted, admitted := tally(burst)[200], tally(all)[200]
	wall, _ := span(all)
	t.Logf("4 requests on each of %d nodes: statuses %v; shared level 0.1 s before the burst %d (capacity %d); burst of %d sent over %s: statuses %v, admitted ones answered within %s, bound C + floor(r*T) over that %d; in all %d over %s: one bucket on the same arrivals %d, C + floor(r*T) %d; %s",
		len(f.nodes), tally(first), level, p.capacity, len(burst), sending.Round(time.Millisecond), tally(burst), decided.Round(time.Millisecond), allowance(p, r, decided),
		admitted, wall.Round(time.Millisecond), strictAdmits(p.tier(t), all), allowance(p, r, wall), f.leaseCounts())
	if c := tally(first); c[200] != len(first) {
		t.Errorf("before the pause, statuses %v: want all %d allowed", c, len(first))
	}
	// Each node holds at least one token of its last lease.
	if level > int64(p.capacity-len(f.nodes)) {
		t.Errorf("the shared level refilled to %d over the tokens the %d nodes hold, want at most %d", level, len(f.nodes), p.capacity-len(f.nodes))
	}
	if c := tally(burst); c[200]+c[429] != len(burst) {
		t.Errorf("burst: statuses %v, want only 200 and 429", c)
	}
	if most := allowance(p, r, decided); burstAdmitted > most {
		t.Errorf("the burst after the refill got %d, more than C + floor(r*T) over the %s it was decided in, %d", burstAdmitted, decided, most)
	}
	if most := allowance(p, r, wall); admitted > most {
		t.Errorf("the fleet admitted %d over %s, more than C + floor(r*T), %d", admitted, wall, most)
	}
}

// TestLeaseBanHoldsOnEveryNode runs a ban with leases on 4 nodes, 20 ms
// each way from Redis: 40 at 2/s, ban 10m, lease 10% (4 tokens), 20
// requests a second round-robin over the nodes for 5 s. The ban starts in
// Redis once the bucket lacks a request's cost even counting the tokens
// out on lease, so the fleet admits no more than one bucket with a ban on
// the same arrivals; once a client has been told of the ban, no node
// admits anything after lease_ttl; and the fleet counts the ban once in
// bans_total, whichever node started it.
func TestLeaseBanHoldsOnEveryNode(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	p := fleetPolicy{capacity: 40, refill: "2/s", lease: "10%", timeout: "1s", ban: "10m"}
	const leaseTTL = time.Second
	f := startLeaseFleet(t, 4, wanDelay, p)
	l := p.limit(t)
	f.warmUp()

	out := f.paced("banned", 20, 5*time.Second)
	admitted, strict := tally(out)[200], strictAdmits([]bucket.Limit{l}, out)
	bans := f.metric("caddy_http_rate_limit_bans_total", `policy="fleet"`)

	// The first answer that says the ban: a wait of the ban or more.
	banAt := -1
	for i, o := range out {
		if o.status == 429 && o.retryAfter >= int(l.Ban/second) && (banAt < 0 || o.done.Before(out[banAt].done)) {
			banAt = i
		}
	}
	if banAt < 0 {
		t.Fatalf("statuses %v: no 429 with a Retry-After of the ban (%s) or more; admitted %d, one bucket %d", tally(out), p.ban, admitted, strict)
	}
	told := out[banAt].done
	var after, afterTTL []string
	for _, o := range out {
		if o.status != 200 || !o.sent.After(told) {
			continue
		}
		at := fmt.Sprintf("node %d at %s", f.nodes[o.node].port, o.sent.Sub(told).Round(time.Millisecond))
		after = append(after, at)
		if o.sent.Sub(told) > leaseTTL {
			afterTTL = append(afterTTL, at)
		}
	}
	t.Logf("%d requests at 20/s over %d nodes: statuses %v; admitted %d, one bucket with the ban on the same arrivals %d; first told of the ban %s in, by node %d (Retry-After %d); admitted after that: %d %v; bans_total over the nodes %.0f; %s",
		len(out), len(f.nodes), tally(out), admitted, strict, out[banAt].sent.Sub(out[0].sent).Round(time.Millisecond), f.nodes[out[banAt].node].port, out[banAt].retryAfter,
		len(after), after, bans, f.leaseCounts())
	if c := tally(out); c[200]+c[429] != len(out) {
		t.Errorf("statuses %v, want only 200 and 429", c)
	}
	if admitted > strict {
		t.Errorf("the fleet admitted %d, one bucket with the ban %d on the same arrivals", admitted, strict)
	}
	if len(afterTTL) > 0 {
		t.Errorf("admitted more than lease_ttl after a client was told of the ban: %v", afterTTL)
	}
	if bans != 1 {
		t.Errorf("bans_total summed over the nodes is %.0f, want 1", bans)
	}
}

// TestLeaseFarNodesKeepTheirShareAndTheirTokens runs 4 nodes, 2 of them
// 80 ms each way from Redis and 2 at 160 ms.
//   - docs/fleet.md's policy (200 at 50/s, lease 10%), a hot key at 4 times
//     its rate, round-robin: once the first capacity is spent, neither
//     pair gets less than a sixth of what is admitted. A hold-off
//     counted from the answer to a refused call, with no jitter, left the
//     far nodes last to every refill. (On 2 cores a pair's share ranges
//     from about a third to two thirds, and down to a fifth with three
//     suites running at once, so the bound is loose.)
//   - A key in waves on a near node whose give-backs land before the next
//     wave: no token is lost (tokenWaves).
func TestLeaseFarNodesKeepTheirShareAndTheirTokens(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, Redis 80 and 160 ms away)")
	p := fleetPolicy{capacity: 200, refill: "50/s", lease: "10%", timeout: "1s"}
	near, far := 80*time.Millisecond, 160*time.Millisecond
	delays := []time.Duration{near, near, far, far}
	f := startLeaseFleetAt(t, delays, p)
	f.warmUp()

	t.Run("hot key", func(t *testing.T) {
		const drained = 2 * time.Second // the capacity is spent by then
		r := p.refillPerSecond(t)
		out := f.paced("far-hot", 4*r, 6*time.Second)
		byNode := make([]int, len(f.nodes))
		byDelay := map[time.Duration]int{}
		steady := 0
		for _, o := range out {
			if o.status == 200 && o.sent.Sub(out[0].sent) >= drained {
				byNode[o.node]++
				byDelay[delays[o.node]]++
				steady++
			}
		}
		var shares []string
		for i, n := range byNode {
			shares = append(shares, fmt.Sprintf("%s: %d (%.0f%%)", delays[i], n, 100*float64(n)/float64(max(steady, 1))))
		}
		wall, _ := span(out)
		admitted := tally(out)[200]
		t.Logf("%d requests at %.0f/s: statuses %v, admitted %d over %s (C + floor(r*T) %d); after the first %s, %d admitted, by node %v; near pair %d, far pair %d (far/near %.2f); %s",
			len(out), 4*r, tally(out), admitted, wall.Round(time.Millisecond), allowance(p, r, wall), drained, steady, shares,
			byDelay[near], byDelay[far], float64(byDelay[far])/float64(max(byDelay[near], 1)), f.leaseCounts())
		if c := tally(out); c[200]+c[429] != len(out) {
			t.Errorf("statuses %v, want only 200 and 429", c)
		}
		if most := allowance(p, r, wall); admitted > most {
			t.Errorf("admitted %d over %s, more than C + floor(r*T), %d", admitted, wall, most)
		}
		for _, d := range []time.Duration{near, far} {
			if 6*byDelay[d] < steady {
				t.Errorf("after the first %s the nodes %s from Redis got %d of %d admitted, less than a sixth", drained, d, byDelay[d], steady)
			}
		}
	})

	t.Run("key in waves", func(t *testing.T) {
		f.reloadNode(0, wavesPolicy)
		f.warmUp()
		// A wave's last lease call is sent by 0.6 s into it; its leftover
		// lands by lease_ttl + a sweep period + a handshake and a trip
		// after that, before the next wave, 2.5 s after the last.
		tokenWaves(t, f, 0, "far-waves", 2, 1900*time.Millisecond)
	})
}

// wavesPolicy is a bucket that refills slowly, so that a key in waves
// keeps it below its capacity, where a lost token shows.
var wavesPolicy = fleetPolicy{capacity: 100, refill: "2/s", lease: "10%", timeout: "1s"}

// tokenWaves sends waves of 12 requests at 20/s for key to node i, pause
// apart, on wavesPolicy. Each wave leases up to 10 tokens at once and
// leaves some unspent, which go back lease_ttl after its last lease call;
// the waves take more than the refill, so the bucket never sits full.
// Every request must be admitted, and once the last wave's leftover is
// back, the shared level plus what was admitted must account for the
// capacity and the refill since the first request, within 3%: a
// give-back that Redis refused lost its tokens.
func tokenWaves(t *testing.T, f *leaseFleet, i int, key string, waves int, pause time.Duration) {
	t.Helper()
	p := wavesPolicy
	r := p.refillPerSecond(t)
	returned := f.nodeMetric(i, "caddy_http_rate_limit_lease_tokens_returned_total", "")
	var out []answer
	for w := range waves {
		if w > 0 {
			time.Sleep(pause)
		}
		out = append(out, f.pacedOn([]int{i}, key, 20, 600*time.Millisecond)...)
	}
	// lease_ttl, a sweep period, a handshake and a trip, with room.
	time.Sleep(2 * time.Second)
	peeked := time.Now()
	level := int(f.sharedLevel(i, key))
	returned = f.nodeMetric(i, "caddy_http_rate_limit_lease_tokens_returned_total", "") - returned
	admitted := tally(out)[200]
	refill := int(math.Floor(r * peeked.Sub(out[0].sent).Seconds()))
	should := p.capacity + refill
	lost := should - admitted - level
	t.Logf("%d waves of 12 requests at 20/s, %s apart, on a node %s from Redis: statuses %v; tokens given back %.0f; %s after the first request the shared level is %d: admitted + level %d, capacity + refill %d + %d = %d; lost %d (%.1f%%)",
		waves, pause, f.nodes[i].proxy.Delay(), tally(out), returned, peeked.Sub(out[0].sent).Round(time.Millisecond), level, admitted+level, p.capacity, refill, should, lost, 100*float64(lost)/float64(should))
	if c := tally(out); c[200] != len(out) {
		t.Errorf("statuses %v: want all %d allowed; not allowed: %s", c, len(out), notAllowed(f, out))
	}
	if returned == 0 {
		t.Errorf("no leased token went back: the waves did not test give-backs")
	}
	if lost > should*3/100 {
		t.Errorf("the shared level %d and the %d admitted account for %d of the capacity and refill %d: %d lost, more than 3%%", level, admitted, admitted+level, should, lost)
	}
}

// TestLeaseGiveBackOvertakenByTheNextLeaseIsNotLost runs a key in 2 waves
// 1.2 s apart on one node 80 ms each way from Redis. The first wave's
// leftover goes back, pipelined, on a connection the node must open first
// (go-redis keeps pipelines on connections of their own): a round trip
// for the handshake. The second wave's first lease call, sent later on an
// open connection, reaches Redis first: it says the node holds nothing and
// rewrites the lease's record under a new number, and the give-back,
// naming the old one, returns nothing. A lease's leftover (13 tokens,
// 12% of the capacity and refill) is lost, which tokenWaves catches.
func TestLeaseGiveBackOvertakenByTheNextLeaseIsNotLost(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (a Caddy process, Redis 80 ms away)")
	f := startLeaseFleet(t, 1, 80*time.Millisecond, wavesPolicy)
	f.warmUp()
	tokenWaves(t, f, 0, "overtaken", 2, 1200*time.Millisecond)
}
