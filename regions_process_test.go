package ratelimit

import (
	"fmt"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
)

// Regions on real processes (the harness of lease_process_test.go): one
// global redis-server that three regions reach through proxies that delay
// each direction by 0.5, 40 and 80 ms, and a redis-server of each region
// 0.5 ms away. Each region has two Caddy nodes, which serve two layouts at
// once: a shared limit on the global Redis with leases (clients named by
// X-Key), and a limit of the region's own on its Redis (clients named by
// X-IP). The delaying proxies set the round trips, so a loaded machine
// does not change them. The model tests of the same rules are in
// internal/redisbucket (lease_model_test.go).

// withShareReconcileAndCredit adds the settings a cut-off or cold region
// needs, on_store_error local's share and reconcile, and the store's
// credit, to every node's config, and turns on the bounds that need them.
// Off, a cut-off node falls back to plain `on_store_error local`, and the
// figures of those bounds are logged as pending.
const withShareReconcileAndCredit = true

// regionsPolicy is the shared limit of the chaos test, and attackPolicy
// the small one the credit attack runs on.
var (
	regionsPolicy = fleetPolicy{capacity: 100, refill: "50/s", lease: "10%", timeout: "500ms"}
	// The attack's lease is 2 tokens, not 10% (1 token, which is strict
	// mode, where credit is off): the attack is on a bucket credit serves.
	attackPolicy = fleetPolicy{capacity: 10, refill: "1/s", lease: "2", timeout: "500ms"}
)

// regionsLease is regionsPolicy's lease in tokens: 10% of 100.
const regionsLease = 10

// nodesPerRegion is how many Caddy nodes each region runs, of the
// fleet's regions x nodesPerRegion; with withShareReconcileAndCredit, a
// node's fallback is a fleet node's share of the limit, and it admits
// regionsCredit requests of a key it holds no lease for (attackCredit on
// the credit attack's policy). A cold client's first two requests, sent
// one after the other, both come within one round trip, before the
// first one's charge answers: credit 2 serves both, where credit 1 would
// send the second on a lease call (the slower half of the answers).
const (
	nodesPerRegion = 2
	fleetNodes     = 3 * nodesPerRegion
	regionsCredit  = 2
	attackCredit   = 1
)

// windowSlack is how far an admission's time may be from when the client
// saw its answer: the windows are checked on the answers' times, each
// window widened by this.
const windowSlack = 100 * time.Millisecond

// region is one PoP: its way to the global Redis, and its own Redis.
type region struct {
	name   string
	global *faultProxy // to the global Redis, at the region's distance
	redis  *redisServer
	local  *faultProxy // to the region's Redis, 0.5 ms each way
	nodes  []int       // the fleet's nodes in the region
}

// regionFleet is the nodes of every region; the leaseFleet's Redis is the
// global one.
type regionFleet struct {
	*leaseFleet
	regions  []*region
	regionOf []int // each node's region
}

// startRegionFleet starts the global Redis, three regions 0.5, 40 and 80
// ms from it each way (A, B and C), and two Caddy nodes in each, and
// warms every node up on each of its policies.
func startRegionFleet(t *testing.T) *regionFleet {
	t.Helper()
	f := &regionFleet{leaseFleet: newLeaseFleet(t, startRedis(t))}
	for i, at := range []struct {
		name  string
		delay time.Duration
	}{{"A", 500 * time.Microsecond}, {"B", 40 * time.Millisecond}, {"C", 80 * time.Millisecond}} {
		rg := &region{name: at.name, global: startFaultProxy(t, f.redis.addr(), at.delay), redis: startRedis(t)}
		rg.local = startFaultProxy(t, rg.redis.addr(), 500*time.Microsecond)
		f.regions = append(f.regions, rg)
		for range nodesPerRegion {
			node := fleetNode{port: freePort(t), admin: freePort(t), proxy: rg.global}
			rg.nodes = append(rg.nodes, len(f.nodes))
			f.nodes = append(f.nodes, node)
			f.regionOf = append(f.regionOf, i)
			startCaddyProcess(t, node.port, f.caddyfile(node, rg))
		}
	}
	f.proxy = f.nodes[0].proxy
	f.warmUp()
	f.warmUpWith(func(i int) answer { return f.getAt(i, "/attack", "X-Key", "warm-up") })
	f.warmUpWith(func(i int) answer { return f.getAt(i, "/region", "X-IP", "warm-up") })
	f.openConns(32)
	return f
}

