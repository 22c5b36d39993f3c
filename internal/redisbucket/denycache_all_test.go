package redisbucket

import (
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// evalCalls is how many scripts Redis has run since its stats were reset.
func evalCalls(t *testing.T, srv *redistest.Server) int {
	t.Helper()
	info := srv.Do("INFO", "commandstats").(string)
	n := 0
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), cmd); ok {
				var c int
				for _, ch := range rest {
					if ch < '0' || ch > '9' {
						break
					}
					c = c*10 + int(ch-'0')
				}
				n += c
			}
		}
	}
	return n
}

// A flood on an exhausted tier of two limits costs no Redis call until its
// retry time (issue 25): the deny cache answers it, with each limit's
// answer as Redis gave it.
func TestDenyCacheServesTiersOfSeveralLimits(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 2 * time.Second})
	ls := []bucket.Limit{
		{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 60_000_000}},
		{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}},
	}
	key := bucketFor("several-denied")
	out := make([]bucket.Result, 2)
	for range 2 {
		if ok, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, out); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if ok, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, out); err != nil || ok {
		t.Fatalf("the third: %v %v", ok, err)
	}
	first := out[0]
	srv.Do("CONFIG", "RESETSTAT")
	for range 1000 {
		if ok, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, out); err != nil || ok {
			t.Fatalf("the flood: %v %v", ok, err)
		}
	}
	if n := evalCalls(t, srv); n != 0 {
		t.Errorf("1000 denied requests made %d script calls, want 0 (the deny cache)", n)
	}
	if out[0].RetryAfter <= 0 || out[0].RetryAfter > first.RetryAfter || out[1].Remaining != 98 {
		t.Errorf("the cached answers: %+v (first %+v)", out, first)
	}
	// A give-back ends what the cache knew.
	if err := s.GiveBack(bg, key, bucket.Tier{Limits: ls}, 1, 1, 0); err != nil {
		t.Fatal(err)
	}
	if ok, err := s.Take(bg, key, bucket.Tier{Limits: ls}, 1, out); err != nil || !ok {
		t.Fatalf("after a give-back: %v %v; want allowed", ok, err)
	}
}

// A denial the deny cache answers never says it started a ban: only
// Redis's did (bans_total counts each ban once).
func TestDenyCacheAnswerStartsNoBan(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 2 * time.Second})
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 60_000_000}, Ban: 3_600_000_000}
	key := bucketFor("banned-once")
	if res, err := s.takeLimit(bg, key, l, 1); err != nil || !res.Allowed {
		t.Fatal(res, err)
	}
	res, err := s.takeLimit(bg, key, l, 1)
	if err != nil || res.Allowed || !res.Banned {
		t.Fatalf("the banning denial: %+v %v", res, err)
	}
	for range 5 {
		if res, err := s.takeLimit(bg, key, l, 1); err != nil || res.Allowed || res.Banned {
			t.Fatalf("a later denial: %+v %v; want refused, starting no ban", res, err)
		}
	}
}

// The deny cache serves tiers with quotas too: a client refused by its
// monthly quota costs no script call until its retry time.
func TestTheDenyCacheServesTiersWithQuotas(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 2 * time.Second})
	ls := []bucket.Limit{
		{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}},
		{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 60_000_000}},
	}
	qs := []bucket.Quota{{N: 2, Period: bucket.Month, Loc: time.UTC}}
	key := bucketFor("deny-quota")
	out, qout := make([]bucket.Result, 2), make([]bucket.Result, 1)
	for range 2 {
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || ok || qout[0].RetryAfter <= 0 {
		t.Fatalf("the third: %v %v %+v; want refused by the quota", ok, err, qout[0])
	}
	srv.Do("CONFIG", "RESETSTAT")
	for range 100 {
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || ok {
			t.Fatalf("the flood: %v %v", ok, err)
		}
	}
	if n := evalCalls(t, srv); n != 0 {
		t.Errorf("100 requests refused by the monthly quota made %d script calls, want 0 (the deny cache, until the month ends)", n)
	}
}

// A quota's refusal is cached for quotaDenyFor at most, not until its
// period ends (up to a year): a give-back on another node (count_status, a
// request refused a concurrency slot, a waiter that hung up) returns quota
// tokens in Redis but clears only that node's deny cache, and every other
// node sees it once quotaDenyFor has passed on its clock.
func TestAQuotaDenialDoesNotOutliveAnotherNodesGiveBack(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	nodeA := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	nodeB := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	clockB := new(fakeClock)
	clockB.micros.Store(1_000_000)
	nodeB.conn.now = clockB.now
	mid := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	nodeA.clockOffset, nodeB.clockOffset = mid, mid
	key := bucketFor("quota-giveback")
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
