package bucket_test

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

// Review of 4b08e83 (Peek's reset for a bucket lacking more than its
// capacity). Injected clocks only: every call takes now.

// r27Full says whether Peek calls the bucket full at t.
func r27Full(s bucket.State, t int64, l bucket.Limit) bool {
	p := bucket.Peek(s, t, l)
	return p.Remaining == l.Capacity && p.ResetAfter == 0
}

// r27Truth is the microseconds from now until a Peek first says the bucket
// is full, found by bisection on Peek's level alone (the deficit only falls
// as time passes, and is 0 from FullAt on).
func r27Truth(s bucket.State, now int64, l bucket.Limit) int64 {
	if r27Full(s, now, l) {
		return 0
	}
	lo, hi := now, max(now, s.FullAt) // full at hi, not at lo
	for hi-lo > 1 {
		mid := lo + (hi-lo)/2
		if r27Full(s, mid, l) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi - now
}

var r27Rates = append([]string{"7/s", "999999/s", "1/s", "2/m"}, buckettest.TraceRates...)

func r27Limit(rng *rand.Rand, ban, maxWait bool) bucket.Limit {
	rate, err := bucket.ParseRate(r27Rates[rng.IntN(len(r27Rates))])
	if err != nil {
		panic(err)
	}
	l := bucket.Limit{Capacity: 1 + rng.Int64N(20), Rate: rate}
	full := bucket.CeilDiv(l.Units(), rate.Tokens)
	if ban {
		l.Ban = 1 + rng.Int64N(5*full+1)
	}
	if maxWait {
		l.MaxWait = 1 + rng.Int64N(2*full+1)
	}
	if err := l.Validate(1); err != nil {
		panic(err)
	}
	return l
}

// r27Tier draws a tier of one to three limits with one ban and one
// max_wait setting, as a config gives them.
func r27Tier(rng *rand.Rand) []bucket.Limit {
	ban, wait := rng.IntN(3) == 0, rng.IntN(3) == 0
	ls := []bucket.Limit{r27Limit(rng, ban, wait)}
	for range rng.IntN(3) {
		ls = append(ls, r27Limit(rng, false, false))
	}
	// One max_wait for the tier, valid for every limit, as tiers.go
	// validates it.
	mw := ls[0].MaxWait
	for i := range ls {
		if mw > 0 {
			mw = min(mw, (ls[i].MaxDeficit()-ls[i].Units())/ls[i].Rate.Tokens)
		}
	}
	for i := range ls {
		ls[i].Ban, ls[i].MaxWait = ls[0].Ban, mw
		if err := ls[i].Validate(1); err != nil {
			panic(err)
		}
	}
	return ls
}

func r27MinCap(ls []bucket.Limit) int64 {
	c := ls[0].Capacity
	for _, l := range ls {
		c = min(c, l.Capacity)
	}
	return c
}

// r27Step applies one random operation to the tier's states at now, and
// checks each result's ResetAfter against the state it leaves (claim 3:
// every take's reset, Peek's in takeAll's "had room" branch included, is
// the time until the bucket is full again).
func r27Step(t *testing.T, rng *rand.Rand, states []bucket.State, now int64, ls []bucket.Limit, what string) {
	t.Helper()
	out := make([]bucket.Result, len(ls))
	switch op := rng.IntN(10); {
	case op < 6:
		cost := 1 + rng.Int64N(r27MinCap(ls))
		if rng.IntN(8) == 0 {
			cost = 0
		}
		before := append([]bucket.State(nil), states...)
		allowed := bucket.TakeAll(states, now, ls, cost, out)
		for i, l := range ls {
			if want := r27Truth(states[i], now, l); out[i].ResetAfter != want {
				t.Fatalf("%s: TakeAll(cost %d) allowed=%v, limit %d %+v: result %+v, but the state %+v (before %+v) is full in %d µs",
					what, cost, allowed, i, l, out[i], states[i], before[i], want)
			}
		}
	case op < 8:
		n := rng.Int64N(3 * r27MinCap(ls) * 5)
		for i, l := range ls {
			states[i] = bucket.Charge(states[i], now, l, n)
		}
	default:
		n := 1 + rng.Int64N(r27MinCap(ls))
		for i, l := range ls {
			states[i] = bucket.GiveBack(states[i], now, l, n)
		}
	}
}

// Claim 1 without a reload: for every state reachable by Take, TakeAll,
// Charge, GiveBack, bans and max_wait under one tier, Peek's ResetAfter is
// exactly when Peek first says full; never negative.
func TestReview27PeekResetExactWithoutReload(t *testing.T) {
	seed, traces := uint64(1), 400
	if v, err := strconv.Atoi(os.Getenv("R27_TRACES")); err == nil {
		seed, traces = uint64(time.Now().UnixNano()), v
		t.Logf("seed %d", seed)
	}
	rng := rand.New(rand.NewPCG(27, seed))
	for trace := range traces {
		ls := r27Tier(rng)
		states := make([]bucket.State, len(ls))
		now := int64(1e12)
		for step := range 120 {
			perToken := ls[0].Rate.Interval / ls[0].Rate.Tokens
			switch rng.IntN(4) {
			case 0:
			case 1:
				now += rng.Int64N(perToken + 2)
			case 2:
				now += rng.Int64N(ls[0].Capacity*perToken*2 + 2)
			default:
				now += rng.Int64N(ls[0].Ban + 2)
			}
			what := fmt.Sprintf("trace %d step %d limits %+v", trace, step, ls)
			r27Step(t, rng, states, now, ls, what)
			for i, l := range ls {
				at := now + rng.Int64N(3*perToken+1)
				p := bucket.Peek(states[i], at, l)
				want := r27Truth(states[i], at, l)
				if p.ResetAfter != want || p.ResetAfter < 0 {
					t.Fatalf("%s: Peek(%+v, %d) under limit %d = %+v; full in %d µs", what, states[i], at, i, p, want)
				}
			}
		}
	}
}

// Claim 1 across a reload: a state written under one limit, peeked under
// another. Peek's reset must still be exactly when Peek first says full.
func TestReview27PeekResetExactAcrossAReload(t *testing.T) {
	// The smallest case: 2 tokens at 7/s leave Slack 5 (a microsecond's
	// 7 units, 5 of them refilled already); reloaded to 2 at 1/100ms, the
	// 5 units of Slack are 5 µs of refill, and the bucket lacks more than
	// its capacity, so Peek takes the max with FullAt-now.
	a := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 7, Interval: second}}
	b := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}}
	now := 10 * second
	s, r := bucket.Take(bucket.State{}, now, a, 2)
	if !r.Allowed {
		t.Fatalf("take under a: %+v", r)
	}
	p := bucket.Peek(s, now, b)
	want := r27Truth(s, now, b)
	t.Logf("state %+v under %+v: Peek %+v, full (by Peek) in %d µs", s, b, p, want)
	if p.ResetAfter != want {
		t.Errorf("Peek's reset %d µs, but Peek says full from %d µs on (at %d: %+v)", p.ResetAfter, want, now+want, bucket.Peek(s, now+want, b))
	}

	// And at random: reachable states under one tier, peeked under another.
	rng := rand.New(rand.NewPCG(27, 2))
	bad, worst := 0, int64(0)
	for trace := range 300 {
		ls := r27Tier(rng)
		states := make([]bucket.State, len(ls))
		now := int64(1e12)
		for step := range 40 {
			now += rng.Int64N(ls[0].Capacity*ls[0].Rate.Interval/ls[0].Rate.Tokens + 2)
			r27Step(t, rng, states, now, ls, fmt.Sprintf("trace %d step %d", trace, step))
			for i := range states {
				l := r27Limit(rng, false, false)
				p := bucket.Peek(states[i], now, l)
				want := r27Truth(states[i], now, l)
				if p.ResetAfter != want || p.ResetAfter < 0 {
					if off := p.ResetAfter - want; off != states[i].Slack/l.Rate.Tokens {
						t.Errorf("off by %d µs, not Slack/Tokens %d", off, states[i].Slack/l.Rate.Tokens)
					}
					worst = max(worst, p.ResetAfter-want)
					if bad < 3 {
						t.Errorf("state %+v written under %+v, peeked under %+v: reset %d µs, full by Peek in %d µs (%d µs off)",
							states[i], ls[i], l, p.ResetAfter, want, p.ResetAfter-want)
					}
					bad++
				}
			}
		}
	}
	if bad > 0 {
		t.Errorf("%d peeks across a reload off, each by floor(Slack/Tokens) µs late, the worst %d µs", bad, worst)
	}
}

