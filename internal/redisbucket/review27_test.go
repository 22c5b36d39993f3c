package redisbucket

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// Review of 4b08e83: the script's peek, report and each_level against
// the Go model, on stored states of every shape the change concerns
// (banned, in debt, waiters past empty, exactly empty) and, above all,
// states that another config wrote (a reload): a Slack of more than the
// current rate's tokens, a FullAt past the current limit's whole refill.

var r27Rates = []string{"1/s", "3/s", "7/s", "999999/s", "100/s", "0.5/s", "1/10s", "30/m", "7/250ms", "2.25/s", "1000000/s", "13/7s"}

func r27Limit(rng *rand.Rand) bucket.Limit {
	rate, err := bucket.ParseRate(r27Rates[rng.IntN(len(r27Rates))])
	if err != nil {
		panic(err)
	}
	return bucket.Limit{Capacity: 1 + rng.Int64N(12), Rate: rate}
}

// r27Tier is a tier of one to three limits, one ban and max_wait for all,
// valid for each.
func r27Tier(rng *rand.Rand) []bucket.Limit {
	ls := []bucket.Limit{r27Limit(rng)}
	for range rng.IntN(3) {
		ls = append(ls, r27Limit(rng))
	}
	var ban, mw int64
	full := bucket.CeilDiv(ls[0].Units(), ls[0].Rate.Tokens)
	if rng.IntN(3) == 0 {
		ban = 1 + rng.Int64N(5*full+1)
	}
	if rng.IntN(3) == 0 {
		mw = 1 + rng.Int64N(2*full+1)
	}
	return r27Valid(ls, ban, mw)
}

// r27Valid gives every limit of ls the ban and max_wait, the latter cut to
// what each limit's Validate accepts.
func r27Valid(ls []bucket.Limit, ban, mw int64) []bucket.Limit {
	for _, l := range ls {
		mw = min(mw, min(l.Units()*1000, 1<<52-l.Units())/l.Rate.Tokens)
	}
	for i := range ls {
		ls[i].Ban, ls[i].MaxWait = ban, mw
		if err := ls[i].Validate(1); err != nil {
			panic(err)
		}
	}
	return ls
}

// r27State draws a state around base for limit l, as l or an older
// config (another rate, whose Slack may pass l's tokens) wrote it.
func r27State(rng *rand.Rand, base int64, l bucket.Limit) bucket.State {
	writer := l
	if rng.IntN(2) == 0 {
		writer = r27Limit(rng)
	}
	full := bucket.CeilDiv(l.Units(), l.Rate.Tokens)
	var gap int64
	switch rng.IntN(6) {
	case 0:
		return bucket.State{}
	case 1:
		gap = rng.Int64N(full + 1)
	case 2:
		gap = full + rng.Int64N(3) - 1 // about exactly empty
	case 3:
		gap = full + rng.Int64N(20*full+1) // banned or in debt
	case 4:
		gap = rng.Int64N(3) // all but full
	default:
		gap = rng.Int64N(3600 * second)
	}
	return bucket.State{FullAt: base + 2*second + gap, Slack: rng.Int64N(writer.Rate.Tokens), Banned: rng.IntN(3) == 0}
}

// r27Text is the key's value for sh, as the script writes it, the leases'
// quota marks included.
func r27Text(sh *buckettest.Shared, qs []bucket.Quota) string {
	st := func(s bucket.State) string {
		if s.FullAt == 0 {
			return ""
		}
		v := fmt.Sprintf("%d %d", s.FullAt, s.Slack)
		if s.Banned {
			v += " b"
		}
		return v
	}
	segs := []string{st(sh.Levels[0])}
	for i, s := range sh.Levels[1:] {
		if s.FullAt != 0 {
			segs = append(segs, fmt.Sprintf("%d:%s", i+2, st(s)))
		}
	}
	for _, h := range sh.Held {
		void := 0
		if h.Void {
			void = 1
		}
		seg := fmt.Sprintf("l:%s:%d:%d:%d:%d", h.Node, h.Tokens, h.Expires, h.Seq, void)
		if h.QStop > 0 {
			seg += fmt.Sprintf(":%d:%d", h.QStop, h.Mask)
		}
		segs = append(segs, seg)
	}
	for j, q := range sh.Quotas {
		if q.Used > 0 {
			_, end := qs[j].Bounds(q.Start)
			segs = append(segs, fmt.Sprintf("q%d:%d:%d:%d", qs[j].Period, q.Start, q.Used, end))
		}
	}
	return strings.Join(segs, ";")
}

