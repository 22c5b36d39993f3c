package redisbucket

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// The bucket script's quotas are quota.go's and shared.go's, step for
// step: random traces of takes, peeks, leases of several nodes and their
// give-backs, give-backs and charges on one or two limits and one or
// two calendar quotas in several zones, whose clock jumps across
// boundaries (DST days, month and year ends), against a real redis-server.
// After each step the answers match, and the key lives no longer than its
// last period or limit needs.
func TestRedisScriptQuotasMatchTheModel(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rng := rand.New(rand.NewPCG(24, 13))
	zones := []string{"UTC", "America/New_York", "Europe/Berlin", "Asia/Kolkata", "Australia/Lord_Howe"}
	// Starting points near the calendar's edges, as Redis's clock sees them.
	edges := []time.Time{
		time.Date(2026, 3, 8, 6, 0, 0, 0, time.UTC),    // New York springs forward
		time.Date(2026, 11, 1, 5, 0, 0, 0, time.UTC),   // New York falls back
		time.Date(2028, 2, 28, 23, 0, 0, 0, time.UTC),  // a leap February
		time.Date(2027, 2, 28, 22, 0, 0, 0, time.UTC),  // a common one
		time.Date(2026, 12, 31, 22, 0, 0, 0, time.UTC), // the turn of the year
		time.Date(2026, 12, 6, 22, 0, 0, 0, time.UTC),  // Sunday night, Monday next
	}
	traces, steps := 40, 150
	if testing.Short() {
		traces, steps = 3, 80
	}
	// What the traces reached: leases granted, refused by a quota, given
	// back to a quota.
	var granted, quotaRefused, returned int
	for i := range traces {
		s.clockOffset = edges[rng.IntN(len(edges))].UnixMicro() - time.Now().UnixMicro()
		ls := []bucket.Limit{buckettest.RandomTrace(rng).Limit}
		if rng.IntN(2) == 0 {
			ls = append(ls, buckettest.RandomTrace(rng).Limit)
		}
		for j := range ls {
			ls[j].MaxWait = ls[0].MaxWait
		}
		if rng.IntN(3) == 0 {
			ban := 1 + rng.Int64N(3*ls[0].Units()/ls[0].Rate.Tokens) // one ban a tier
			for j := range ls {
				ls[j].Ban = ban
			}
		}
		// One quota a period, as validation allows, in one zone a tier.
		var qs []bucket.Quota
		loc, err := time.LoadLocation(zones[rng.IntN(len(zones))])
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range rng.Perm(4)[:1+rng.IntN(2)] {
			qs = append(qs, bucket.Quota{N: 1 + rng.Int64N(30), Period: bucket.Period(1 + p), Loc: loc})
		}
		minCap := ls[0].Capacity
		for _, l := range ls {
			minCap = min(minCap, l.Capacity)
		}
		key := string(bucketFor("quota-" + strconv.Itoa(i)))
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		nodes := []string{"a1", "b2"}
		seq := map[string]int64{}
		for j := range steps {
			// Mostly short steps; now and then hours, across a boundary.
			step := rng.Int64N(2 * ls[0].Units() / ls[0].Rate.Tokens)
			if rng.IntN(8) == 0 {
				step = rng.Int64N(30 * 3600 * 1_000_000)
			}
			s.clockOffset += step
			cost := 1 + rng.Int64N(minCap)
			what := fmt.Sprintf("trace %d step %d (limits %+v, quotas %v)", i, j, ls, qs)
			before, _ := srv.Do("GET", key).(string)
			out, qout := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
			want, wantQ := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
			switch op := rng.IntN(13); {
			case op >= 10:
				node := nodes[rng.IntN(len(nodes))]
				if op == 12 {
					// The give-back of a lease, named by its call, or
					// by the one before.
					n, at := 1+rng.Int64N(minCap), seq[node]-rng.Int64N(2)
					v, err := s.call(bg, key, s.args("return", bucket.Tier{Limits: ls, Quotas: qs}, 0, n, node, at), false, 2)
					if err != nil {
						t.Fatal(err)
					}
					used := quotaUsed(sh)
					if w := sh.ReturnQuotas(v[1], ls, qs, node, at, n); v[0] != w {
						t.Fatalf("%s return %d of %s seq %d: Redis %d, model %d", what, n, node, at, v[0], w)
					}
					if quotaUsed(sh) < used {
						returned++
					}
					break
				}
				seq[node]++
				a := bucket.LeaseAsk{Node: node, Seq: seq[node], Held: rng.Int64N(minCap), Cost: cost, Want: cost + rng.Int64N(minCap-cost+1), Hold: rng.Int64N(3 * 3600 * 1_000_000), Prefetch: rng.IntN(3) == 0}
				if !a.Prefetch && rng.IntN(2) == 0 {
					a.Spend = cost
				}
				each, wantEach := make([]bucket.Result, len(ls)+len(qs)), make([]bucket.Result, len(ls)+len(qs))
				got, now, err := s.leaseAt(key, bucket.Tier{Limits: ls, Quotas: qs}, a, each)
				if err != nil {
					t.Fatal(err)
				}
				used := quotaUsed(sh)
				w := sh.LeaseQuotas(now, ls, qs, a)
				if sh.ReportEach(now, ls, qs, wantEach); got != w || !slices.Equal(each, wantEach) {
					t.Fatalf("%s lease %+v at %s: Redis %+v %+v, model %+v %+v", what, a, time.UnixMicro(now).UTC(), got, each, w, wantEach)
				}
				if got.Granted > 0 {
					granted++
				} else if quotaUsed(sh) == used && got.RetryAfter > 3_600_000_000 {
					quotaRefused++
				}
			case op < 6:
				all := make([]bucket.Result, len(ls)+len(qs))
				v, err := s.decideBy(bg, "take", key, bucket.Tier{Limits: ls, Quotas: qs}, cost, all, false)
				if err != nil {
					t.Fatal(err)
				}
				copy(out, all)
				copy(qout, all[len(ls):])
				w := sh.TakeWithQuotas(v.now, ls, qs, cost, want, wantQ)
				var next int64
				if w {
					next = sh.Next(v.now, ls, qs, cost)
				}
				if v.allowed != w || !slices.Equal(out, want) || !slices.Equal(qout, wantQ) || v.next != next {
					t.Fatalf("%s take %d at %s: Redis %+v %+v %+v, model %v %+v %+v next %d", what, cost, time.UnixMicro(v.now).UTC(), v, out, qout, w, want, wantQ, next)
				}
			case op < 7:
				all := make([]bucket.Result, len(ls)+len(qs))
				_, now, err := s.decideAt(bg, "peek", key, bucket.Tier{Limits: ls, Quotas: qs}, 0, all, false)
				if err != nil {
					t.Fatal(err)
				}
				copy(out, all)
				copy(qout, all[len(ls):])
				sh.Peek(now, ls, want)
				sh.PeekQuotas(now, qs, wantQ)
				if !slices.Equal(out, want) || !slices.Equal(qout, wantQ) {
					t.Fatalf("%s peek: Redis %+v %+v, model %+v %+v", what, out, qout, want, wantQ)
				}
			case op < 9:
				// Given back for a request taken a moment ago, or (now and
				// then) one taken before the last boundary.
				at := time.Now().UnixMicro() + s.clockOffset - rng.Int64N(2)*rng.Int64N(30*3600*1_000_000)
				v, err := s.call(bg, key, s.args("giveback", bucket.Tier{Limits: ls, Quotas: qs}, at, cost), false, 2)
				if err != nil {
					t.Fatal(err)
				}
				sh.GiveBack(v[1], ls, cost)
				sh.GiveBackQuotas(v[1], at, qs, cost)
			default:
				n := rng.Int64N(3 * minCap)
				v, err := s.call(bg, key, s.args("charge", bucket.Tier{Limits: ls, Quotas: qs}, 0, n), false, 2)
				if err != nil {
					t.Fatal(err)
				}
				sh.Charge(v[1], ls, n)
				sh.ChargeQuotas(v[1], qs, n)
			}
			// The key lives until its last period ends, no longer: checked
			// when this step wrote it (the clock jumps, the TTL does not).
			after, _ := srv.Do("GET", key).(string)
			if pttl := srv.Do("PTTL", key).(int64); pttl > 0 && after != before {
				var last int64
				now := time.Now().UnixMicro() + s.clockOffset
				for k, q := range qs {
					if k < len(sh.Quotas) && sh.Quotas[k].Used > 0 {
						_, end := q.Bounds(sh.Quotas[k].Start)
						last = max(last, end-now)
					}
				}
				last = max(last, sh.Life(now, ls))
				if ms := last/1000 + 2000; pttl > ms {
					var ends []string
					for k, q := range qs {
						st, en := q.Bounds(now)
						ends = append(ends, fmt.Sprintf("quota %d state %+v, now's period %s to %s", k, sh.Quotas[k], time.UnixMicro(st).In(q.Loc), time.UnixMicro(en).In(q.Loc)))
					}
					t.Fatalf("%s: the key lives %d ms, its last period or limit needs %d; now %s; %v; value %q", what, pttl, ms, time.UnixMicro(now).UTC(), ends, srv.Do("GET", key))
				}
			}
		}
	}
	if granted == 0 || quotaRefused == 0 || returned == 0 {
		t.Errorf("the traces granted %d leases, had %d refused by a quota and gave %d back to a quota; want some of each", granted, quotaRefused, returned)
	}
}

// quotaUsed is what a shared bucket's quotas have counted, in all.
func quotaUsed(sh *buckettest.Shared) int64 {
	var n int64
	for _, q := range sh.Quotas {
		n += q.Used
	}
	return n
}
