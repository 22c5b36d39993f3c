package bucket_test

import (
	"math/rand/v2"
	"testing"

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
