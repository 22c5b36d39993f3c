package ratelimit

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// A tier of quotas alone takes from a limit that nothing shows (quotaLimit),
// since every store's step needs one. On random traces (requests in one
// microsecond, across midnight and the 1st, give-backs, charges within what
// the quotas have left) it never refuses what the quotas alone admit; and
// the property catches a hidden limit one token short, or one that refills
// in an hour rather than a microsecond.
// Regression test for issue 30 item 3.
func TestAQuotaPlansHiddenLimitNeverRefusesWhatItsQuotasAdmit(t *testing.T) {
	const seed = 30
	rng := rand.New(rand.NewPCG(seed, 0))
	for round := range 2000 {
		tier := randomQuotaPlan(t, rng)
		trace := randomQuotaTrace(rng, tier)
		if err := quotaPlanAgrees(tier, tier.limits, trace); err != nil {
			t.Fatalf("seed %d, round %d, quotas %v, cost %d: %v", seed, round, tier.Quotas, tier.cost, err)
		}
	}

	for _, mutant := range []struct {
		name   string
		mutate func(bucket.Limit) bucket.Limit
	}{
		{"one token short", func(l bucket.Limit) bucket.Limit {
			l.Capacity--
			return l
		}},
		{"refilled in an hour", func(l bucket.Limit) bucket.Limit {
			l.Rate.Interval, l.Instant = time.Hour.Microseconds(), false
			return l
		}},
	} {
		caught := false
		for range 2000 {
			tier := randomQuotaPlan(t, rng)
			if tier.limit.Capacity < 2 {
				continue
			}
			broken := []bucket.Limit{mutant.mutate(tier.limit)}
			if quotaPlanAgrees(tier, broken, randomQuotaTrace(rng, tier)) != nil {
				caught = true
				break
			}
		}
		if !caught {
			t.Errorf("a hidden limit %s was never caught", mutant.name)
		}
	}
}

// randomQuotaPlan is a validated tier of one to three quotas, each of a
// few tokens, and no rate limit.
func randomQuotaPlan(t *testing.T, rng *rand.Rand) *Tier {
	t.Helper()
	tier := &Tier{Name: "plan"}
	for _, p := range rng.Perm(3)[:1+rng.IntN(3)] {
		tier.Quotas = append(tier.Quotas, fmt.Sprintf("%d/%s", 1+rng.IntN(6), []string{"day", "month", "year"}[p]))
	}
	least := int64(7)
	for _, q := range tier.Quotas {
		var n int64
		fmt.Sscanf(q, "%d/", &n)
		least = min(least, n)
	}
	tier.Cost = 1 + rng.Int64N(least)
	ts, err := tier.check(tierContext{})
	if err != nil {
		t.Fatalf("quotas %v, cost %d: %v", tier.Quotas, tier.Cost, err)
	}
	tier.apply(ts)
	return tier
}

// quotaStep is one step of a trace: at a moment (µs), a request, a
// give-back of the request i steps before, or a charge.
type quotaStep struct {
	at       int64
	op       string // "take", "give back", "charge"
	n        int64
	ofBefore int
}

// randomQuotaTrace is 60 steps from a moment near the end of a day, a
// month and a year; most in the same microsecond as the step before or a
// few after, some an hour on, some just past the next midnight.
func randomQuotaTrace(rng *rand.Rand, tier *Tier) []quotaStep {
	now := time.Date(2026, 12, 31, 23, 59, 59, 0, time.UTC).UnixMicro() - rng.Int64N(3e6)
	var steps []quotaStep
	for range 60 {
		switch r := rng.IntN(10); {
		case r < 4:
		case r < 6:
			now += 1 + rng.Int64N(3)
		case r < 8:
			now += rng.Int64N(time.Hour.Microseconds())
		default:
			_, end := tier.quotas[0].Bounds(now)
			now = end + rng.Int64N(3)
		}
		st := quotaStep{at: now, op: "take", n: tier.cost}
		switch rng.IntN(8) {
		case 0:
			st.op, st.ofBefore = "give back", 1+rng.IntN(5)
		case 1:
			st.op, st.n = "charge", rng.Int64N(tier.cost+1)
		}
		steps = append(steps, st)
	}
	return steps
}

// quotaPlanAgrees runs trace on the tier's quotas alone, the model, and on
// its quotas with the limits ls, as the stores do: every request must be
// decided alike. A charge takes at most what the quotas have left (a
// larger one uses a quota up, which then refuses until its period ends
// whatever the limit), and a give-back returns an admitted request's cost.
func quotaPlanAgrees(tier *Tier, ls []bucket.Limit, trace []quotaStep) error {
	qs := tier.quotas
	model := make([]bucket.QuotaState, len(qs))
	qstates := make([]bucket.QuotaState, len(qs))
	states := make([]bucket.State, len(ls))
	out := make([]bucket.Result, len(ls))
	qout := make([]bucket.Result, len(qs))
	admitted := make([]bool, len(trace))
	for i, st := range trace {
		switch st.op {
		case "take":
			want := true
			for j, q := range qs {
				if _, r := bucket.TakeQuota(model[j], st.at, q, st.n); !r.Allowed {
					want = false
				}
			}
			if want {
				for j, q := range qs {
					model[j], _ = bucket.TakeQuota(model[j], st.at, q, st.n)
				}
			}
			got := bucket.TakeAllQuotas(states, qstates, st.at, st.at, ls, qs, st.n, out, qout)
			if got != want {
				return fmt.Errorf("step %d, a request of %d at %s: allowed %v, the quotas alone %v (limit %+v)", i, st.n, time.UnixMicro(st.at).UTC(), got, want, out[0])
			}
			admitted[i] = got
		case "give back":
			k := i - st.ofBefore
			if k < 0 || !admitted[k] {
				continue
			}
			admitted[k] = false
			for j, q := range qs {
				model[j] = bucket.GiveBackQuota(model[j], st.at, trace[k].at, q, trace[k].n)
				qstates[j] = bucket.GiveBackQuota(qstates[j], st.at, trace[k].at, q, trace[k].n)
			}
			for j, l := range ls {
				states[j] = bucket.GiveBack(states[j], st.at, l, trace[k].n)
			}
		case "charge":
			n := st.n
			for j, q := range qs {
				n = min(n, bucket.PeekQuota(model[j], st.at, q).Remaining)
			}
			for j, q := range qs {
				model[j] = bucket.ChargeQuota(model[j], st.at, q, n)
				qstates[j] = bucket.ChargeQuota(qstates[j], st.at, q, n)
			}
			for j, l := range ls {
				states[j] = bucket.Charge(states[j], st.at, l, n)
			}
		}
	}
	return nil
}