// caddyfile is one node's config: the shared limit on every path but
// /attack (the credit attack's smaller one) and /region (the region's
// own limit).
func (f *regionFleet) caddyfile(node fleetNode, rg *region) string {
	global := func(p fleetPolicy, credit int) fleetPolicy {
		p.fallback = "local"
		if withShareReconcileAndCredit {
			p.fallback, p.more = fmt.Sprintf("local 1/%d reconcile", fleetNodes), fmt.Sprintf("credit %d", credit)
		}
		return p
	}
	own := fleetPolicy{capacity: regionsPolicy.capacity, refill: regionsPolicy.refill, timeout: regionsPolicy.timeout, key: "X-IP", fallback: "local"}
	return nodeCaddyfile(node, `handle /region {
		`+own.rateLimit("region", "", rg.local.addr())+`
		respond "ok"
	}
	handle /attack {
		`+global(attackPolicy, attackCredit).rateLimit("attack", "", rg.global.addr())+`
		respond "ok"
	}
	handle {
		`+global(regionsPolicy, regionsCredit).rateLimit("fleet", "", rg.global.addr())+`
		respond "ok"
	}`)
}

// inRegion keeps the answers of region rg's nodes.
func (f *regionFleet) inRegion(rg int) func(answer) bool {
	return func(o answer) bool { return f.regionOf[o.node] == rg }
}

// leaseCalls is the lease calls that region rg's nodes have had answered,
// each node's count.
func (f *regionFleet) leaseCalls(rg *region) []float64 {
	var n []float64
	for _, i := range rg.nodes {
		n = append(n, f.nodeMetric(i, "caddy_http_rate_limit_leases_total", ""))
	}
	return n
}

// window is the window over which admissions most exceed a bound.
type window struct {
	excess   int // admitted - bound, negative when the bound holds with room
	admitted int
	bound    int
	from     time.Duration // from the first answer
	length   time.Duration
}

func (w window) String() string {
	return fmt.Sprintf("%+d (%d admitted against %d, over the %s from %s)", w.excess, w.admitted, w.bound,
		w.length.Round(time.Millisecond), w.from.Round(time.Millisecond))
}

// worstWindow checks every window between two admissions of out against
// C + floor(r*(T + windowSlack)) + extra, T the window's length, and
// returns the one admissions exceed the most. An admission counts at the
// time its answer reached the client.
func worstWindow(out []answer, p fleetPolicy, r float64, extra int) window {
	var at []time.Time
	for _, o := range out {
		if o.status == 200 {
			at = append(at, o.done)
		}
	}
	slices.SortFunc(at, func(a, b time.Time) int { return a.Compare(b) })
	worst := window{excess: math.MinInt}
	for i := range at {
		for j := i; j < len(at); j++ {
			length := at[j].Sub(at[i])
			w := window{admitted: j - i + 1, bound: allowance(p, r, length+windowSlack) + extra, length: length}
			if w.excess = w.admitted - w.bound; w.excess > worst.excess {
				w.from = at[i].Sub(at[0])
				worst = w
			}
		}
	}
	return worst
}

// longestTook is the longest time to answer of the answers keep holds for.
func longestTook(out []answer, keep func(answer) bool) time.Duration {
	var d time.Duration
	for _, o := range out {
		if keep(o) {
			d = max(d, o.took())
		}
	}
	return d
}

// storeErrors is the decisions on_store_error made on every node: the
// store failed them, or its breaker was open.
func (f *regionFleet) storeErrors() float64 {
	return f.metric("caddy_http_rate_limit_store_errors_total", "")
}

