package redisbucket

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// checkLeaseShortEdges plays the short forms' traces (checkLeaseShortForms)
// at their edges: a record holding more than the capacity (a reload that
// cut it), a node saying it holds more than its record, asks and
// give-backs of several capacities, a lease expiring at the call's moment,
// a level exactly at the cap the lease puts on it, huge capacities, and a
// reload that changes the limit within the trace.
func checkLeaseShortEdges(s *Store, rdb *redis.Client, rng *rand.Rand, traces, steps int) error {
	for ti := range traces {
		s.clockOffset = 0
		base := time.Now().UnixMicro() + 2*second
		l := modelValid([]bucket.Limit{modelLimit(rng)}, 0, 0)[0]
		if rng.IntN(4) == 0 {
			l.Capacity = (1 << 52) / l.Rate.Interval
		}
		ls := []bucket.Limit{l}
		sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
		m := &modelTrace{ls: ls, sh: sh}
		full := refillOf(l)
		c := min(l.Capacity, 40)
		held := 1 + rng.Int64N(3*c)
		switch ti % 4 {
		case 1:
			// The level exactly at the cap of what the node holds.
			f := min(held, l.Capacity) * l.Rate.Interval
			sh.Levels[0] = bucket.StateAt(base, f, l)
			sh.Held = []buckettest.Held{{Node: "a1", Tokens: held, Expires: base + 1 + rng.Int64N(full+1), Seq: 1}}
		case 2:
			sh.Levels[0] = bucket.State{FullAt: base + min(full+1+rng.Int64N(20*full+1), deepestGap(l)), Slack: rng.Int64N(l.Rate.Tokens)}
			sh.Held = []buckettest.Held{{Node: "a1", Tokens: held, Expires: base + rng.Int64N(3*second), Seq: 1}}
		case 3:
			sh.Levels[0] = bucket.State{FullAt: base + rng.Int64N(full+1), Slack: rng.Int64N(l.Rate.Tokens)}
			sh.Held = []buckettest.Held{{Node: "a1", Tokens: held, Expires: base + rng.Int64N(min(2*full, 3600*second)+1), Seq: 1}}
		}
		key := string(bucketFor(fmt.Sprint("lease-short-edge-", ti)))
		if text := r34Text(sh, nil); text == "" {
			if err := rdb.Del(bg, key).Err(); err != nil {
				return err
			}
		} else if err := rdb.Set(bg, key, text, time.Hour).Err(); err != nil {
			return err
		}
		seq := int64(1)
		for j := range steps {
			if j > 0 {
				s.clockOffset += rng.Int64N(2*min(full, 3600*second)+1) * int64(rng.IntN(4)) / 3
			}
			if rng.IntN(8) == 0 {
				// A reload: the next calls name another limit.
				old := m.ls
				nl := modelValid([]bucket.Limit{modelLimit(rng)}, 0, 0)[0]
				l, ls = nl, []bucket.Limit{nl}
				m.ls = ls
				full, c = refillOf(l), min(l.Capacity, 40)
				now := time.Now().UnixMicro() + s.clockOffset
				if err := keepForReload(rdb, key, m, now, old); err != nil {
					return err
				}
			}
			what := fmt.Sprintf("trace %d step %d: limit %+v", ti, j, l)
			before, err := rdb.Get(bg, key).Result()
			if err != nil && err != redis.Nil {
				return err
			}
			sent := time.Now()
			var now int64
			if rng.IntN(3) > 0 {
				seq++
				cost := 1 + rng.Int64N(c)
				a := bucket.LeaseAsk{Node: "a1", Seq: seq, Held: rng.Int64N(3*c + 1), Cost: cost, Want: min(l.Capacity, cost+rng.Int64N(3*c+1)), Hold: rng.Int64N(3 * min(full, 3600*second))}
				if rng.IntN(4) == 0 {
					a.Want = l.Capacity
				}
				prefetch := 0
				switch rng.IntN(3) {
				case 0:
					a.Spend = cost
				case 1:
					a.Prefetch, prefetch = true, 1
				}
				v, err := s.call(bg, key, s.leaseArgs(bucket.Tier{Limits: ls}, a), false, leaseAnswer+2)
				if err != nil {
					return fmt.Errorf("%s: lease %+v: %w", what, a, err)
				}
				_ = prefetch
				now = v[7]
				got := bucket.LeaseResult{Granted: v[0], Remaining: v[1], RetryAfter: v[2], HoldOff: v[3], ResetAfter: v[4], Banned: v[5] == 1, Drop: v[6] == 1,
					Until: v[8], QuotaHold: v[9], Void: v[10] == 1, BanHolds: v[11] == 1, LimitRetry: v[12]}
				each := []bucket.Result{{Remaining: v[13], ResetAfter: v[14]}}
				want, wantEach := sh.LeaseQuotas(now, ls, nil, a), make([]bucket.Result, 1)
				if sh.ReportEach(now, ls, nil, wantEach); got != want || !slices.Equal(each, wantEach) {
					return fmt.Errorf("%s: lease %+v at %d (stored %q): Redis %+v %+v, model %+v %+v", what, a, now, before, got, each, want, wantEach)
				}
			} else {
				n, at := 1+rng.Int64N(3*c+1), seq-rng.Int64N(2)
				if rng.IntN(4) == 0 {
					n = l.Capacity + rng.Int64N(3)
				}
				v, err := s.call(bg, key, s.returnArgs(bucket.Tier{Limits: ls}, n, "a1", at), false, 2)
				if err != nil {
					return fmt.Errorf("%s: return: %w", what, err)
				}
				now = v[1]
				if want := sh.ReturnQuotas(now, ls, nil, "a1", at, n); v[0] != want {
					return fmt.Errorf("%s: return %d of seq %d at %d (stored %q): Redis %d, model %d", what, n, at, now, before, v[0], want)
				}
			}
			if err := checkStored(rdb, key, m, now, before, sent); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
		}
	}
	return nil
}

// The short forms of a lone limit's lease and give-back answer as the
// model at their edges too (checkLeaseShortEdges; seed fixed).
func TestALoneLimitsShortFormsMatchTheModelAtTheirEdges(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	if err := checkLeaseShortEdges(s, rdb, rand.New(rand.NewPCG(35, 7)), 300, 30); err != nil {
		t.Fatal(err)
	}
}
