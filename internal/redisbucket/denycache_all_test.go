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