// loadAverage is the machine's load over the last minute: the proxies
// and the client share the CPUs with the nodes, so a loaded machine
// lengthens the round trips, and calls that take over timeout fall back
// (the phases' store errors).
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	first, _, _ := strings.Cut(string(b), " ")
	return first
}

// regionShares is what each region admitted of out, and its share.
func (f *regionFleet) regionShares(out []answer) ([]int, string) {
	by := make([]int, len(f.regions))
	for _, o := range out {
		if o.status == 200 {
			by[f.regionOf[o.node]]++
		}
	}
	all := max(tally(out)[200], 1)
	var s []string
	for i, rg := range f.regions {
		s = append(s, fmt.Sprintf("%s %d (%.0f%%)", rg.name, by[i], 100*float64(by[i])/float64(all)))
	}
	return by, strings.Join(s, ", ")
}

// pending says whether a bound is checked, or waits for
// withShareReconcileAndCredit.
func pending(held bool) string {
	switch {
	case !withShareReconcileAndCredit:
		return "pending"
	case held:
		return "holds"
	}
	return "FAILS"
}

// TestRegionsChaos runs, on one fleet of three regions (startRegionFleet;
// C=100, r=50/s, lease 10%, lease_ttl 1s, timeout 500ms), one phase after
// the other so that the global Redis's counts are each phase's:
//   - a hot key at 250/s over the 6 nodes for 12 s: every window within
//     C + floor(rT), at least 0.95 of the allowance, each region at least
//     25% of the admissions, a median added latency under 5 ms in every
//     region after the first second, and global script calls at most
//     2 x nodes x admitted / lease + 10 per node;
//   - a key under its limit (40/s for 8 s) on region C alone: nothing
//     refused, and after the first second at most 1% of the answers take
//     150 ms or more;
//   - 300 fresh keys, 2 requests each to region C: at most one global call
//     a request, and a median under 5 ms with credit; on the region's own
//     policy, a median under 5 ms and no global call;
//   - the credit attack (C=10, r=1/s; 3 requests to every node every 1.2 s
//     for 10 s): every window within C + floor(rT) + nodes x credit;
//   - region C cut off from the global Redis (its proxy a black hole) for
//     10 s of 20 under the hot load: every window within C + floor(rT) +
//     n_cut x (floor(sC) + floor(s r T_c)), with s the fallback's share;
//     no answer in C slower than timeout + 100 ms; C's lease calls answered
//     again within breaker_cooldown + timeout + 1 s of the restore; and,
//     with reconcile, at most the allowance + 1% over the 20 s.
//
// The figures are logged in one block at the end. The test is not
// parallel, so that they are of this fleet's load alone.
func TestRegionsChaos(t *testing.T) {
	skipUnderShort(t, "real-process chaos (6 Caddy processes in 3 regions, delayed and cut Redis links)")
	began, load := time.Now(), loadAverage()
	f := startRegionFleet(t)
	started := time.Since(began)
	var figures []string
	logf := func(format string, args ...any) { figures = append(figures, fmt.Sprintf(format, args...)) }
	logf("regions A, B, C 0.5/40/80 ms each way from the global Redis, %d nodes each; %d %s, lease %s, lease_ttl 1s, timeout %s; credit and on_store_error share/reconcile: %v",
		nodesPerRegion, regionsPolicy.capacity, regionsPolicy.refill, regionsPolicy.lease, regionsPolicy.timeout, withShareReconcileAndCredit)

	f.hotKey(t, logf)
	f.underLimitKey(t, logf)
	f.coldKeys(t, logf)
	f.creditAttack(t, logf)
	f.cutAndHeal(t, logf)

	logf("fleet started in %s; whole test %s; load average %s at the start, %s at the end", started.Round(100*time.Millisecond), time.Since(began).Round(100*time.Millisecond), load, loadAverage())
	t.Logf("figures:\n%s", strings.Join(figures, "\n"))
}

