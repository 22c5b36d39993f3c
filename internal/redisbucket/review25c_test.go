package redisbucket

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Adversarial review of the fixes of issue 25's review (3cb8e39, 4743bce).
// Tests named ...Defect... FAIL on the code under review; the others probe
// and pass.

// FAILS. Breaks fix 1's claim "never blocks a request ... (probe errors,
// timeouts)" in its measurable form, DESIGN section 5's per-decision
// timeout: a decision has Redis's answer or an error within `timeout`, and
// on_store_error decides then.
//
// Mechanism: Store.decide (store.go:219-227) makes every request that
// finds an expired denial with a probe in flight wait on the probe's
// channel with only the request's own context (no deadline of the
// store's), then loop; denyCache.claim's done(false) (denycache.go:174-181)
// clears the probe, so the next waiter probes in its turn. The per-call
// timeout (store.go:505) applies to each probe alone: with Redis silent,
// the k-th request of a client's burst waits k timeouts, one probe after
// another, until the breaker opens (BreakerFailures in a row, 5 by
// default; any number here). Without a cached denial the same burst
// fails within one timeout (the control below).
//
// Fix: bound the wait by the store's timeout (select on a timer of
// s.timeout from the request's start, then answer the error, as a call
// would), or let the waiters share the probe's error instead of probing
// again: a probe that failed (err != nil) wakes its waiters with its
// error, as the lease table's shared call does (lease.go await).
func TestReview25cDefectDenyCacheWaitersWaitPastTheTimeout(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	const timeout = 300 * time.Millisecond
	// A decision's bound: the timeout, and half of it for the scheduler.
	const bound = timeout + timeout/2
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: timeout, BreakerFailures: 1000})
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	s.conn.now = clock.now
	ls := []bucket.Limit{slowLimit(1), slowLimit(5)}
	denied := bucketFor("review25c-denied")
	fresh := bucketFor("review25c-fresh")
	out := make([]bucket.Result, 2)
	if ok, err := s.Take(bg, denied, bucket.Tier{Limits: ls}, 1, out); err != nil || !ok {
		t.Fatalf("set-up: first take %v %v", ok, err)
	}
	if ok, err := s.Take(bg, denied, bucket.Tier{Limits: ls}, 1, out); err != nil || ok {
		t.Fatalf("set-up: second take %v %v; want a denial (cached)", ok, err)
	}
	// The denial expires (the limit refills within the hour), and Redis
	// falls silent.
	clock.advance(2 * time.Hour)
	proxy.Blackhole()

	burst := func(key []byte) time.Duration {
		const n = 6
		var wg sync.WaitGroup
		var mu sync.Mutex
		var slowest time.Duration
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				o := make([]bucket.Result, 2)
				begin := time.Now()
				_, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, o)
				took := time.Since(begin)
				if err == nil {
					t.Errorf("a take answered with Redis silent")
				}
				mu.Lock()
				slowest = max(slowest, took)
				mu.Unlock()
			}()
		}
		wg.Wait()
		return slowest
	}
	// Control: a client with no cached denial. Each call is bounded.
	if d := burst(fresh); d > bound {
		t.Fatalf("control: without a cached denial the slowest of 6 took %v (timeout %v); the test's bound does not hold here", d, timeout)
	}
	if d := burst(denied); d > bound {
		t.Errorf("after a cached denial expired, with Redis silent, the slowest of 6 concurrent requests took %v for its decision; the store's timeout is %v: a waiter first waits out the probe ahead of it (at c46dab4 they then probe one after another)", d.Round(time.Millisecond), timeout)
	}
}

