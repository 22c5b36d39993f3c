package ratelimit

import (
	"encoding/json"
	"fmt"
	"math"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Leases on a tier of several limits, on real processes (the harness of
// lease_process_test.go): one lease call takes from every limit of the
// tier at once, the smallest level bounds what it grants, and a flood on
// an exhausted tier waits out the retry time of the limit that makes it
// wait longest.

// tierAllowance is what one bucket of limits ls admits at most over d:
// the least, over its limits, of C + floor(r*d).
func tierAllowance(ls []bucket.Limit, d time.Duration) int {
	most := math.MaxInt
	for _, l := range ls {
		most = min(most, int(l.Capacity+d.Microseconds()*l.Rate.Tokens/l.Rate.Interval))
	}
	return most
}

// sharedLevels is the whole tokens left in each limit of key's shared
// bucket, in the tier's order, as node i reads them from Redis.
func (f *leaseFleet) sharedLevels(i int, key string) []int64 {
	f.t.Helper()
	var b bucketState
	text := f.adminGet(f.nodes[i], "/rate_limit/buckets?policy=fleet&keyer=header&value="+url.QueryEscape(key))
	if err := json.Unmarshal([]byte(text), &b); err != nil {
		f.t.Fatalf("bucket %q: %v in %s", key, err, text)
	}
	var levels []int64
	for _, l := range b.Limits {
		levels = append(levels, l.Remaining)
	}
	return levels
}

// name is the policy's tier and store mode, as a subtest's name.
func (p fleetPolicy) name() string {
	limits := append([]string{fmt.Sprintf("%d %s", p.capacity, p.refill)}, p.limits...)
	mode := "strict"
	if p.lease != "" {
		mode = "lease " + p.lease
	}
	return strings.Join(limits, " + ") + ", " + mode
}

// sentWithin is the answers to the requests sent within d of the first.
func sentWithin(out []answer, d time.Duration) []answer {
	var in []answer
	for _, o := range out {
		if o.sent.Sub(out[0].sent) < d {
			in = append(in, o)
		}
	}
	return in
}

// TestLeaseTierOfTwoLimitsOnFourNodes floods one key of a tier of two
// limits over 4 nodes, 20 ms each way from Redis, with leases:
//   - the issue's tier, `rate_limit 10 1/s` and `limit 100 1/m`, at 40
//     requests a second for 6 s. `lease 10%` would be 1 token here (10%
//     of 10), which is strict mode: the store leases only when the tier's
//     lease size, the least of its limits', is more than the cost. So
//     `lease 5`, the most a capacity of 10 allows (half of it). The per-
//     minute limit cannot bind within the test (the per-second one admits
//     16 in 6 s), so the test checks that every admission was taken from
//     it too: its level plus what was admitted is no more than its
//     capacity and refill. After the first second it admits about one a
//     second, so its median is of about 5 requests.
//   - a tier whose second limit binds within the test, `rate_limit 200
//     50/s` and `limit 300 1/m`, `lease 10%` (20 tokens), at 400 a second
//     for 4 s: the per-second limit binds over the first second, the per-
//     minute one from about 2 s on.
//
// Each admits no more than one bucket of both limits could over the wall
// span (the least of C_i + floor(r_i*T)), over the first second too; only
// 200 and 429 are answered; and the requests allowed after the first
// second are answered from memory (median under one way to Redis): on the issue's tier
// too, since a node held off by a refused lease fetches the next one a
// round trip before its hold-off ends, and spends it in memory. Strict
// mode's median on the issue's tier is measured beside it: at least a
// round trip through the proxy.
func TestLeaseTierOfTwoLimitsOnFourNodes(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	issue := fleetPolicy{capacity: 10, refill: "1/s", limits: []string{"100 1/m"}, lease: "5", timeout: "1s"}
	both := fleetPolicy{capacity: 200, refill: "50/s", limits: []string{"300 1/m"}, lease: "10%", timeout: "1s"}
	f := startLeaseFleet(t, 4, wanDelay, issue)
	for _, tc := range []struct {
		p    fleetPolicy
		rate float64
		d    time.Duration
	}{
		{issue, 40, 6 * time.Second},
		{both, 400, 4 * time.Second},
	} {
		t.Run(tc.p.name(), func(t *testing.T) {
			f.reload(tc.p)
			key := "two-limits " + tc.p.name()
			f.warmUpOn("warm-up " + key)
			floodTwoLimits(t, f, tc.p, key, tc.rate, tc.d)
		})
	}

	// The issue's tier in strict mode, for one second: the comparison.
	strict := issue
	strict.lease = ""
	f.reload(strict)
	out := f.paced("two-limits strict", 40, time.Second)
	counts := tally(out)
	median, n := medianTook(out, func(o answer) bool { return o.status == 200 })
	wall, _ := span(out)
	t.Logf("%s, the same flood for 1 s: statuses %v; median of the %d allowed %s", strict.name(), counts, n, median)
	if most := tierAllowance(strict.tier(t), wall); counts[200] > most {
		t.Errorf("strict mode admitted %d, more than its allowance %d over %s", counts[200], most, wall)
	}
	if n == 0 || median < 2*wanDelay {
		t.Errorf("strict mode's median %s (of %d allowed): want at least the round trip through the proxy, %s", median, n, 2*wanDelay)
	}
}

// floodTwoLimits sends key at rate over the fleet for d, and checks what
// TestLeaseTierOfTwoLimitsOnFourNodes says.
func floodTwoLimits(t *testing.T, f *leaseFleet, p fleetPolicy, key string, rate float64, d time.Duration) {
	t.Helper()
	ls := p.tier(t)
	before := f.scriptCalls()
	out := f.paced(key, rate, d)
	calls := f.scriptCalls() - before
	afterGiveBacks()
	levels := f.sharedLevels(0, key)
	elapsed := time.Since(out[0].sent)

	counts := tally(out)
	admitted := counts[200]
	wall, sending := span(out)
	most := tierAllowance(ls, wall)
	firstSecond := sentWithin(out, time.Second)
	firstWall, _ := span(firstSecond)
	median, n := medianTook(out, func(o answer) bool { return o.status == 200 && o.sent.Sub(out[0].sent) >= time.Second })
	t.Logf("%d requests at %.0f/s over %d nodes, wall span %s: statuses %v; admitted %d, allowance of both limits %d (%.3f of the %d over the sending span); in the first second %d, allowance %d; one bucket on the same arrivals %d; median of the %d allowed after the first second %s; script calls %d; levels %v %s after the first request; %s",
		len(out), rate, len(f.nodes), wall.Round(time.Millisecond), counts, admitted, most, float64(admitted)/float64(tierAllowance(ls, sending)), tierAllowance(ls, sending),
		tally(firstSecond)[200], tierAllowance(ls, firstWall), strictAdmits(ls, out), n, median, calls, levels, elapsed.Round(time.Millisecond), f.leaseCounts())
	if counts[200]+counts[429] != len(out) {
		t.Errorf("statuses %v: want only 200 and 429", counts)
	}
	if admitted > most {
		t.Errorf("admitted %d, more than the allowance of both limits, %d over %s", admitted, most, wall)
	}
	if got, most := tally(firstSecond)[200], tierAllowance(ls, firstWall); got > most {
		t.Errorf("admitted %d of the requests sent in the first second, more than the allowance of both limits, %d over %s", got, most, firstWall)
	}
	// Every admission took from every limit: no limit holds more than its
	// capacity and refill less what was admitted.
	if len(levels) != len(ls) {
		t.Fatalf("the admin API shows %d limits, want %d", len(levels), len(ls))
	}
	for i, l := range ls {
		if most := tierAllowance([]bucket.Limit{l}, elapsed); int(levels[i])+admitted > most {
			t.Errorf("limit %d (%d at %d per %s) holds %d after %d admitted: more than its capacity and refill over %s, %d, so some admissions did not take from it",
				i+1, l.Capacity, l.Rate.Tokens, time.Duration(l.Rate.Interval)*time.Microsecond, levels[i], admitted, elapsed, most)
		}
	}
	// From memory, not through the store: under one way to Redis, so no
	// round trip (2 x wanDelay) is in it. Quiet, the median is about 1 ms;
	// 4 Caddy processes under -race on a loaded runner made it 5.75 ms.
	if n == 0 || median >= wanDelay {
		t.Errorf("median latency of the %d requests allowed after the first second: %s, want < %s (no round trip)", n, median, wanDelay)
	}
}

// TestFloodOnExhaustedTwoLimitTierCostsOneCallPerRetry exhausts one key
// of a tier of two limits over 4 nodes, 20 ms each way from Redis, then
// floods it at 200 requests a second for 3 s, in strict mode (the deny
// cache) and with leases (hold-offs):
//   - `rate_limit 10 1/s` and `limit 100 1/m`: the per-second limit binds,
//     and the 429s say Retry-After: 1;
//   - `rate_limit 10 1/s` and `limit 10 1/m`: both are empty, and the
//     per-minute limit makes the client wait longest: a node that waited
//     only for the per-second limit would call Redis every second.
//
// Redis runs at most one script call per node per retry period P (the
// least Retry-After of the flood's 429s): nodes x (ceil(T/P) + 1) over the
// flood's wall span T, the 1 for a retry time that falls inside the
// flood's first and last periods. Besides those, one call for each
// request admitted during the flood: in strict mode an admission is a
// call that leaves no denial to remember, so the node's next request asks
// again; with leases, each lease granted during the flood (one per
// admission, the flood spends each at once) leaves a record that goes
// back lease_ttl later. With leases, also one give-back per node of the
// lease it held when the flood began.
//
// The flood's admissions also stay within the allowance of both limits.
//
// Strict mode fails the first tier: a node's deny cache remembers a
// denial only once its answer is back, so every request the node takes in
// the round trip after a retry time goes to Redis too (leases share one
// call in flight per bucket; strict mode does not), and the retry times
// are the next token's, under a second, while Retry-After rounds them up
// to 1. This is strict mode's, not the tier's: the per-second limit
// alone, `rate_limit 10 1/s`, made 56 calls in the same flood when this
// test was written.
func TestFloodOnExhaustedTwoLimitTierCostsOneCallPerRetry(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process load (4 Caddy processes, a delayed Redis)")
	perSecond := fleetPolicy{capacity: 10, refill: "1/s", limits: []string{"100 1/m"}, timeout: "1s"}
	perMinute := fleetPolicy{capacity: 10, refill: "1/s", limits: []string{"10 1/m"}, timeout: "1s"}
	f := startLeaseFleet(t, 4, wanDelay, perSecond)
	const flood = 3 * time.Second
	for _, p := range []fleetPolicy{perSecond, perMinute} {
		for _, lease := range []string{"", "5"} {
			p.lease = lease
			t.Run(p.name(), func(t *testing.T) {
				f.reload(p)
				key := "exhausted " + p.name()
				f.warmUpOn("warm-up " + key)
				exhaust := f.paced(key, 40, 500*time.Millisecond)
				before := f.scriptCalls()
				out := f.paced(key, 200, flood)
				if p.lease != "" {
					afterGiveBacks()
				}
				calls := f.scriptCalls() - before
				floodCalls(t, f, p, exhaust, out, calls)
			})
		}
	}
}

// floodCalls checks the script calls of a flood, out, on a key exhausted
// by exhaust, as TestFloodOnExhaustedTwoLimitTierCostsOneCallPerRetry
// says.
func floodCalls(t *testing.T, f *leaseFleet, p fleetPolicy, exhaust, out []answer, calls int) {
	t.Helper()
	counts := tally(out)
	if counts[429] == 0 || tally(exhaust)[429] == 0 {
		t.Fatalf("statuses %v exhausting, %v flooding: want the key exhausted, and the flood refused", tally(exhaust), counts)
	}
	var retries []int
	waited := make([]int, len(f.nodes))
	for _, o := range out {
		if o.status == 429 {
			retries = append(retries, o.retryAfter)
		}
		if o.took() >= 2*wanDelay {
			waited[o.node]++
		}
	}
	period := slices.Min(retries)
	wall, _ := span(out)
	perNode := int(math.Ceil(wall.Seconds()/float64(max(period, 1)))) + 1
	bound, giveBacks := len(f.nodes)*perNode+counts[200], ""
	if p.lease != "" {
		bound, giveBacks = bound+len(f.nodes), " + a give-back per node"
	}
	all := append(slices.Clone(exhaust), out...)
	allWall, _ := span(all)
	t.Logf("exhausted by %d requests at 40/s: statuses %v; a flood of %d at 200/s over %s: statuses %v, Retry-After %d to %d s; script calls %d, bound %d (%d nodes x %d periods + %d admitted%s); answers that waited on a round trip, by node: %v; %s",
		len(exhaust), tally(exhaust), len(out), wall.Round(time.Millisecond), counts, period, slices.Max(retries), calls, bound,
		len(f.nodes), perNode, counts[200], giveBacks, waited, f.leaseCounts())
	if counts[200]+counts[429] != len(out) {
		t.Errorf("statuses %v: want only 200 and 429", counts)
	}
	if admitted, most := tally(all)[200], tierAllowance(p.tier(t), allWall); admitted > most {
		t.Errorf("admitted %d over %s, more than the allowance of both limits, %d", admitted, allWall, most)
	}
	if period < 1 {
		t.Errorf("a 429 with Retry-After %d: want at least 1", period)
	}
	if calls > bound {
		t.Errorf("%d script calls for a flood of %d over %s on an exhausted key, more than one per node per retry period of %d s and one per admission: %d; answers that waited on a round trip, by node: %v",
			calls, len(out), wall.Round(time.Millisecond), period, bound, waited)
	}
}