// hotKey floods one key at 5x its rate over every node for 12 s.
func (f *regionFleet) hotKey(t *testing.T, logf func(string, ...any)) {
	p := regionsPolicy
	r := p.refillPerSecond(t)
	before, errs := f.scriptCalls(), f.storeErrors()
	out := f.paced("hot", 5*r, 12*time.Second)
	afterGiveBacks()
	calls := f.scriptCalls() - before

	counts := tally(out)
	admitted := counts[200]
	_, sending := span(out)
	least := allowance(p, r, sending)
	worst := worstWindow(out, p, r, 0)
	by, shares := f.regionShares(out)
	maxCalls := 2*len(f.nodes)*admitted/regionsLease + 10*len(f.nodes)
	first := out[0].sent
	var medians, slowest, slow []string
	for i, rg := range f.regions {
		in := f.inRegion(i)
		slowest = append(slowest, fmt.Sprintf("%s %s", rg.name, longestTook(out, in).Round(time.Millisecond)))
		all, n := medianTook(out, func(o answer) bool { return in(o) && o.sent.Sub(first) >= time.Second })
		allowed, _ := medianTook(out, func(o answer) bool { return in(o) && o.status == 200 && o.sent.Sub(first) >= time.Second })
		medians = append(medians, fmt.Sprintf("%s %s (admitted %s)", rg.name, all.Round(10*time.Microsecond), allowed.Round(10*time.Microsecond)))
		if n == 0 || all >= 5*time.Millisecond {
			slow = append(slow, fmt.Sprintf("%s %s of %d answers", rg.name, all, n))
		}
	}
	logf("hot key, %d requests at %.0f/s over %s: statuses %v; admitted %d, %.3f of the allowance %d; by region %s; median added latency after the first second %s; slowest answer %s; global script calls %d (bound %d); worst window against C + floor(rT): %s; store errors %.0f; %s (fleet totals so far)",
		len(out), 5*r, sending.Round(time.Millisecond), counts, admitted, float64(admitted)/float64(least), least, shares,
		strings.Join(medians, ", "), strings.Join(slowest, ", "), calls, maxCalls, worst, f.storeErrors()-errs, f.leaseCounts())
	if counts[200]+counts[429] != len(out) {
		t.Errorf("hot key: statuses %v, want only 200 and 429", counts)
	}
	if worst.excess > 0 {
		t.Errorf("hot key: a window over C + floor(rT) + slack: %s", worst)
	}
	if float64(admitted) < 0.95*float64(least) {
		t.Errorf("hot key: admitted %d, less than 0.95 of the allowance %d", admitted, least)
	}
	for i, rg := range f.regions {
		if 4*by[i] < admitted {
			t.Errorf("hot key: region %s got %d of %d admitted, less than 25%%", rg.name, by[i], admitted)
		}
	}
	if len(slow) > 0 {
		t.Errorf("hot key: median added latency after the first second 5 ms or more in %v", slow)
	}
	if calls > maxCalls {
		t.Errorf("hot key: %d global script calls (give-backs included) for %d admitted, want at most %d", calls, admitted, maxCalls)
	}
}

// underLimitKey sends a key at 0.8 of its rate to region C's nodes.
func (f *regionFleet) underLimitKey(t *testing.T, logf func(string, ...any)) {
	c := f.regions[2]
	errs := f.storeErrors()
	out := f.pacedOn(c.nodes, "under", 40, 8*time.Second)
	counts := tally(out)
	var later, slow int
	for _, o := range out {
		if o.sent.Sub(out[0].sent) >= time.Second {
			later++
			if o.took() >= 150*time.Millisecond {
				slow++
			}
		}
	}
	median, _ := medianTook(out, func(answer) bool { return true })
	logf("under-limit key, %d requests at 40/s to region C: statuses %v; median %s; after the first second %d of %d (%.1f%%) took 150 ms or more; store errors %.0f",
		len(out), counts, median.Round(10*time.Microsecond), slow, later, 100*float64(slow)/float64(max(later, 1)), f.storeErrors()-errs)
	if counts[200] != len(out) {
		t.Errorf("under-limit key: statuses %v, want all %d allowed; not allowed: %s", counts, len(out), notAllowed(f.leaseFleet, out))
	}
	if 100*slow > later {
		t.Errorf("under-limit key: after the first second %d of %d answers took 150 ms or more, more than 1%%", slow, later)
	}
}