// FAILS. Breaks fix 1's claim "never denies what Redis would allow beyond
// what the deny cache already did" for tiers with quotas (newly served by
// the deny cache), and docs/fleet.md's premise for caching a denial:
// "Tokens refill at a fixed rate, so nothing but a reset can make a bucket
// fill sooner".
//
// Mechanism: Store.decide (store.go:238-239) puts a quota's refusal with
// putAll, whose until is start + Binding(out,false).RetryAfter
// (denycache.go:145), and a quota's RetryAfter is the time to its period's
// end (script_ops.go:11): up to a month (a year for a yearly quota). A
// give-back on another node (count_status, a request refused a
// concurrency slot, a max_wait client that hung up) returns quota tokens
// in Redis (script_ops.go:248) but clears only ITS node's deny cache
// (quota.go:76): every other node that cached the refusal keeps refusing
// the client for the rest of the period, while Redis would admit it. Before
// the fix, quota refusals were not cached; a rate limit's refusal is
// cached for its refill time, seconds.
//
// Fix: cache a quota's refusal for a bounded time (e.g. at most the
// tier's shortest refill, or a fixed cap of a few seconds): the client
// then costs one call per cap, not per request, and a give-back elsewhere
// is seen within the cap. (An admin DELETE on another node has the same
// effect; docs/operating.md allows "until the Retry-After they gave",
// which for a quota is the period's end.)
//
// Fixed: a quota's refusal is cached for quotaDenyFor at most (store.go's
// remember); node B sees the give-back once that has passed on its clock.
func TestReview25cDefectQuotaDenialOutlivesAnotherNodesGiveBack(t *testing.T) {
	srv := redistest.Start(t)
	nodeA := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	nodeB := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	clockB := new(fakeClock)
	clockB.micros.Store(1_000_000)
	nodeB.conn.now = clockB.now
	mid := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	nodeA.clockOffset, nodeB.clockOffset = mid, mid
	key := bucketFor("review25c-quota-giveback")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	qs := []bucket.Quota{{N: 2, Period: bucket.Month, Loc: time.UTC}}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	take := func(s *Store) bool {
		t.Helper()
		ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	// Node A admits one request (at the origin); node B admits one and
	// refuses the next: the month's quota is used up.
	if !take(nodeA) || !take(nodeB) || take(nodeB) {
		t.Fatal("set-up: want allowed on A, allowed then refused on B")
	}
	// A's request gets a status that does not count: it gives back.
	taken := time.Now().UnixMicro() + mid
	if err := nodeA.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: qs}, 1, 1, taken); err != nil {
		t.Fatal(err)
	}
	if err := nodeA.peekQuotas(bg, key, ls, qs, out, qout); err != nil || qout[0].Remaining != 1 {
		t.Fatalf("Redis after the give-back: quota %d left (%v); want 1", qout[0].Remaining, err)
	}
	if take(nodeB) {
		t.Fatal("node B asked Redis at once: its refusal was not cached at all")
	}
	clockB.advance(quotaDenyFor)
	if !take(nodeB) {
		t.Errorf("node B refuses a request the quota has room for (Redis: 1 left) %s after it cached the refusal: it lasts until the month ends (retry after %s)", quotaDenyFor, time.Duration(qout[0].RetryAfter)*time.Microsecond)
	}
}

// review25cBounds are the bounds the quota tests use: the day and
// the month of the moment at, and the day before it.
func review25cBounds(at int64) (dayStart, dayEnd, yesterday, monthStart, monthEnd int64) {
	day := bucket.Quota{N: 1, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1, Period: bucket.Month, Loc: time.UTC}
	dayStart, dayEnd = day.Bounds(at)
	yesterday, _ = day.Bounds(dayStart - 1)
	monthStart, monthEnd = month.Bounds(at)
	return
}