// Claim 2: peek, take (its "had room" branch and a quota's refusal use
// peek), and a lease's report and each level agree with the model on
// random stored states, reloaded ones included.
func TestReview27ScriptMatchesTheModelOnStoredStates(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	seed := uint64(3)
	if v, err := strconv.ParseUint(os.Getenv("R27_SEED"), 10, 64); err == nil {
		seed = v
	}
	rng := rand.New(rand.NewPCG(27, seed))
	day := bucket.Quota{N: 5, Period: bucket.Day, Loc: time.UTC}
	cases := 3000
	if testing.Short() {
		cases = 500
	}
	var peeks, takes, leases, quotaRefusals int
	for c := range cases {
		ls := r27Tier(rng)
		base := time.Now().UnixMicro()
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		for i, l := range ls {
			sh.Levels[i] = r27State(rng, base, l)
		}
		if len(ls) == 1 && rng.IntN(2) == 0 && sh.Levels[0].FullAt != 0 {
			// A bucket of one limit and no lease: "<fullAt> <slack>".
		} else if rng.IntN(2) == 0 {
			minCap := ls[0].Capacity
			for _, l := range ls {
				minCap = min(minCap, l.Capacity)
			}
			for k, node := range []string{"a1", "b2"}[:1+rng.IntN(2)] {
				sh.Held = append(sh.Held, buckettest.Held{Node: node, Tokens: 1 + rng.Int64N(minCap), Expires: base + 2*second + rng.Int64N(10*second), Seq: int64(k + 1)})
			}
		}
		var qs []bucket.Quota
		if rng.IntN(3) == 0 {
			qs = []bucket.Quota{day}
			start, _ := day.Bounds(base)
			sh.Quotas = []bucket.QuotaState{{Start: start, Used: day.N - rng.Int64N(2)}}
		}
		key := string(bucketFor(fmt.Sprint("r27-", c)))
		if err := rdb.Set(bg, key, r27Text(sh, qs), time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		what := fmt.Sprintf("case %d: limits %+v, stored %q", c, ls, r27Text(sh, qs))
		n := len(ls) + len(qs)
		switch op := rng.IntN(3); op {
		case 0:
			all := make([]bucket.Result, n)
			v, err := s.decideBy(bg, "peek", key, bucket.Tier{Limits: ls, Quotas: qs}, 0, all, false)
			if err != nil {
				t.Fatal(err)
			}
			want := make([]bucket.Result, n)
			sh.Peek(v.now, ls, want[:len(ls)])
			sh.PeekQuotas(v.now, qs, want[len(ls):])
			if !slices.Equal(all[:len(ls)], want[:len(ls)]) {
				t.Fatalf("%s: peek at %d: Redis %+v, model %+v", what, v.now, all, want)
			}
			peeks++
		case 1:
			cost := int64(1)
			if rng.IntN(3) == 0 {
				cost = 0
			}
			all := make([]bucket.Result, n)
			v, err := s.decideBy(bg, "take", key, bucket.Tier{Limits: ls, Quotas: qs}, cost, all, false)
			if err != nil {
				t.Fatal(err)
			}
			want, wantQ := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
			var allowed bool
			if len(qs) > 0 {
				allowed = sh.TakeWithQuotas(v.now, ls, qs, cost, want, wantQ)
				if !wantQ[0].Allowed && cost > 0 {
					quotaRefusals++
				}
			} else {
				allowed = sh.Take(v.now, ls, cost, want)
			}
			if v.allowed != allowed || !slices.Equal(all[:len(ls)], want) {
				t.Fatalf("%s: take %d at %d: Redis %v %+v, model %v %+v", what, cost, v.now, v.allowed, all, allowed, want)
			}
			takes++
		default:
			minCap := ls[0].Capacity
			for _, l := range ls {
				minCap = min(minCap, l.Capacity)
			}
			// A node asks for at most half the capacity, at least 1
			// (LeaseSize.Of).
			a := bucket.LeaseAsk{Node: "a1", Seq: 9, Held: rng.Int64N(3), Cost: 1, Want: max(1, 1+rng.Int64N(minCap/2+1)), Hold: rng.Int64N(5 * second), Prefetch: rng.IntN(3) == 0}
			if !a.Prefetch && rng.IntN(2) == 0 {
				a.Spend = 1
			}
			each, wantEach := make([]bucket.Result, n), make([]bucket.Result, n)
			got, now, err := s.leaseAt(key, bucket.Tier{Limits: ls, Quotas: qs}, a, each)
			if err != nil {
				t.Fatal(err)
			}
			want := sh.LeaseQuotas(now, ls, qs, a)
			sh.ReportEach(now, ls, qs, wantEach)
			if got != want || !slices.Equal(each, wantEach) {
				t.Fatalf("%s: lease %+v at %d: Redis %+v %+v, model %+v %+v", what, a, now, got, each, want, wantEach)
			}
			leases++
		}
		// What the step left stored, the model's bucket field for field.
		if raw, err := rdb.Get(bg, key).Result(); err == nil || err == redis.Nil {
			now := time.Now().UnixMicro()
			stored := decodeStored(t, raw)
			maps.DeleteFunc(stored, func(f, v string) bool { return strings.HasPrefix(f, "q") })
			want := encodeShared(sh, now)
			for f := range stored {
				if _, ok := want[f]; !ok && !strings.HasPrefix(f, "l:") {
					// A limit full by now, kept by a peek: the same as none.
					var full int64
					fmt.Sscan(stored[f], &full)
					if full <= now {
						delete(stored, f)
					}
				}
			}
			for f, v := range want {
				if stored[f] != v {
					t.Fatalf("%s: Redis holds %v, the model %v", what, stored, want)
				}
			}
		}
	}
	t.Logf("%d peeks, %d takes (%d refused by the quota), %d leases", peeks, takes, quotaRefusals, leases)
}