// coldKeys sends 300 fresh keys, 2 requests each one after the other, to
// region C: on the shared limit, then on the region's own.
func (f *regionFleet) coldKeys(t *testing.T, logf func(string, ...any)) {
	const keys = 300
	c := f.regions[2]
	twice := func(path, header, prefix string) []answer {
		firsts := make([]answer, keys)
		seconds := f.pacedWith(c.nodes, 100, keys*10*time.Millisecond, func(i, n int) answer {
			value := prefix + strconv.Itoa(n)
			firsts[n] = f.getAt(i, path, header, value)
			return f.getAt(i, path, header, value)
		})
		return append(firsts, seconds...)
	}

	// The phases before leave leases to give back: their calls are not
	// the cold keys'.
	afterGiveBacks()
	before, leases, errs := f.scriptCalls(), f.leaseCounts(), f.storeErrors()
	out := twice("/", "X-Key", "cold-")
	during := f.scriptCalls() - before
	afterGiveBacks()
	calls := f.scriptCalls() - before
	counts := tally(out)
	median, _ := medianTook(out, func(answer) bool { return true })
	firsts, _ := medianTook(out[:keys], func(answer) bool { return true })
	seconds, _ := medianTook(out[keys:], func(answer) bool { return true })
	withCredit := median < 5*time.Millisecond
	logf("cold keys, %d fresh keys 2 requests each to region C, shared limit: statuses %v; median %s (first requests %s, second %s; < 5 ms with credit: %s); global script calls %d during the load, %d with give-backs, for %d requests; store errors %.0f; %s before, %s after",
		keys, counts, median.Round(10*time.Microsecond), firsts.Round(10*time.Microsecond), seconds.Round(10*time.Microsecond), pending(withCredit), during, calls, len(out), f.storeErrors()-errs, leases, f.leaseCounts())
	if counts[200] != len(out) {
		t.Errorf("cold keys, shared limit: statuses %v, want all %d allowed", counts, len(out))
	}
	if calls > len(out) {
		t.Errorf("cold keys, shared limit: %d global script calls (give-backs included) for %d requests, want at most one each", calls, len(out))
	}
	if withShareReconcileAndCredit && !withCredit {
		t.Errorf("cold keys, shared limit with credit: median %s, want < 5ms", median)
	}

	before, regional, errs := f.scriptCalls(), scriptCalls(c.redis), f.storeErrors()
	out = twice("/region", "X-IP", "cold-ip-")
	calls, regional = f.scriptCalls()-before, scriptCalls(c.redis)-regional
	counts = tally(out)
	median, _ = medianTook(out, func(answer) bool { return true })
	logf("cold keys, %d fresh keys 2 requests each to region C, region's own limit: statuses %v; median %s; script calls on region C's Redis %d, on the global one %d; store errors %.0f",
		keys, counts, median.Round(10*time.Microsecond), regional, calls, f.storeErrors()-errs)
	if counts[200] != len(out) {
		t.Errorf("cold keys, region's limit: statuses %v, want all %d allowed", counts, len(out))
	}
	if median >= 5*time.Millisecond {
		t.Errorf("cold keys, region's limit: median %s, want < 5ms", median)
	}
	if calls != 0 || regional == 0 {
		t.Errorf("cold keys, region's limit: %d global script calls and %d on the region's Redis, want none and some", calls, regional)
	}
}

