package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"strings"
	"testing"
	"time"
)

// The bucket script's key lives "until every limit is full and every lease
// has expired" (redis_scripts.go), computed from the stored FullAt, which
// the cap that leases put on the level does not move: while tokens are out
// the level cannot refill past C - out, and the model (shared.go settle)
// has the level start refilling from there only when the lease's record
// expires. So the key can expire while the model's bucket still lacks
// tokens, and the next caller finds a full bucket. A node leases 50 of a
// bucket of 100 at 100/s, with a record of 200 ms (its lease_ttl, a sweep
// and its timeout): the stored FullAt is 0.5 s away, the record 0.2 s. The
// model's level is held at 50 until 0.2 s, then refills: about 81 at
// 0.51 s. The key is gone at 0.501 s, and Redis says 100. With the node
// spending its 50 at its lease_ttl (0.15 s) and a burst at 0.51 s taking
// the 100 Redis then has, the fleet takes 150 in 0.36 s, against
// C + floor(r*T) = 136.
func TestReviewRedisKeyExpiresWhileTheCappedLevelStillRefills(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time test (a key's expiry): skipped under -short")
	}
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 10_000}}} // 100 100/s
	key := string(bucketFor("capped"))
	a := bucket.LeaseAsk{Node: "n1", Seq: 1, Cost: 1, Want: 50, Hold: 200_000}
	v, err := s.call(bg, key, s.args("lease", bucket.Tier{Limits: ls}, 0, a.Cost, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend), false, leaseAnswer+2)
	if err != nil {
		t.Fatal(err)
	}
	leasedAt := v[7]
	sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	if want := sh.Lease(leasedAt, ls, a); v[0] != want.Granted || v[0] != 50 {
		t.Fatalf("lease: Redis granted %d, the model %d; want 50", v[0], want.Granted)
	}
	pttl := srv.Do("PTTL", key)
	redistest.WaitFor(t, 3*time.Second, "the key to expire", func() bool { return srv.Do("EXISTS", key) == int64(0) })
	var out, want [1]bucket.Result
	_, now, err := s.decideAt(bg, "peek", key, bucket.Tier{Limits: ls}, 0, out[:], false)
	if err != nil {
		t.Fatal(err)
	}
	sh.Peek(now, ls, want[:])
	t.Logf("PTTL after the lease %v ms; %d µs after the lease the key is gone: Redis %d left, the model %d", pttl, now-leasedAt, out[0].Remaining, want[0].Remaining)
	if out[0] != want[0] {
		t.Errorf("after the key expired, %d µs after the lease: Redis %+v, the model %+v", now-leasedAt, out[0], want[0])
	}
	// The burst: the node spent its 50 at its lease_ttl, 150 ms after the
	// lease; the fleet's strict takes now get what Redis has.
	burst, last := int64(0), now
	for {
		res, at, err := s.run(bg, key, ls[0], 1)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Allowed {
			break
		}
		burst, last = burst+1, at
	}
	spent := leasedAt + 150_000
	bound := ls[0].Capacity + (last-spent)*ls[0].Rate.Tokens/ls[0].Rate.Interval
	if 50+burst > bound {
		t.Errorf("the fleet took 50 + %d between %d and %d µs, more than C + floor(r*T) = %d", burst, spent, last, bound)
	}
}

// Leases with ban, on a real Redis: a client whose requests on one node
// come a lease_ttl apart (a login form's attempts, a client polling once a
// lease_ttl). Each request finds its lease just past lease_ttl: expire()
// sends the unused tokens back in the background, naming the lease, and
// the request's own lease call, sent at once with Held 0, reaches Redis
// first. It sets the record to 0 tokens and writes its own seq, so the
// give-back that follows names a seq Redis no longer has and returns
// nothing: the tokens are lost, and the lease call, finding the level
// short with nothing out, bans. One bucket (strict mode) allows all five
// attempts of `rate_limit 5 1/h`, ban 15m; leases refuse and ban the 4th.
// The node's clock is injected (requests 1 s apart, no sleeping); Redis's
// is real, so no record expires meanwhile.
func TestReviewRedisSpacedRequestsLoseTheirLeaseAndAreBannedUnderTheLimit(t *testing.T) {
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	for round := range 3 {
		s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Lease: "50%"})
		clock := new(fakeClock)
		clock.micros.Store(1_000_000)
		s.leases.close()
		s.leases = newLeaseTable(s, clock.now, LeaseSize{percent: 50}, time.Second, 100*time.Millisecond, 1000, nopLogger)
		b := bucketFor("spaced-" + string(rune('a'+round)))
		var got strings.Builder
		for range 5 {
			res, err := s.takeLimit(bg, b, l, 1)
			if err != nil {
				t.Fatal(err)
			}
			s.leases.calls.Wait()
			switch {
			case res.Allowed:
				got.WriteString("allowed ")
			case res.Banned:
				got.WriteString("BANNED ")
			default:
				got.WriteString("refused ")
			}
			clock.advance(time.Second)
		}
		s.leases.close()
		if got.String() != strings.Repeat("allowed ", 5) {
			t.Errorf("round %d: 5 attempts 1 s apart (lease_ttl 1s) on a limit of 5 an hour: %s; one bucket allows all 5", round, got.String())
		}
	}
}
