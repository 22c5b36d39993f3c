package bucket

import (
	"math/rand/v2"
	"testing"
)

// Take's common case, written out in Take, decides as the whole of take
// does (takeAny), over random limits (bans, max_wait, Instant among them),
// states (full, part full, in debt, banned) and costs; a variant that
// reports one token more left is caught.
func TestTakeCommonCaseDecidesAsEveryCase(t *testing.T) {
	const seed = 34
	rng := rand.New(rand.NewPCG(seed, seed))
	type call struct {
		s         State
		now, cost int64
		l         Limit
	}
	calls := make([]call, 200_000)
	for i := range calls {
		l := Limit{Capacity: 1 + rng.Int64N(1000), Rate: Rate{Tokens: 1 + rng.Int64N(5), Interval: 1 + rng.Int64N(1_000_000)}}
		switch rng.IntN(8) {
		case 0:
			l.Ban = 1 + rng.Int64N(1e7)
		case 1:
			l.MaxWait = rng.Int64N(1e6)
		case 2:
			l.Instant = true
		}
		now := 1 + rng.Int64N(1<<40)
		refill := CeilDiv(l.Units(), l.Rate.Tokens)
		s := State{FullAt: now - refill + rng.Int64N(4*refill), Slack: rng.Int64N(l.Rate.Tokens), Banned: rng.IntN(4) == 0}
		switch rng.IntN(8) {
		case 0:
			s = State{}
		case 1:
			// Far ahead, as after a reload or the clock going back: the
			// gap times the rate passes 64 bits, by a little or a lot.
			k := 20 + rng.IntN(11)
			l.Rate.Tokens = 1 << k
			s.FullAt = now + 1<<(64-k) + rng.Int64N(4)
			if rng.IntN(2) == 0 {
				s.FullAt += rng.Int64N(1 << 61)
			}
		}
		calls[i] = call{s, now, rng.Int64N(l.Capacity + 2), l}
	}
	differs := func(take func(State, int64, Limit, int64) (State, Result)) (n, fast int) {
		for _, c := range calls {
			if common(c.s, c.now, c.l, c.cost) {
				fast++
			}
			s1, r1 := take(c.s, c.now, c.l, c.cost)
			s2, r2 := takeAny(c.s, c.now, c.l, c.cost)
			if s1 != s2 || r1 != r2 {
				if n == 0 {
					t.Logf("seed %d: %+v: %+v %+v, want %+v %+v", seed, c, s1, r1, s2, r2)
				}
				n++
			}
		}
		return n, fast
	}
	n, fast := differs(Take)
	if n != 0 {
		t.Errorf("Take differs from takeAny in %d of %d calls", n, len(calls))
	}
	if fast < len(calls)/10 {
		t.Errorf("only %d of %d calls took the common case: the trace does not test it", fast, len(calls))
	}
	mutant := func(s State, now int64, l Limit, cost int64) (State, Result) {
		next, res := Take(s, now, l, cost)
		if common(s, now, l, cost) {
			res.Remaining++
		}
		return next, res
	}
	if n, _ := differs(mutant); n == 0 {
		t.Error("a common case reporting one token more is not caught")
	}
}

// common says whether Take decides a request in its common case: allowed,
// by a limit of no max_wait and not Instant, in a bucket not Overdrawn.
func common(s State, now int64, l Limit, cost int64) bool {
	_, res := takeAny(s, now, l, cost)
	return res.Allowed && l.MaxWait == 0 && !l.Instant && cost > 0 && !s.Overdrawn(now, l)
}