// creditAttack sends 3 requests for one key to every node at once, every
// lease_ttl + 200 ms for 10 s, on attackPolicy: each node holds no lease
// entry for it when the next burst comes.
func (f *regionFleet) creditAttack(t *testing.T, logf func(string, ...any)) {
	p := attackPolicy
	r := p.refillPerSecond(t)
	extra := 0
	if withShareReconcileAndCredit {
		extra = len(f.nodes) * attackCredit
	}
	var out []answer
	errs := f.storeErrors()
	start := time.Now()
	for k := 0; time.Duration(k)*1200*time.Millisecond < 10*time.Second; k++ {
		time.Sleep(time.Until(start.Add(time.Duration(k) * 1200 * time.Millisecond)))
		out = append(out, f.burstWith(3, func(i int) answer { return f.getAt(i, "/attack", "X-Key", "attack") })...)
	}
	counts := tally(out)
	worst := worstWindow(out, p, r, extra)
	wall, _ := span(out)
	logf("credit attack, %d %s: %d requests in bursts of 3 a node every 1.2 s: statuses %v over %s (allowance %d); worst window against C + floor(rT) + %d: %s; store errors %.0f",
		p.capacity, p.refill, len(out), counts, wall.Round(time.Millisecond), allowance(p, r, wall), extra, worst, f.storeErrors()-errs)
	if counts[200]+counts[429] != len(out) {
		t.Errorf("credit attack: statuses %v, want only 200 and 429", counts)
	}
	if worst.excess > 0 {
		t.Errorf("credit attack: a window over C + floor(rT) + %d + slack: %s", extra, worst)
	}
}

// cutAndHeal floods a key at 5x its rate over every node for 20 s, and
// blackholes region C's link to the global Redis from 3 s to 13 s.
func (f *regionFleet) cutAndHeal(t *testing.T, logf func(string, ...any)) {
	const before, cut, total = 3 * time.Second, 10 * time.Second, 20 * time.Second
	p := regionsPolicy
	r := p.refillPerSecond(t)
	timeout, err := time.ParseDuration(p.timeout)
	if err != nil {
		t.Fatal(err)
	}
	cooldown := redisbucket.DefaultBreakerCooldown // the nodes leave breaker_cooldown out
	c := f.regions[2]
	share := 1.0
	if withShareReconcileAndCredit {
		share = 1 / float64(fleetNodes)
	}

	var out []answer
	errs := f.storeErrors()
	loaded := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(loaded)
		out = f.paced("cut", 5*r, total)
	}()
	time.Sleep(time.Until(start.Add(before)))
	c.global.blackhole()
	cutAt := time.Now()
	time.Sleep(time.Until(start.Add(before + cut)))
	c.global.restore()
	restoredAt := time.Now()
	cutFor := restoredAt.Sub(cutAt)

	// When each of C's nodes next has a lease call answered.
	calls := f.leaseCalls(c)
	back := make([]time.Duration, len(c.nodes))
	for waiting := len(c.nodes); waiting > 0 && time.Since(restoredAt) < total-before-cut; time.Sleep(50 * time.Millisecond) {
		for k, n := range f.leaseCalls(c) {
			if back[k] == 0 && n > calls[k] {
				back[k] = time.Since(restoredAt)
				waiting--
			}
		}
	}
	<-loaded

	counts := tally(out)
	admitted := counts[200]
	wall, _ := span(out)
	most := allowance(p, r, wall)
	// A node decides alone from the cut until its calls are answered
	// again (its breaker's cool-down and a probe after the restore): that
	// is how long it was cut off, T_c of the bound.
	alone := cutFor + slices.Max(back)
	nCut := len(c.nodes)
	extra := nCut * (int(math.Floor(share*float64(p.capacity))) + int(math.Floor(share*r*alone.Seconds())))
	worst := worstWindow(out, p, r, extra)
	connected := worstWindow(out, p, r, 0)
	inC := f.inRegion(2)
	whileCut := longestTook(out, func(o answer) bool { return inC(o) && !o.sent.Before(cutAt) && o.sent.Before(restoredAt) })
	otherwise := longestTook(out, func(o answer) bool { return inC(o) && (o.sent.Before(cutAt) || !o.sent.Before(restoredAt)) })
	var slow []string
	for _, o := range out {
		if inC(o) && (o.took() > timeout+100*time.Millisecond || o.status == 0) {
			slow = append(slow, fmt.Sprintf("%d in %s, sent %s in", o.status, o.took().Round(time.Millisecond), o.sent.Sub(start).Round(time.Millisecond)))
		}
	}
	_, shares := f.regionShares(out)
	withinRun := float64(admitted) <= 1.01*float64(most)
	logf("cut and heal, %d requests at %.0f/s over %s, region C cut off %s from %s in (deciding alone %s): statuses %v; admitted %d, %.3f of the allowance %d (at most 1.01 with reconcile: %s); by region %s; worst window against C + floor(rT) + %d: %s; against C + floor(rT): %s; slowest answer in C %s sent while cut, %s sent while connected; C's nodes' lease calls answered again %v after the restore; store errors %.0f; %s",
		len(out), 5*r, wall.Round(time.Millisecond), cutFor.Round(time.Millisecond), before, alone.Round(time.Millisecond), counts, admitted, float64(admitted)/float64(most), most, pending(withinRun),
		shares, extra, worst, connected, whileCut.Round(time.Millisecond), otherwise.Round(time.Millisecond), back, f.storeErrors()-errs, f.leaseCounts())
	if counts[200]+counts[429] != len(out) {
		t.Errorf("cut: statuses %v, want only 200 and 429", counts)
	}
	if worst.excess > 0 {
		t.Errorf("cut: a window over C + floor(rT) + %d + slack: %s", extra, worst)
	}
	if len(slow) > 0 {
		t.Errorf("cut: %d answers in region C took more than timeout + 100 ms: %v", len(slow), slow)
	}
	for k, d := range back {
		if d == 0 || d > cooldown+timeout+time.Second {
			t.Errorf("cut: node %d of region C had a lease call answered %s after the restore (0: never), want within %s",
				f.nodes[c.nodes[k]].port, d, cooldown+timeout+time.Second)
		}
	}
	// The mutation check of the windows: plain `local` lets the cut-off
	// region decide alone at the whole limit, which the connected bound
	// must catch.
	if !withShareReconcileAndCredit && connected.excess <= 0 {
		t.Errorf("cut with plain on_store_error local: no window over the connected bound C + floor(rT) (worst %s): the window check missed the cut region's own admissions", connected)
	}
	if withShareReconcileAndCredit && !withinRun {
		t.Errorf("cut with reconcile: admitted %d over %s, more than the allowance %d + 1%%", admitted, wall, most)
	}
}

