package ratelimit

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// A denial under a ban empties the bucket for the ban from that moment;
// denials during the ban do not extend it; Retry-After is the ban left;
// when it ends, the bucket refills from empty.
func TestBanHoldsTheBucketEmptyThenRefillsFromEmpty(t *testing.T) {
	sec := int64(1_000_000)
	l := Limit{Capacity: 3, Rate: Rate{Tokens: 1, Interval: sec}, Ban: 60 * sec}
	var st State
	now := 10 * sec
	for range 3 {
		st, _ = Take(st, now, l, 1)
	}
	st, res := Take(st, now, l, 1) // the denial that bans
	if res.Allowed || res.RetryAfter != 61*sec {
		t.Fatalf("the banning denial: %+v, want denied with 61 s to wait (the ban, then one token)", res)
	}
	// Denials during the ban say the ban left, and do not extend it.
	for _, at := range []int64{1, 30, 59} {
		var r Result
		st, r = Take(st, now+at*sec, l, 1)
		if r.Allowed || r.RetryAfter != (61-at)*sec {
			t.Fatalf("%d s into the ban: %+v, want denied with %d s to wait", at, r, 61-at)
		}
	}
	if _, r := Take(st, now+60*sec+sec/2, l, 1); r.Allowed {
		t.Fatalf("half a second after the ban: allowed; the bucket should refill from empty")
	}
	st, r := Take(st, now+61*sec, l, 1)
	if !r.Allowed || r.Remaining != 0 {
		t.Fatalf("a second after the ban: %+v, want the one token refilled since", r)
	}
	if _, r := Take(st, now+61*sec, l, 1); r.Allowed {
		t.Fatal("a second request at the same moment was allowed")
	}
}

// The take and lease scripts ban as bucket.go does, to the unit, on random
// traces against a real redis-server.
func TestRedisBanMatchesTheModel(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second)})
	rng := rand.New(rand.NewPCG(10, 15))
	for i := range 30 {
		tr := newRandomTrace(rng)
		l := tr.limit
		l.Ban = 1 + rng.Int64N(3*l.units()/l.Rate.Tokens)
		key := s.key(bucketFor("ban-" + strconv.Itoa(i)))
		var st State
		for j := range tr.gaps {
			s.clockOffset += tr.gaps[j]
			cost := min(tr.costs[j], l.Capacity)
			if rng.IntN(3) == 0 {
				want := cost + rng.Int64N(l.Capacity-cost+1)
				vals, err := s.call(bg, leaseBucketScript, key, []any{l.Capacity, l.Rate.Tokens, l.Rate.Interval, cost, s.clockOffset, want, l.Ban}, false)
				if err != nil {
					t.Fatal(err)
				}
				var res LeaseResult
				st, res = Lease(st, vals[4], l, cost, want)
				if got := (LeaseResult{Granted: vals[0], Remaining: vals[1], HoldOff: vals[2], ResetAfter: vals[3]}); got != res {
					t.Fatalf("trace %d step %d lease (limit %+v, cost %d, want %d): Redis %+v, Lease %+v", i, j, l, cost, want, got, res)
				}
				continue
			}
			got, now, err := s.run(bg, key, l, cost)
			if err != nil {
				t.Fatal(err)
			}
			var want Result
			st, want = Take(st, now, l, cost)
			if got != want {
				t.Fatalf("trace %d step %d take (limit %+v, cost %d): Redis %+v, Take %+v", i, j, l, cost, got, want)
			}
		}
	}
}
