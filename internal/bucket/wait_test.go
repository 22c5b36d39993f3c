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

// max_wait: a request whose tokens are due within it takes them now and
// waits; one that would wait longer is refused, taking nothing.

const ms = int64(1_000)

// tenASecond is rate 10/s, capacity 1, max_wait 1s: the example.
var tenASecond = bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 100 * ms}, MaxWait: second}

// 30 simultaneous requests: 11 pass, the k-th after k x 100 ms, and 19 are
// refused, each told to come back when it would fit within max_wait.
func TestMaxWaitSpacesABurstAtTheRate(t *testing.T) {
	t.Parallel()
	var st bucket.State
	now := 5 * second
	allowed := 0
	for k := range 30 {
		var res bucket.Result
		st, res = bucket.Take(st, now, tenASecond, 1)
		if k <= 10 {
			if !res.Allowed || res.Wait != int64(k)*100*ms || res.Remaining != 0 {
				t.Fatalf("request %d: %+v, want allowed after %d ms", k, res, k*100)
			}
			allowed++
			continue
		}
		// The 12th would wait 1.1 s: 100 ms too long.
		if res.Allowed || res.RetryAfter != 100*ms {
			t.Fatalf("request %d: %+v, want refused, retry after 100 ms", k, res)
		}
	}
	if allowed != 11 {
		t.Fatalf("%d allowed, want 11", allowed)
	}
	// 100 ms later there is room for exactly one more, waiting the whole
	// second.
	st, res := bucket.Take(st, now+100*ms, tenASecond, 1)
	if !res.Allowed || res.Wait != second {
		t.Fatalf("at 100 ms: %+v, want allowed after 1 s", res)
	}
	if _, res = bucket.Take(st, now+100*ms, tenASecond, 1); res.Allowed {
		t.Fatalf("at 100 ms, a second one: %+v, want refused", res)
	}
}

// The last 5 waiters hang up at 250 ms and give their tokens back: 5
// requests at 300 ms all fit, where only 3 would without the give-back.
func TestAWaiterThatHangsUpMakesRoomForTheNext(t *testing.T) {
	t.Parallel()
	for _, giveBack := range []bool{true, false} {
		var st bucket.State
		now := 5 * second
		for range 11 {
			st, _ = bucket.Take(st, now, tenASecond, 1)
		}
		if giveBack {
			for range 5 {
				st = bucket.GiveBack(st, now+250*ms, tenASecond, 1)
			}
		}
		fit := 0
		for range 5 {
			var res bucket.Result
			if st, res = bucket.Take(st, now+300*ms, tenASecond, 1); res.Allowed {
				fit++
			}
		}
		want := 3
		if giveBack {
			want = 5
		}
		if fit != want {
			t.Errorf("give-back %v: %d of 5 fit at 300 ms, want %d", giveBack, fit, want)
		}
	}
}

// A refusal under max_wait starts a ban; the ban keeps what the waiters
// took (a short ban never shortens the queue), refuses even a request the
// ban's end is within max_wait of, and a waiter's give-back during it is
// dropped.
func TestABanHoldsAgainstWaiting(t *testing.T) {
	t.Parallel()
	l := tenASecond
	l.Ban = 500 * ms
	var st bucket.State
	now := 5 * second
	for range 11 {
		st, _ = bucket.Take(st, now, l, 1)
	}
	queued := st.FullAt
	st, res := bucket.Take(st, now, l, 1)
	if res.Allowed || !res.Banned {
		t.Fatalf("the refusal: %+v, want a ban started", res)
	}
	if st.FullAt < queued {
		t.Fatalf("the ban moved the bucket's full time from %d to %d: it forgave the waiters' tokens", queued, st.FullAt)
	}
	if st2 := bucket.GiveBack(st, now+10*ms, l, 1); st2 != st {
		t.Fatalf("a waiter's give-back during the ban changed %+v to %+v", st, st2)
	}
	// 1.05 s in: the waiters' tokens are paid, the ban (of an empty bucket
	// from the refusal) not yet over by the 0.5 s it adds... it holds.
	if _, res = bucket.Take(st, now+950*ms, l, 1); res.Allowed {
		t.Fatalf("during the ban: %+v, want refused", res)
	}
}