// Claim 1: never negative, never overflowing, at the extremes a store may
// hand Peek (a key's FullAt far ahead, a limit of maxUnits).
func TestReview27PeekResetAtTheExtremes(t *testing.T) {
	big := bucket.Limit{Capacity: bucket.MaxUnits, Rate: bucket.Rate{Tokens: math.MaxInt32, Interval: 1}}
	for _, c := range []struct {
		s   bucket.State
		now int64
		l   bucket.Limit
	}{
		{bucket.State{FullAt: math.MaxInt64}, 0, big},
		{bucket.State{FullAt: math.MaxInt64, Slack: math.MaxInt32 - 1}, 1, bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 1}}},
		{bucket.State{FullAt: math.MaxInt64 / 2}, math.MaxInt64 / 4, big},
		{bucket.State{FullAt: 5, Slack: 1 << 40}, 0, big},
	} {
		p := bucket.Peek(c.s, c.now, c.l)
		if p.ResetAfter < 0 || p.Remaining < 0 || p.Remaining > c.l.Capacity {
			t.Errorf("Peek(%+v, %d, %+v) = %+v", c.s, c.now, c.l, p)
		}
	}
}

// Claim 3 for the quota path: a quota's refusal (peekRefused) reports each
// limit by Peek; a banned limit's reset there agrees with what a take
// says of it.
func TestReview27QuotaRefusalReportsABannedLimitsReset(t *testing.T) {
	l := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 60 * second}, Ban: 3600 * second}
	now := 100 * second
	s := bucket.State{}
	for range 3 {
		s, _ = bucket.Take(s, now, l, 1)
	}
	_, tr := bucket.Take(s, now, l, 1)
	out := make([]bucket.Result, 1)
	bucket.PeekRefused([]bucket.State{s}, now, []bucket.Limit{l}, 1, out)
	if out[0].ResetAfter != tr.ResetAfter || out[0].RetryAfter != tr.RetryAfter {
		t.Errorf("quota refusal reports %+v, a take %+v", out[0], tr)
	}
}

