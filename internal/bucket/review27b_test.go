package bucket_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

// Review 27b: goTogether's results (f9ca558), on the Go model.

// r27bRates include refills above one token a microsecond (Tokens >
// Interval), where a microsecond's rounding is more than a token.
var r27bRates = append([]string{"2000000/s", "3000000/s"}, r27Rates...)

// r27bTier is a tier of two or three limits that waits (max_wait, the
// same for all, valid for each), with a ban one time in three.
func r27bTier(rng *rand.Rand, rates []string) []bucket.Limit {
	n := 2 + rng.IntN(2)
	var ls []bucket.Limit
	for range n {
		rate, err := bucket.ParseRate(rates[rng.IntN(len(rates))])
		if err != nil {
			panic(err)
		}
		ls = append(ls, bucket.Limit{Capacity: 1 + rng.Int64N(20), Rate: rate})
	}
	full := bucket.CeilDiv(ls[0].Units(), ls[0].Rate.Tokens)
	mw := 1 + rng.Int64N(3*full+1)
	var ban int64
	if rng.IntN(3) == 0 {
		ban = 1 + rng.Int64N(5*full+1)
	}
	for i := range ls {
		mw = min(mw, (ls[i].MaxDeficit()-ls[i].Units())/ls[i].Rate.Tokens)
	}
	for i := range ls {
		ls[i].MaxWait, ls[i].Ban = mw, ban
		if err := ls[i].Validate(1); err != nil {
			panic(err)
		}
	}
	return ls
}

