package buckettest

import (
	"math/big"
	"math/rand/v2"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Reference is the bucket as a formula, in exact rational arithmetic, the
// model that bucket.Take and every store are held to on random traces:
//
//	tokens = min(C, tokens_prev + (t - t_prev) * r)
//	if tokens >= k: allow; tokens -= k; t_prev = t
//	else:           deny; the state is left unchanged
//
// With a max_wait w, tokens may go below zero: a request is allowed when
// (k - tokens) / r <= w, and waits ceil((k - tokens) / r) when that is
// above 0; a denied one may retry after ceil((k - tokens) / r) - w.
type Reference struct {
	capacity *big.Rat
	maxWait  int64
	rate     *big.Rat // tokens per microsecond
	tokens   *big.Rat
	last     int64
	started  bool
}

// NewReference is a full bucket of limit l.
func NewReference(l bucket.Limit) *Reference {
	c := new(big.Rat).SetInt64(l.Capacity)
	return &Reference{capacity: c, maxWait: l.MaxWait, rate: big.NewRat(l.Rate.Tokens, l.Rate.Interval), tokens: new(big.Rat).Set(c)}
}

// Take applies a request, as the formula says.
func (m *Reference) Take(now, cost int64) bucket.Result {
	tokens := new(big.Rat).Set(m.tokens)
	if m.started {
		tokens.Add(tokens, new(big.Rat).Mul(new(big.Rat).SetInt64(now-m.last), m.rate))
		if tokens.Cmp(m.capacity) > 0 {
			tokens.Set(m.capacity)
		}
	}
	k := new(big.Rat).SetInt64(cost)
	var wait int64
	if tokens.Cmp(k) < 0 {
		wait = ceilRat(new(big.Rat).Quo(new(big.Rat).Sub(k, tokens), m.rate))
	}
	if wait > m.maxWait {
		return bucket.Result{
			Remaining:  max(0, floorRat(tokens)),
			RetryAfter: wait - m.maxWait,
			ResetAfter: ceilRat(new(big.Rat).Quo(new(big.Rat).Sub(m.capacity, tokens), m.rate)),
		}
	}
	if cost > 0 {
		tokens.Sub(tokens, k)
		m.tokens, m.last, m.started = tokens, now, true
	}
	return bucket.Result{
		Allowed:    true,
		Wait:       wait,
		Remaining:  max(0, floorRat(tokens)),
		ResetAfter: ceilRat(new(big.Rat).Quo(new(big.Rat).Sub(m.capacity, tokens), m.rate)),
	}
}

func floorRat(r *big.Rat) int64 {
	return new(big.Int).Quo(r.Num(), r.Denom()).Int64()
}

func ceilRat(r *big.Rat) int64 {
	q, m := new(big.Int).QuoRem(r.Num(), r.Denom(), new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Int64()
}

// TraceRates are the refills random traces draw from: common ones, and
// ones whose arithmetic has edges.
var TraceRates = []string{"1/s", "3/s", "100/s", "0.5/s", "1/10s", "30/m", "1000/h", "7/250ms", "2.25/s", "1000000/s", "13/7s"}

// Trace is one case of a property test: a limit and a series of arrivals
// with their costs.
type Trace struct {
	Limit bucket.Limit
	Gaps  []int64 // microseconds since the previous arrival
	Costs []int64
}

// RandomTrace draws a limit and 200 arrivals: gaps from none to several
// whole refills, most near one token's time, where the edges are.
func RandomTrace(rng *rand.Rand) Trace {
	rate, err := bucket.ParseRate(TraceRates[rng.IntN(len(TraceRates))])
	if err != nil {
		panic(err)
	}
	tr := Trace{Limit: bucket.Limit{Capacity: 1 + rng.Int64N(50), Rate: rate}}
	// Gaps from none at all to several refills of the whole bucket, with
	// most near the time one token takes, where the edges are.
	perToken := rate.Interval / rate.Tokens
	for range 200 {
		var gap int64
		switch rng.IntN(4) {
		case 0:
			gap = 0
		case 1:
			gap = rng.Int64N(perToken + 2)
		case 2:
			gap = rng.Int64N(3*perToken + 2)
		default:
			gap = rng.Int64N(tr.Limit.Capacity*perToken*2 + 2)
		}
		cost := int64(1)
		if rng.IntN(3) == 0 {
			cost = 1 + rng.Int64N(tr.Limit.Capacity)
		}
		tr.Gaps = append(tr.Gaps, gap)
		tr.Costs = append(tr.Costs, cost)
	}
	// A third of the traces wait: up to two whole refills.
	if rng.IntN(3) == 0 {
		tr.Limit.MaxWait = 1 + rng.Int64N(2*tr.Limit.Capacity*perToken+1)
	}
	return tr
}