// A ban that ends within max_wait still refuses: a request does not wait
// out a ban. A ban shorter than the queue only keeps the queue.
func TestARequestDoesNotWaitOutABan(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 100 * ms}, MaxWait: 10 * second, Ban: 20 * second}
	var st bucket.State
	now := 5 * second
	st, _ = bucket.Take(st, now, l, 1)
	// Waiting 10 s would fit, so this request is allowed, no ban.
	st, res := bucket.Take(st, now, l, 1)
	if !res.Allowed || res.Wait != 100*ms {
		t.Fatalf("second request: %+v, want allowed after 100 ms", res)
	}
	// Fill the queue to 10 s, then one more is refused and bans.
	for range 99 {
		st, _ = bucket.Take(st, now, l, 1)
	}
	st, res = bucket.Take(st, now, l, 1)
	if res.Allowed || !res.Banned {
		t.Fatalf("the 102nd: %+v, want refused, a ban", res)
	}
	// The bucket is empty until 20 s, full at 20.1 s; at 19.5 s, 0.5 s
	// before the ban ends, a request is refused although it would fit
	// within max_wait, and told to come back when the ban is over, when
	// it fits, waiting.
	if _, res = bucket.Take(st, now+19500*ms, l, 1); res.Allowed || res.RetryAfter != 500*ms {
		t.Fatalf("0.5 s before the ban ends: %+v, want refused, retry after 0.5 s", res)
	}
	if _, res = bucket.Take(st, now+20*second, l, 1); !res.Allowed || res.Wait != 100*ms {
		t.Fatalf("as the ban ends: %+v, want allowed after 100 ms", res)
	}
}

// A debt that cost_from_response ran up is waited out like a queue.
func TestMaxWaitWaitsOutADebtWithinIt(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 10, Interval: second}, MaxWait: second}
	now := 5 * second
	st := bucket.Charge(bucket.State{}, now, l, 15) // 5 tokens of debt: 0.5 s
	_, res := bucket.Take(st, now, l, 1)
	if !res.Allowed || res.Wait != 600*ms {
		t.Fatalf("in 0.5 s of debt, cost 1: %+v, want allowed after 0.6 s", res)
	}
	st = bucket.Charge(bucket.State{}, now, l, 30) // 2 s to pay
	if _, res = bucket.Take(st, now, l, 1); res.Allowed || res.RetryAfter != 1100*ms {
		t.Fatalf("in 2 s of debt: %+v, want refused, retry after 1.1 s", res)
	}
}

// Several limits: a request waits for the slowest, and a refused one is
// told when every limit would take it within max_wait.
func TestMaxWaitWaitsForTheSlowestLimit(t *testing.T) {
	t.Parallel()
	fast := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 10, Interval: second}, MaxWait: second}
	slow := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 2, Interval: second}, MaxWait: second}
	ls := []bucket.Limit{fast, slow}
	states := make([]bucket.State, 2)
	out := make([]bucket.Result, 2)
	now := 5 * second
	for k, want := range []int64{0, 500 * ms, second} {
		if !bucket.TakeAll(states, now, ls, 1, out) || max(out[0].Wait, out[1].Wait) != want {
			t.Fatalf("request %d: %+v, want allowed after %d µs", k, out, want)
		}
	}
	before := append([]bucket.State(nil), states...)
	if bucket.TakeAll(states, now, ls, 1, out) {
		t.Fatalf("the 4th: %+v, want refused", out)
	}
	if retry := max(out[0].RetryAfter, out[1].RetryAfter); retry != 500*ms {
		t.Fatalf("the 4th: retry after %d µs, want 500 ms (the slow limit's)", retry)
	}
	if states[0] != before[0] || states[1] != before[1] {
		t.Fatal("a refused request took from a limit")
	}
}