// Claim 4 (property), on shared buckets with leases held, bans, debts and
// quotas: every allowed take of a tier answers, for each limit, a
// ResetAfter equal to when Peek says that limit is full (given the state
// after the take), a Wait that is the tier's (the slowest limit's), and a
// Remaining no more than the limit's level when the request goes on.
func TestReview27bAllowedTakeAnswersEachLimitAsPeekSays(t *testing.T) {
	rng := rand.New(rand.NewPCG(27, 0xb))
	day := bucket.Quota{N: 40, Period: bucket.Day, Loc: time.UTC}
	var allowedWaits, spread, exactMisses int
	var firstMiss string
	for trace := range 1500 {
		ls := r27bTier(rng, r27bRates)
		var qs []bucket.Quota
		if rng.IntN(3) == 0 {
			qs = []bucket.Quota{day}
		}
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		minCap := r27MinCap(ls)
		now := time.Date(2026, 3, 1, 23, 0, 0, 0, time.UTC).UnixMicro() + rng.Int64N(3600e6)
		perToken := max(1, ls[0].Rate.Interval/ls[0].Rate.Tokens)
		nodes := []string{"a", "b"}
		var seq int64
		for step := range 80 {
			switch rng.IntN(3) {
			case 0:
			case 1:
				now += rng.Int64N(perToken + 2)
			default:
				now += rng.Int64N(ls[0].Capacity*perToken + 2)
			}
			what := fmt.Sprintf("trace %d step %d limits %+v quotas %v", trace, step, ls, qs)
			switch op := rng.IntN(10); {
			case op < 6:
				cost := 1 + rng.Int64N(minCap)
				out, qout := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
				before := cloneShared(sh)
				var allowed bool
				if len(qs) > 0 {
					allowed = sh.TakeWithQuotas(now, ls, qs, cost, out, qout)
				} else {
					allowed = sh.Take(now, ls, cost, out)
				}
				if !allowed {
					continue
				}
				var w int64
				for _, r := range out {
					w = max(w, r.Wait)
				}
				if w > 0 {
					allowedWaits++
					if slices.ContainsFunc(out, func(r bucket.Result) bool { return r.Wait < w }) {
						t.Fatalf("%s: a waiting take of cost %d answers waits %+v, not the tier's %d", what, cost, out, w)
					}
				}
				// The level each limit has when the request goes on, after
				// the take: the state after, at now+w, held leases settled.
				at := make([]bucket.Result, len(ls))
				sh.Peek(now+w, ls, at)
				for i, l := range ls {
					r := out[i]
					if !r.Allowed || r.ResetAfter < 0 || r.Remaining < 0 || r.Remaining > l.Capacity {
						t.Fatalf("%s: limit %d of an allowed take: %+v", what, i, r)
					}
					p := bucket.Peek(sh.Levels[i], now, l)
					if truth := r27Truth(sh.Levels[i], now, l); r.ResetAfter != p.ResetAfter || r.ResetAfter != truth {
						t.Fatalf("%s: take of cost %d (before %+v): limit %d answers %+v, but its state after %+v peeks %+v, full by Peek in %d µs",
							what, cost, before, i, r, sh.Levels[i], p, truth)
					}
					plain := bucket.Peek(sh.Levels[i], now+w, l)
					if r.Remaining > plain.Remaining || r.Remaining > at[i].Remaining {
						t.Fatalf("%s: take of cost %d (before %+v): limit %d answers %d remaining, more than its level when it goes on (%d; shared %d)",
							what, cost, before, i, r.Remaining, plain.Remaining, at[i].Remaining)
					}
					if w > 0 && r.Remaining != plain.Remaining && l.Rate.Tokens < l.Rate.Interval {
						exactMisses++
						if firstMiss == "" {
							firstMiss = fmt.Sprintf("%s: cost %d, limit %d answers %+v; at now+%d its level is %d (state %+v, before %+v)", what, cost, i, r, w, plain.Remaining, sh.Levels[i], before.Levels[i])
						}
					}
				}
				if w > 0 && len(ls) > 1 && out[0].Remaining != out[1].Remaining {
					spread++
				}
			case op < 8:
				node := nodes[rng.IntN(2)]
				seq++
				a := bucket.LeaseAsk{Node: node, Seq: seq, Held: rng.Int64N(minCap), Cost: 1, Want: 1 + rng.Int64N(max(1, minCap/2)), Hold: rng.Int64N(3 * ls[0].Capacity * perToken)}
				if rng.IntN(2) == 0 {
					a.Spend = 1
				}
				sh.LeaseQuotas(now, ls, qs, a)
			case op < 9:
				sh.Charge(now, ls, rng.Int64N(2*minCap))
			default:
				sh.GiveBack(now, ls, 1+rng.Int64N(minCap))
			}
		}
	}
	t.Logf("%d allowed takes that waited (%d with limits at different levels); %d limits whose Remaining is below their level when the request goes on", allowedWaits, spread, exactMisses)
	if firstMiss != "" {
		t.Logf("first: %s", firstMiss)
	}
}

func cloneShared(sh *buckettest.Shared) buckettest.Shared {
	return buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held), Quotas: slices.Clone(sh.Quotas)}
}

// Claim 1 at the model's level, the smallest case: a waiting take's
// slowest limit answers 0 remaining, its level when it goes on. At a
// refill of more than a token a microsecond, the wait is rounded up to a
// whole microsecond, which refills more than the request lacked.
func TestReview27bSlowestLimitRemainingAtHighRates(t *testing.T) {
	rate, err := bucket.ParseRate("3000000/s") // 3 tokens a µs
	if err != nil {
		t.Fatal(err)
	}
	l := bucket.Limit{Capacity: 10, Rate: rate, MaxWait: 100}
	s := bucket.State{}
	now := int64(1e12)
	s, _ = bucket.Take(s, now, l, 10)
	s, r := bucket.Take(s, now, l, 1) // lacks 1 token: waits 1 µs, which refills 3
	p := bucket.Peek(s, now+r.Wait, l)
	t.Logf("result %+v; at now+%d the bucket holds %d", r, r.Wait, p.Remaining)
	if r.Remaining > p.Remaining {
		t.Errorf("answers %d remaining, more than the %d there when it goes on", r.Remaining, p.Remaining)
	}
}