// TestWorstWindowFindsAnAdmissionOverTheBound checks the chaos test's
// window check on made-up answers, at 10 and 1/s: a bucket's own
// admissions (10 at once, 10 more once it has refilled, then one a
// second) hold with no room to spare, and one admission more after the
// refill exceeds the bound by one, or meets it with an extra token
// allowed. Windows that start at the first admission alone would not see
// it: from there the bucket had 30 s to refill.
func TestWorstWindowFindsAnAdmissionOverTheBound(t *testing.T) {
	t.Parallel()
	p := attackPolicy
	r := p.refillPerSecond(t)
	at := time.Unix(1_800_000_000, 0)
	admitted := func(d time.Duration) answer { return answer{status: 200, sent: at.Add(d), done: at.Add(d)} }
	const refilled = 30 * time.Second
	var held []answer
	for range p.capacity {
		held = append(held, admitted(0), admitted(refilled))
	}
	for k := 1; k <= 5; k++ {
		d := refilled + time.Duration(k)*time.Second
		held = append(held, admitted(d), answer{status: 429, sent: at.Add(d), done: at.Add(d)})
	}
	if w := worstWindow(held, p, r, 0); w.excess != 0 {
		t.Errorf("one bucket's admissions: worst window %s, want +0", w)
	}
	for _, d := range []time.Duration{0, 2500 * time.Millisecond, 5 * time.Second} {
		over := append(slices.Clone(held), admitted(refilled+d))
		if w := worstWindow(over, p, r, 0); w.excess != 1 {
			t.Errorf("one admission more, %s after the refill: worst window %s, want +1", d, w)
		}
		if w := worstWindow(over, p, r, 1); w.excess != 0 {
			t.Errorf("one admission more, %s after the refill, one extra allowed: worst window %s, want +0", d, w)
		}
	}
}