// From any state, the requests' due times (arrival plus wait) never
// outrun the bucket: over any window of due times, at most C + r*T, give
// or take the microsecond a wait is rounded up to.
func TestWaitingNeverOutrunsTheRate(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(22, 12))
	for i := range 300 {
		tr := buckettest.RandomTrace(rng)
		l := tr.Limit
		if l.MaxWait == 0 {
			l.MaxWait = 1 + rng.Int64N(3*l.Units()/l.Rate.Tokens+1)
		}
		// A random state: anything from full to a whole queue.
		st := bucket.StateAt(0, rng.Int64N(l.Units()+l.MaxWait*l.Rate.Tokens+1), l)
		st.FullAt = max(st.FullAt, 1)
		type due struct{ at, cost int64 }
		var dues []due
		now := int64(0)
		for j := range tr.Gaps {
			now += tr.Gaps[j]
			var res bucket.Result
			st, res = bucket.Take(st, now, l, tr.Costs[j])
			if res.Allowed {
				if res.Wait > l.MaxWait {
					t.Fatalf("trace %d: waited %d µs, over max_wait %d", i, res.Wait, l.MaxWait)
				}
				dues = append(dues, due{now + res.Wait, tr.Costs[j]})
			}
		}
		// The start state lacked some units: the first window may have
		// fewer, never more, than a full bucket.
		for a := range dues {
			var taken int64
			for b := a; b < len(dues); b++ {
				taken += dues[b].cost
				span := dues[b].at - dues[a].at
				if limit := l.Capacity + (span+1)*l.Rate.Tokens/l.Rate.Interval; taken > limit {
					t.Fatalf("trace %d (limit %+v): %d tokens due in %d µs, over %d", i, l, taken, span, limit)
				}
			}
		}
	}
}

func TestMaxWaitIsValidated(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: second}}
	for _, w := range []int64{-1, 10*1000*second + 1} {
		l.MaxWait = w
		if err := l.Validate(1); err == nil {
			t.Errorf("max_wait %d µs: want an error", w)
		}
	}
	l.MaxWait = 10 * 1000 * second
	if err := l.Validate(1); err != nil {
		t.Errorf("max_wait of 1000 refills: %v", err)
	}
}

// Under a ban with max_wait, the refusal that starts the ban says retry when
// the request fits within max_wait (the level is back to 0 and its wait,
// cost/rate, is within max_wait), not when the bucket holds the cost, a
// whole cost's refill later.
func TestABansRetryAfterIsWhenTheRequestFitsWithinMaxWait(t *testing.T) {
	t.Parallel()
	// capacity 1, one token every 10 s, ban 60 s, max_wait 30 s.
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 10_000_000}, Ban: 60_000_000, MaxWait: 30_000_000}
	now := int64(1_000_000_000)
	var s bucket.State
	// Take the token, then 3 wait (10, 20, 30 s); the 5th would wait 40 s:
	// refused, and the ban starts.
	for i := range 4 {
		var res bucket.Result
		if s, res = bucket.Take(s, now, l, 1); !res.Allowed {
			t.Fatalf("request %d: %+v, want allowed", i, res)
		}
	}
	s, res := bucket.Take(s, now, l, 1)
	if res.Allowed || !res.Banned {
		t.Fatalf("5th request: %+v, want refused, starting a ban", res)
	}
	// The earliest moment a request fits within max_wait.
	fits := int64(-1)
	for at := now; at <= now+res.RetryAfter; at += 100_000 {
		if _, r := bucket.Take(s, at, l, 1); r.Allowed {
			fits = at - now
			break
		}
	}
	if fits < 0 {
		t.Fatalf("no request fits within RetryAfter %d µs", res.RetryAfter)
	}
	if res.RetryAfter > fits {
		t.Fatalf("the refusal that started the ban says retry after %d µs, but a request fits (waiting within max_wait) after %d µs", res.RetryAfter, fits)
	}
}

// An allowed request of a tier that waits (max_wait) reports, for a limit
// that would have let it go sooner, the reset of the take it did: the
// limits go together, when the slowest lets the request go, which leaves
// that limit full later than an immediate take would.
func TestAWaitingTierReportsEachLimitsResetOfTheTakeItDid(t *testing.T) {
	t.Parallel()
	ls := []bucket.Limit{
		{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: second}, MaxWait: 10 * second},
		{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1}, MaxWait: 10 * second},
	}
	states := make([]bucket.State, 2)
	now := 100 * second
	out := make([]bucket.Result, 2)
	bucket.TakeAll(states, now, ls, 2, out)
	if !bucket.TakeAll(states, now, ls, 2, out) || out[0].Wait != 2*second {
		t.Fatalf("second request: %+v", out)
	}
	if got, want := out[1].ResetAfter, untilPeekSaysFull(states[1], now, ls[1]); got != want {
		t.Errorf("limit 2's result %+v, but its state %+v is full in %d µs", out[1], states[1], want)
	}
}

// waitRates include refills above one token a microsecond (Tokens >
// Interval), where a microsecond's rounding is more than a token.
var waitRates = append([]string{"2000000/s", "3000000/s"}, peekRates...)