// FAILS. Breaks fix 3's claim "the key's TTL covers them" (the counts of
// quotas a call does not name) for a count written in the old segment
// format, which every key written before this version holds.
//
// Mechanism: script.go:143-146 keeps an old-format segment
// ("q<p>:<start>:<used>", qe == "") of a quota the call does not name, but
// only a new-format one raises later; save (script.go:457) then sets the
// key's PX from the named quotas, limits and leases alone, shorter than
// the month the old binary gave it. Here a month quota's count (7 of the
// current month) sits beside the day quota the call names: the key, which
// lived until the month's end, now dies at the day's end, and with it the
// month's count; a config that names the month again (the reload's
// rollback, or a rolling reload's other nodes) starts it over mid-month.
//
// Fix: for an old-format segment, keep the key's remaining life
// (redis.call('PTTL')) as a floor, or rewrite it in the new format with
// end = now + PTTL (the old version set the key's TTL to its period's end).
func TestReview25cDefectOldFormatQuotaCountOutlivesTheCallThatDoesNotNameIt(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, dayEnd, _, monthStart, monthEnd := review25cBounds(now)
	key := string(bucketFor("review25c-old-format-ttl"))
	// As the version before wrote it: limit 1 full, the month's count in
	// the old format, the key living until the month's end.
	srv.Do("SET", key, fmt.Sprintf(";q3:%d:7", monthStart), "PX", (monthEnd-now)/1000)
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	if ok, err := s.takeQuotas(bg, []byte(key), ls, []bucket.Quota{day}, 1, out, qout); err != nil || !ok {
		t.Fatal(ok, err)
	}
	v, _ := srv.Do("GET", key).(string)
	if !strings.Contains(v, fmt.Sprintf("q3:%d:7", monthStart)) {
		t.Fatalf("the month's count is gone from the key: %q", v)
	}
	ttl := srv.Do("PTTL", key).(int64) * 1000
	if ttl < (monthEnd-now)-60*second {
		t.Errorf("the key holding the month's count (7) now expires in %s, at the day's end (%s away); the month ends in %s: the count dies with the key",
			time.Duration(ttl)*time.Microsecond, time.Duration(dayEnd-now)*time.Microsecond, time.Duration(monthEnd-now)*time.Microsecond)
	}
}

// FAILS. Breaks fix 3's claim "a reload that drops a quota doesn't keep a
// stale count forever" for counts in the old segment format.
//
// Mechanism: script.go:143 keeps an unnamed segment while
// the test `qe == "" or tonumber(qe) > now`: an old-format segment has an empty qe, so
// it is kept by every call, whatever its period, as long as the key is
// written; nothing ever drops it. Here yesterday's count of a day quota
// the config no longer has stays in the key through every take today (and
// would for good).
//
// Fix: an unnamed old-format segment whose period cannot be dated should
// go (its quota is not named: no call reads it), or be dated from the
// key's PTTL as in the test above, then dropped at that end.
func TestReview25cDefectOldFormatStaleCountOfADroppedQuotaStaysForever(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, _, yesterday, monthStart, monthEnd := review25cBounds(now)
	key := string(bucketFor("review25c-old-format-stale"))
	// The version before: a day and a month quota; yesterday's day count
	// stayed in the key, which lives until the month's end.
	srv.Do("SET", key, fmt.Sprintf(";q1:%d:5;q3:%d:9", yesterday, monthStart), "PX", (monthEnd-now)/1000)
	// The config now has the month quota only.
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	for range 3 {
		if ok, err := s.takeQuotas(bg, []byte(key), ls, []bucket.Quota{month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if qout[0].Remaining != 1000-12 {
		t.Fatalf("the month's quota: %d left, want %d (the old count read)", qout[0].Remaining, 1000-12)
	}
	v, _ := srv.Do("GET", key).(string)
	if stale := fmt.Sprintf("q1:%d:5", yesterday); strings.Contains(v, stale) {
		t.Errorf("yesterday's count of a dropped day quota (%s) is still in the key after today's takes: %q; an old-format segment is kept by every call", stale, v)
	}
}

// Probe (passes): a new-format count of a quota the call does not name is
// kept, with the key living until its period ends, and is read again by a
// call that names it.
func TestReview25cUnnamedNewFormatCountKeptUntilItsEnd(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, _, _, _, monthEnd := review25cBounds(now)
	key := bucketFor("review25c-new-format")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 2)
	for range 4 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day, month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	for range 3 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day}, 1, out, qout[:1]); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if ttl := srv.Do("PTTL", string(key)).(int64) * 1000; ttl < (monthEnd-now)-60*second {
		t.Errorf("PTTL %s; the month's count needs %s", time.Duration(ttl)*time.Microsecond, time.Duration(monthEnd-now)*time.Microsecond)
	}
	if err := s.peekQuotas(bg, key, ls, []bucket.Quota{day, month}, out, qout); err != nil {
		t.Fatal(err)
	}
	if qout[0].Remaining != 43 || qout[1].Remaining != 996 {
		t.Errorf("day %d left, month %d left; want 43 and 996", qout[0].Remaining, qout[1].Remaining)
	}
}
