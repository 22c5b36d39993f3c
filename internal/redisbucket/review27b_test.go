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

// Review 27b: the script's goTogether (f9ca558) against the Go model, on
// waiting takes of several limits, with leases held (Held records, some
// counted by quotas), bans, debts and quotas.

var r27bRates = []string{"1/s", "3/s", "7/s", "100/s", "0.5/s", "1/10s", "30/m", "7/250ms", "2.25/s", "13/7s", "999999/s", "1000000/s", "2000000/s"}

func r27bTier(rng *rand.Rand) []bucket.Limit {
	var ls []bucket.Limit
	for range 2 + rng.IntN(2) {
		rate, err := bucket.ParseRate(r27bRates[rng.IntN(len(r27bRates))])
		if err != nil {
			panic(err)
		}
		ls = append(ls, bucket.Limit{Capacity: 1 + rng.Int64N(12), Rate: rate})
	}
	var full int64
	for _, l := range ls {
		full = max(full, bucket.CeilDiv(l.Units(), l.Rate.Tokens))
	}
	mw := 1 + rng.Int64N(3*full+1)
	var ban int64
	if rng.IntN(3) == 0 {
		ban = 1 + rng.Int64N(5*full+1)
	}
	return r27Valid(ls, ban, mw)
}

// Claim 3: on random stored buckets, a take of several waiting limits
// answers as the model does, limit for limit, and leaves the bucket the
// model leaves; most of the takes allowed here wait, at different levels.
func TestReview27bScriptMatchesTheModelOnWaitingTakes(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	seed := uint64(0xb2)
	if v, err := strconv.ParseUint(os.Getenv("R27B_SEED"), 10, 64); err == nil {
		seed = v
	}
	rng := rand.New(rand.NewPCG(27, seed))
	day := bucket.Quota{N: 6, Period: bucket.Day, Loc: time.UTC}
	week := bucket.Quota{N: 9, Period: bucket.Week, Loc: time.UTC}
	cases := 2500
	var waited, waitedHeld, waitedQuota, refused, banned int
	for c := range cases {
		ls := r27bTier(rng)
		base := time.Now().UnixMicro() + 2*second
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		for i, l := range ls {
			full := bucket.CeilDiv(l.Units(), l.Rate.Tokens)
			var gap int64
			switch rng.IntN(8) {
			case 0:
				continue // full
			case 1, 2, 3:
				gap = rng.Int64N(full + 1) // part empty
			case 4, 5, 6:
				gap = full + rng.Int64N(l.MaxWait/2+2) // waiters past empty
			default:
				gap = full + rng.Int64N(4*full+1) // banned or in debt
			}
			sh.Levels[i] = bucket.State{FullAt: base + gap, Slack: rng.Int64N(l.Rate.Tokens), Banned: rng.IntN(10) == 0}
		}
		var qs []bucket.Quota
		switch rng.IntN(3) {
		case 0:
			qs = []bucket.Quota{day}
		case 1:
			qs = []bucket.Quota{day, week}
		}
		for _, q := range qs {
			start, _ := q.Bounds(base)
			sh.Quotas = append(sh.Quotas, bucket.QuotaState{Start: start, Used: rng.Int64N(q.N+1) * int64(rng.IntN(2))})
		}
		minCap := ls[0].Capacity
		for _, l := range ls {
			minCap = min(minCap, l.Capacity)
		}
		if rng.IntN(3) > 0 {
			for k, node := range []string{"a1", "b2", "c3"}[:1+rng.IntN(3)] {
				full := bucket.CeilDiv(ls[0].Units(), ls[0].Rate.Tokens)
				h := buckettest.Held{Node: node, Tokens: 1 + rng.Int64N(max(1, minCap/2)), Expires: base + rng.Int64N(2*full+1), Seq: int64(k + 1), Void: rng.IntN(5) == 0}
				if len(qs) > 0 && rng.IntN(2) == 0 {
					h.QStop, h.Mask = buckettest.QuotaStop(base, qs)
				}
				sh.Held = append(sh.Held, h)
			}
		}
		key := string(bucketFor(fmt.Sprint("r27b-", c)))
		text := r27Text(sh, qs)
		if err := rdb.Set(bg, key, text, time.Hour).Err(); err != nil {
			t.Fatal(err)
		}
		what := fmt.Sprintf("case %d: limits %+v, quotas %v, stored %q", c, ls, qs, text)
		cost := int64(1)
		if rng.IntN(3) == 0 {
			cost = 1 + rng.Int64N(minCap)
		}
		all := make([]bucket.Result, len(ls)+len(qs))
		v, err := s.decideBy(bg, "take", key, bucket.Tier{Limits: ls, Quotas: qs}, cost, all, false)
		if err != nil {
			t.Fatal(err)
		}
		want, wantQ := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
		heldBefore := len(sh.Held) > 0
		var allowed bool
		if len(qs) > 0 {
			allowed = sh.TakeWithQuotas(v.now, ls, qs, cost, want, wantQ)
		} else {
			allowed = sh.Take(v.now, ls, cost, want)
		}
		var next int64
		if allowed {
			next = sh.Next(v.now, ls, qs, cost)
		}
		if v.allowed != allowed || !slices.Equal(all[:len(ls)], want) || !slices.Equal(all[len(ls):], wantQ) || v.next != next {
			t.Fatalf("%s: take %d at %d: Redis %v %+v next %d, model %v %+v %+v next %d", what, cost, v.now, v.allowed, all, v.next, allowed, want, wantQ, next)
		}
		switch {
		case allowed && slices.ContainsFunc(want, func(r bucket.Result) bool { return r.Wait > 0 }):
			waited++
			if heldBefore {
				waitedHeld++
			}
			if len(qs) > 0 {
				waitedQuota++
			}
		case !allowed && want[0].Banned:
			banned++
		case !allowed:
			refused++
		}
		raw, err := rdb.Get(bg, key).Result()
		if err != nil && err != redis.Nil {
			t.Fatal(err)
		}
		stored := decodeStored(t, raw)
		maps.DeleteFunc(stored, func(f, v string) bool { return strings.HasPrefix(f, "q") })
		wantStored := encodeShared(sh, v.now)
		if !maps.Equal(stored, wantStored) {
			t.Fatalf("%s: take %d at %d: Redis holds %v, the model %v", what, cost, v.now, stored, wantStored)
		}
		// The quotas' counts.
		for j, q := range qs {
			seg := ""
			if sh.Quotas[j].Used > 0 {
				_, end := q.Bounds(sh.Quotas[j].Start)
				seg = fmt.Sprintf("q%d:%d:%d:%d", q.Period, sh.Quotas[j].Start, sh.Quotas[j].Used, end)
			}
			if seg != "" && !strings.Contains(raw, seg) {
				t.Fatalf("%s: Redis holds %q, the model's quota %d is %q", what, raw, j, seg)
			}
		}
	}
	t.Logf("%d takes: %d allowed that waited (%d with leases held, %d with quotas), %d refused, %d started a ban", cases, waited, waitedHeld, waitedQuota, refused, banned)
	if waited < cases/5 || waitedHeld < cases/10 {
		t.Errorf("too few waiting takes to say anything")
	}
}