// randomWaitingTier is a tier of two or three limits that waits (max_wait,
// the same for all, valid for each), with a ban one time in three.
func randomWaitingTier(rng *rand.Rand, rates []string) []bucket.Limit {
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

// On shared buckets with leases held, bans, debts and quotas (the model a
// fleet leases from), every allowed take of a tier answers, for each limit,
// a ResetAfter equal to when Peek says that limit is full (given the state
// after the take), a Wait that is the tier's (the slowest limit's), and a
// Remaining no more than the limit's level when the request goes on.
func TestAnAllowedTakeAnswersEachLimitAsPeekSays(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(27, 0xb))
	day := bucket.Quota{N: 40, Period: bucket.Day, Loc: time.UTC}
	var allowedWaits, spread, exactMisses int
	var firstMiss string
	traces := 1500
	if testing.Short() {
		traces = 300
	}
	for trace := range traces {
		ls := randomWaitingTier(rng, waitRates)
		var qs []bucket.Quota
		if rng.IntN(3) == 0 {
			qs = []bucket.Quota{day}
		}
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		minCap := minCapacity(ls)
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
			what := traceStep{trace: trace, step: step, limits: ls, quotas: qs}
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
					if truth := untilPeekSaysFull(sh.Levels[i], now, l); r.ResetAfter != p.ResetAfter || r.ResetAfter != truth {
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

// A waiting take answers no more remaining than the bucket holds when it
// goes on, also at a refill of more than a token a microsecond, where the
// wait is rounded up to a whole microsecond, which refills more than the
// request lacked.
func TestAWaitingTakesRemainingIsItsLevelWhenItGoesOnAtHighRates(t *testing.T) {
	t.Parallel()
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

// banWaitingTier draws a tier of one to three limits that all carry a ban
// and a max_wait (one each, as tiers.go gives them), from common figures
// and from the edges Validate accepts: huge capacities, rates and bans.
func banWaitingTier(rng *rand.Rand) []bucket.Limit {
	for {
		if ls := drawBanWaitingTier(rng); ls != nil {
			return ls
		}
	}
}

// drawBanWaitingTier is one draw of banWaitingTier: nil when its limits
// leave no room for a max_wait (a capacity of all maxUnits).
func drawBanWaitingTier(rng *rand.Rand) []bucket.Limit {
	var ls []bucket.Limit
	for range 1 + rng.IntN(3) {
		if rng.IntN(3) == 0 {
			ls = append(ls, randomExtremeLimit(rng))
		} else {
			ls = append(ls, randomLimit(rng, false, false))
		}
	}
	full := bucket.CeilDiv(ls[0].Units(), ls[0].Rate.Tokens)
	mw := []int64{1, 1 + rng.Int64N(2*full+1), 1 + rng.Int64N(1<<40)}[rng.IntN(3)]
	ban := []int64{1, 1 + rng.Int64N(5*full+1), 1 + rng.Int64N(1<<50)}[rng.IntN(3)]
	for i := range ls {
		mw = min(mw, (ls[i].MaxDeficit()-ls[i].Units())/ls[i].Rate.Tokens)
	}
	if mw < 1 {
		return nil
	}
	for i := range ls {
		ls[i].Ban, ls[i].MaxWait = ban, mw
		if err := ls[i].Validate(1); err != nil {
			panic(err)
		}
	}
	return ls
}

// takeTier is Take for one limit and TakeAll for several; it returns
// whether the request was allowed and the tier's RetryAfter (the binding
// limit's) and whether a ban started.
func takeTier(states []bucket.State, now int64, ls []bucket.Limit, cost int64) (allowed bool, retry int64, banned bool) {
	out := make([]bucket.Result, len(ls))
	if len(ls) == 1 {
		states[0], out[0] = bucket.Take(states[0], now, ls[0], cost)
		allowed = out[0].Allowed
	} else {
		allowed = bucket.TakeAll(states, now, ls, cost, out)
	}
	return allowed, out[bucket.Binding(out, allowed)].RetryAfter, out[0].Banned
}

// refusalMisfit says what is wrong, if anything, with a refusal at now that
// left states and answered retry: the same request retried at now+retry
// must be admitted, one retried a microsecond earlier refused (so the
// answer is the first moment a retry is admitted: docs/logins.md, "the
// earliest moment a retry can pass", docs/max-wait.md), and a refusal that
// started a ban may not send the client back before the ban ends.
func refusalMisfit(states []bucket.State, now int64, ls []bucket.Limit, cost, retry int64, banned bool) string {
	if retry < 1 {
		return fmt.Sprintf("retry after %d µs, want at least 1", retry)
	}
	if banned && retry < ls[0].Ban {
		return fmt.Sprintf("the refusal started a ban of %d µs but says retry after %d µs", ls[0].Ban, retry)
	}
	at := slices.Clone(states)
	if ok, again, _ := takeTier(at, now+retry, ls, cost); !ok {
		return fmt.Sprintf("retried at now+%d (its RetryAfter): refused again, retry after %d more", retry, again)
	}
	before := slices.Clone(states)
	if ok, _, _ := takeTier(before, now+retry-1, ls, cost); ok {
		return fmt.Sprintf("retried at now+%d, a microsecond before its RetryAfter %d: admitted, so the answer was late", retry-1, retry)
	}
	return ""
}

// banRetryMisfit plays n random traces on tiers with a ban and a
// max_wait (banWaitingTier): histories of takes (waiters queued past
// empty), charges and give-backs, with bans, huge figures included, and
// checks each refusal's RetryAfter, as mutate reports it, with
// refusalMisfit. It returns the first misfit, and how many refusals it
// checked and how many of them started a ban.
func banRetryMisfit(rng *rand.Rand, n int, mutate func(int64) int64) (misfit string, checked, started int) {
	for c := range n {
		ls := banWaitingTier(rng)
		states := make([]bucket.State, len(ls))
		now := rng.Int64N(1 << 50)
		for step := range 1 + rng.IntN(12) {
			cost := 1 + rng.Int64N(minCapacity(ls))
			if rng.IntN(3) == 0 {
				cost = minCapacity(ls)
			}
			switch op := rng.IntN(10); {
			case op < 6:
				before := slices.Clone(states)
				ok, retry, banned := takeTier(states, now, ls, cost)
				if !ok {
					checked++
					if banned {
						started++
					}
					if w := refusalMisfit(states, now, ls, cost, mutate(retry), banned); w != "" {
						return fmt.Sprintf("trace %d step %d: limits %+v, states %+v, cost %d at %d: %s", c, step, ls, before, cost, now, w), checked, started
					}
				}
			case op < 8:
				n := []int64{1, minCapacity(ls), rng.Int64N(1 << 50)}[rng.IntN(3)]
				for i, l := range ls {
					states[i] = bucket.Charge(states[i], now, l, n)
				}
			default:
				for i, l := range ls {
					states[i] = bucket.GiveBack(states[i], now, l, cost)
				}
			}
			full := bucket.CeilDiv(ls[0].Units(), ls[0].Rate.Tokens)
			now += []int64{0, 1, rng.Int64N(full + 1), rng.Int64N(ls[0].MaxWait + 1), rng.Int64N(ls[0].Ban + 1)}[rng.IntN(5)]
		}
	}
	return "", checked, started
}

// With ban and max_wait, a refusal's RetryAfter is exactly the first
// moment the same request, retried, is admitted: never later (a client
// that obeys would wait for nothing) and never earlier (a retry before it
// is refused, and may start another ban), and never before a ban it
// started ends. Random tiers of one to three limits, huge figures
// included, from random histories; one limit through Take, several
// through TakeAll.
func TestABanWithMaxWaitsRetryAfterIsTheFirstMomentARetryIsAdmitted(t *testing.T) {
	t.Parallel()
	n := 20_000
	if testing.Short() {
		n = 4_000
	}
	misfit, checked, started := banRetryMisfit(rand.New(rand.NewPCG(41, 0x8)), n, func(r int64) int64 { return r })
	if misfit != "" {
		t.Fatal(misfit)
	}
	if checked < n/4 || started < n/20 {
		t.Fatalf("only %d refusals checked, %d starting a ban, of %d traces: the traces reach too few", checked, started, n)
	}
	t.Logf("%d refusals checked, %d of them starting a ban", checked, started)
}

// The property catches a RetryAfter a microsecond late, and one a
// microsecond early.
func TestTheBanRetryPropertyCatchesAnAnswerOffByOne(t *testing.T) {
	t.Parallel()
	for _, off := range []int64{1, -1} {
		if misfit, _, _ := banRetryMisfit(rand.New(rand.NewPCG(41, 0x8)), 4_000, func(r int64) int64 { return r + off }); misfit == "" {
			t.Errorf("RetryAfter off by %d µs passed the property", off)
		}
	}
}
