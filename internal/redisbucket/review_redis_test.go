package redisbucket

import (
	"fmt"
	"maps"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// "The Redis script is the model, step for step, to the unit", and
// maxDeficit bounds a debt "within what the Redis script computes exactly"
// (bucket.go). At the deepest debt, units + 2^52 is up to 2^53, and the
// script's doubles are no longer exact: ceildiv(d, tok) adds tok-1 to a d
// near 2^53, and a FullAt of now + maxd/tok passes 2^53 when a bucket takes
// more than about 87 years to refill from empty. Two limits Validate
// accepts: 2^32 tokens at 3 per 1.048576 s (units exactly 2^52), and an
// annual quota, `limit 100 1/365d`. A charge the origin reports as huge
// (cost_from_response, bounded to maxDeficit) leaves Redis with another
// state than the model, and the next request gets another Retry-After or
// reset, by a microsecond.
func TestReviewRedisScriptDiffersFromTheModelAtTheDeepestDebt(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	r1, err := bucket.ParseRate("3/1.048576s")
	if err != nil {
		t.Fatal(err)
	}
	r2, err := bucket.ParseRate("1/365d")
	if err != nil {
		t.Fatal(err)
	}
	for li, l := range []bucket.Limit{{Capacity: 1 << 32, Rate: r1}, {Capacity: 100, Rate: r2}} {
		if err := l.Validate(1); err != nil {
			t.Fatal(err)
		}
		ls := []bucket.Limit{l}
		mismatches := 0
		for k := range 4 {
			key := string(bucketFor(fmt.Sprintf("deep-%d-%d", li, k)))
			sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
			for _, o := range []struct {
				op string
				n  int64
			}{{"charge", 1 << 40}, {"take", 1}, {"giveback", 5}, {"charge", 7}, {"take", 1}} {
				want := 2
				if o.op == "take" {
					want = 8
				}
				v, err := s.call(bg, key, s.args(o.op, bucket.Tier{Limits: ls}, 0, o.n), false, want)
				if err != nil {
					t.Fatalf("limit %+v %s: %v", l, o.op, err)
				}
				var now int64
				switch o.op {
				case "charge":
					now = v[1]
					sh.Charge(now, ls, o.n)
				case "giveback":
					now = v[1]
					sh.GiveBack(now, ls, o.n)
				case "take":
					now = v[2]
					var out [1]bucket.Result
					sh.Take(now, ls, o.n, out[:])
					if got := (bucket.Result{Allowed: v[3] == 1, Remaining: v[4], RetryAfter: v[5], ResetAfter: v[6]}); got != out[0] {
						mismatches++
						t.Errorf("limit %+v, a request in the deepest debt: Redis %+v, the model %+v", l, got, out[0])
					}
				}
				raw, err := rdb.Get(bg, key).Result()
				if err != nil && err != redis.Nil {
					t.Fatal(err)
				}
				if stored, want := decodeStored(t, raw), encodeShared(sh, now); !maps.Equal(stored, want) {
					mismatches++
					t.Errorf("limit %+v after %s %d: Redis holds %v, the model %v", l, o.op, o.n, stored, want)
				}
				if mismatches >= 2 {
					break
				}
			}
			if mismatches >= 2 {
				break
			}
		}
	}
}