// Found on the way: an allowed request of a tier that waits (max_wait)
// reported, for a limit that would have let it go sooner, the reset of the
// take it did not do: goTogether moves that limit's take to when the
// slowest limit lets the request go, which leaves it full later than its
// result said. Its result now speaks of the take it did.
func TestReview27GoTogetherReset(t *testing.T) {
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
	if got, want := out[1].ResetAfter, r27Truth(states[1], now, ls[1]); got != want {
		t.Errorf("limit 2's result %+v, but its state %+v is full in %d µs", out[1], states[1], want)
	}
}

// A bucket exactly empty, not banned, whose state an older rate wrote with
// a Slack of 5 units (7/s), read under 1/100ms. Its deficit is exactly the
// capacity; a Peek that took the max with FullAt-now was 5 µs past the
// moment it is full (the first fix's slip). The max is with
// untilLevel(s, now, l, l.Units()), FullAt-now-Slack/Tokens, exact.
func TestReview27PeekExactlyEmptyAfterAReload(t *testing.T) {
	b := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}}
	now := 10 * second
	s := bucket.State{FullAt: now + b.Units() + 5, Slack: 5} // Slack < 7, as 7/s writes it
	if s.Overdrawn(now, b) || s.Deficit(now, b) != b.Units() {
		t.Fatalf("not the case: banned %v, deficit %d", s.Overdrawn(now, b), s.Deficit(now, b))
	}
	p := bucket.Peek(s, now, b)
	if want := r27Truth(s, now, b); p.ResetAfter != want {
		t.Errorf("Peek %+v; Peek says full from %d µs on (%+v)", p, want, bucket.Peek(s, now+want, b))
	}
}
