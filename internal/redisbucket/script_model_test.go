package redisbucket

import (
	"context"
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
	"maps"
	"regexp"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// run makes one single-limit decision in Redis (a peek with cost 0), and
// also returns the server's time of the decision.
func (s *Store) run(ctx context.Context, key string, l bucket.Limit, cost int64) (bucket.Result, int64, error) {
	op := "take"
	if cost == 0 {
		op = "peek"
	}
	var out [1]bucket.Result
	_, now, err := s.decideAt(ctx, op, key, bucket.Tier{Limits: []bucket.Limit{l}}, cost, out[:], true)
	return out[0], now, err
}

// encodeShared is what the bucket script keeps of sh at now, segment by
// segment, by name: "1", "2"... for the limits not full, "l:<node>" for the
// leases.
func encodeShared(sh *buckettest.Shared, now int64) map[string]string {
	m := map[string]string{}
	for i, s := range sh.Levels {
		if s.FullAt > now {
			v := fmt.Sprintf("%d %d", s.FullAt, s.Slack)
			if s.Banned {
				v += " b"
			}
			m[strconv.Itoa(i+1)] = v
		}
	}
	for _, h := range sh.Held {
		void := 0
		if h.Void {
			void = 1
		}
		m["l:"+h.Node] = fmt.Sprintf("%d:%d:%d:%d", h.Tokens, h.Expires, h.Seq, void)
		if h.QStop > 0 {
			m["l:"+h.Node] += fmt.Sprintf(":%d:%d", h.QStop, h.Mask)
		}
	}
	return m
}

// decodeStored reads a bucket's value into encodeShared's form.
func decodeStored(t *testing.T, v string) map[string]string {
	t.Helper()
	m := map[string]string{}
	if v == "" {
		return m
	}
	for i, seg := range strings.Split(v, ";") {
		switch {
		case i == 0:
			if seg != "" {
				m["1"] = seg
			}
		case strings.HasPrefix(seg, "l:"):
			node, rest, _ := strings.Cut(seg[2:], ":")
			m["l:"+node] = rest
		default:
			at, state, ok := strings.Cut(seg, ":")
			if !ok {
				t.Fatalf("segment %q of %q: not a bucket", seg, v)
			}
			m[at] = state
		}
	}
	return m
}

// The bucket script is shared.go's Shared, step for step and to the unit:
// random traces of takes (with and without a ban), peeks, leases of several
// nodes, their give-backs, give-backs outside leases and charges, on one to
// three limits, against a real redis-server. After each step the answers
// match and the hash holds the model's bucket field for field.
func TestRedisScriptMatchesTheSharedModel(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	rng := rand.New(rand.NewPCG(20, 26))
	traces := 60
	if testing.Short() {
		traces = 15
	}
	for i := range traces {
		tr := buckettest.RandomTrace(rng)
		ls := []bucket.Limit{tr.Limit}
		for range rng.IntN(3) {
			ls = append(ls, buckettest.RandomTrace(rng).Limit)
		}
		for j := range ls {
			ls[j].MaxWait = ls[0].MaxWait // one max_wait a tier
		}
		if rng.IntN(3) == 0 {
			ban := 1 + rng.Int64N(3*ls[0].Units()/ls[0].Rate.Tokens)
			for j := range ls {
				ls[j].Ban = ban
			}
		}
		minCap := ls[0].Capacity
		for _, l := range ls {
			minCap = min(minCap, l.Capacity)
		}
		key := string(bucketFor("shared-" + strconv.Itoa(i)))
		sh := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
		nodes := []string{"a1", "b2", "c3"}
		seq := map[string]int64{}
		for j := range tr.Gaps {
			s.clockOffset += tr.Gaps[j]
			cost := 1 + rng.Int64N(minCap)
			if rng.IntN(4) == 0 {
				cost = 1
			}
			step := fmt.Sprintf("trace %d step %d (limits %+v)", i, j, ls)
			var now int64
			sent := time.Now()
			op := rng.IntN(10)
			step += fmt.Sprintf(" op %d", op)
			switch {
			case op < 3:
				out := make([]bucket.Result, len(ls))
				if rng.IntN(5) == 0 {
					cost = 0
				}
				v, err := s.decideBy(bg, "take", key, bucket.Tier{Limits: ls}, cost, out, false)
				if err != nil {
					t.Fatal(err)
				}
				now = v.now
				want := make([]bucket.Result, len(ls))
				wantAllowed := sh.Take(now, ls, cost, want)
				var next int64
				if wantAllowed {
					next = sh.Next(now, ls, nil, cost)
				}
				if v.allowed != wantAllowed || !slices.Equal(out, want) || v.next != next {
					t.Fatalf("%s take %d: Redis %+v %+v, model %v %+v, next %d", step, cost, v, out, wantAllowed, want, next)
				}
			case op < 4:
				out := make([]bucket.Result, len(ls))
				_, at, err := s.decideAt(bg, "peek", key, bucket.Tier{Limits: ls}, 0, out, false)
				if err != nil {
					t.Fatal(err)
				}
				now = at
				want := make([]bucket.Result, len(ls))
				sh.Peek(now, ls, want)
				if !slices.Equal(out, want) {
					t.Fatalf("%s peek: Redis %+v, model %+v", step, out, want)
				}
			case op < 7:
				node := nodes[rng.IntN(len(nodes))]
				seq[node]++
				a := bucket.LeaseAsk{Node: node, Seq: seq[node], Held: rng.Int64N(minCap), Cost: cost, Want: cost + rng.Int64N(minCap-cost+1), Hold: rng.Int64N(3 * ls[0].Units() / ls[0].Rate.Tokens)}
				if rng.IntN(2) == 0 {
					a.Spend = cost
				} else if rng.IntN(2) == 0 {
					a.Prefetch = true
				}
				each, wantEach := make([]bucket.Result, len(ls)), make([]bucket.Result, len(ls))
				got, at, err := s.leaseAt(key, bucket.Tier{Limits: ls}, a, each)
				if err != nil {
					t.Fatal(err)
				}
				now = at
				want := sh.Lease(now, ls, a)
				if sh.ReportEach(now, ls, nil, wantEach); got != want || !slices.Equal(each, wantEach) {
					t.Fatalf("%s lease %+v: Redis %+v %+v, model %+v %+v", step, a, got, each, want, wantEach)
				}
			case op < 8:
				node := nodes[rng.IntN(len(nodes))]
				n, at := 1+rng.Int64N(minCap), seq[node]-rng.Int64N(2)
				v, err := s.call(bg, key, s.args("return", bucket.Tier{Limits: ls}, 0, n, node, at), false, 2)
				if err != nil {
					t.Fatal(err)
				}
				now = v[1]
				if want := sh.Return(now, ls, node, at, n); v[0] != want {
					t.Fatalf("%s return %d of %s seq %d: Redis %d, model %d", step, n, node, at, v[0], want)
				}
			case op < 9:
				n := 1 + rng.Int64N(minCap)
				v, err := s.call(bg, key, s.args("giveback", bucket.Tier{Limits: ls}, 0, n), false, 2)
				if err != nil {
					t.Fatal(err)
				}
				now = v[1]
				sh.GiveBack(now, ls, n)
			default:
				n := rng.Int64N(3 * minCap)
				v, err := s.call(bg, key, s.args("charge", bucket.Tier{Limits: ls}, 0, n), false, 2)
				if err != nil {
					t.Fatal(err)
				}
				now = v[1]
				sh.Charge(now, ls, n)
			}
			raw, err := rdb.Get(bg, key).Result()
			if err != nil && err != redis.Nil {
				t.Fatal(err)
			}
			stored := decodeStored(t, raw)
			// A peek writes nothing: a limit it found full may keep its
			// state, which means the same as none.
			maps.DeleteFunc(stored, func(f, v string) bool {
				at, _, _ := strings.Cut(v, " ")
				full, err := strconv.ParseInt(at, 10, 64)
				return !strings.HasPrefix(f, "l:") && err == nil && full <= now
			})
			want := encodeShared(sh, now)
			// The key's expiry runs on Redis's real clock, not on the
			// offset one: a key may be gone once the real time since the
			// step covers all the model still keeps.
			if len(stored) == 0 && len(want) > 0 && sh.Life(now, ls) <= time.Since(sent).Microseconds() {
				continue
			}
			if !maps.Equal(stored, want) {
				t.Fatalf("%s: Redis holds %v, the model %v", step, stored, want)
			}
			// The key lives as long as the model needs the bucket: until
			// every lease expired and every limit refilled from the cap.
			if len(want) > 0 {
				pttl, err := rdb.PTTL(bg, key).Result()
				if err != nil {
					t.Fatal(err)
				}
				if life := sh.Life(now, ls); pttl.Microseconds()+time.Since(sent).Microseconds()+1000 < life {
					t.Fatalf("%s: the key expires in %s, the bucket is needed for %d µs", step, pttl, life)
				}
			}
		}
	}
}

// A bucket that a version before leases wrote, "<fullAt> <slack>", is read
// as the first limit's state, as it is: nothing refills.
func TestRedisScriptReadsABucketOfAnOlderVersion(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	l := slowLimit(10)
	b := bucketFor("old")
	key := string(b)
	res, now, err := s.run(bg, key, l, 0)
	if err != nil || res.Remaining != 10 {
		t.Fatalf("peek of no bucket: %+v, %v", res, err)
	}
	// Seven tokens taken, as an older version wrote it.
	srv.Do("SET", key, fmt.Sprintf("%d 0", now+7*l.Rate.Interval), "PX", "3600000")
	res, err = s.peekLimit(bg, b, l)
	if err != nil || res.Remaining != 3 {
		t.Fatalf("peek of the old bucket: %+v, %v; want 3 left", res, err)
	}
	res, err = s.takeLimit(bg, b, l, 1)
	if err != nil || !res.Allowed || res.Remaining != 2 {
		t.Fatalf("take: %+v, %v; want allowed with 2 left", res, err)
	}
	if v, _ := srv.Do("GET", key).(string); strings.Contains(v, ";") {
		t.Fatalf("a bucket of one limit and no lease is written %q, not as an older version reads it", v)
	}
}

// fastPathCase draws one take of the short form's shape (takeArgs) on a
// random stored bucket: a bucket the fast path answers (none, or one
// limit's "<fullAt> <slack>", overdrawn, full by now, written by another
// config) or one it must leave to the rest of the script (a ban mark,
// leases, a dropped quota's count). It returns the limit, the model's
// bucket, the key's value (none when absent is false), a segment the
// model does not hold ("" for none), the cost and the clock offset.
func fastPathCase(rng *rand.Rand) (l bucket.Limit, sh *buckettest.Shared, text string, present bool, other string, cost, offset int64) {
	l = r27Limit(rng)
	if rng.IntN(6) == 0 {
		// The largest capacity the rate allows: quotients near 2^52.
		l.Capacity = (1 << 52) / l.Rate.Interval
	}
	if rng.IntN(3) == 0 {
		l.Ban = 1 + rng.Int64N(5*bucket.CeilDiv(l.Units(), l.Rate.Tokens)+1)
	}
	if err := l.Validate(1); err != nil {
		panic(err)
	}
	if rng.IntN(2) == 0 {
		offset = rng.Int64N(1000 * second)
	}
	base := time.Now().UnixMicro() + offset
	sh = &buckettest.Shared{Levels: make([]bucket.State, 1)}
	present = true
	switch rng.IntN(8) {
	case 0:
		present = false
	case 1:
		// Full by now, and still kept: the key's life rounds up.
		sh.Levels[0] = bucket.State{FullAt: base - rng.Int64N(2000), Slack: rng.Int64N(l.Rate.Tokens)}
	case 2:
		// A ban's mark.
		sh.Levels[0] = r27State(rng, base, l)
		sh.Levels[0].Banned = true
	case 3:
		sh.Levels[0] = r27State(rng, base, l)
		for k, node := range []string{"a1", "b2"}[:1+rng.IntN(2)] {
			sh.Held = append(sh.Held, buckettest.Held{Node: node, Tokens: 1 + rng.Int64N(min(l.Capacity, 12)), Expires: base + 2*second + rng.Int64N(10*second), Seq: int64(k + 1)})
		}
	case 4:
		// The count of a quota a reload dropped, which stays until its
		// period ends.
		sh.Levels[0] = r27State(rng, base, l)
		other = fmt.Sprintf("q1:%d:3:%d", base-second, base+3600*second)
	default:
		sh.Levels[0] = r27State(rng, base, l)
		sh.Levels[0].Banned = false
	}
	if present {
		text = r27Text(sh, nil)
		if sh.Levels[0].FullAt != 0 && sh.Levels[0].FullAt <= base {
			text = fmt.Sprintf("%d %d", sh.Levels[0].FullAt, sh.Levels[0].Slack)
		}
		if other != "" {
			text += ";" + other
		}
	}
	cost = 1 + rng.Int64N(min(l.Capacity, 12))
	if rng.IntN(5) == 0 {
		cost = 0
	}
	return l, sh, text, present, other, cost, offset
}

// plainState is the text of a bucket of one limit and no lease, as the
// fast path reads it.
var plainState = regexp.MustCompile(`^\d+ \d+$`)

// checkFastPath plays cases takes of the short form, by script, each on a
// random stored bucket, and says how the first that differs from the model
// differs: in its answer, in what it leaves stored or for how long, or in
// whether the fast path answered it, which it must for a bucket of one
// limit and no lease unless the take starts a ban, and must not otherwise.
func checkFastPath(rdb *redis.Client, script *redis.Script, rng *rand.Rand, cases int) (fast, slow int, err error) {
	for c := range cases {
		l, sh, text, present, other, cost, offset := fastPathCase(rng)
		key := string(bucketFor(fmt.Sprint("fast-", c)))
		what := fmt.Sprintf("case %d: limit %+v, stored %q, cost %d, offset %d", c, l, text, cost, offset)
		if present {
			err = rdb.Set(bg, key, text, time.Hour).Err()
		} else {
			err = rdb.Del(bg, key).Err()
		}
		if err != nil {
			return fast, slow, err
		}
		tr := oneLimit(l)
		args := (&Store{clockOffset: offset}).takeArgs(tr, cost)
		if args == nil {
			return fast, slow, fmt.Errorf("%s: not the short form's shape", what)
		}
		sent := time.Now()
		vals, err := script.Run(bg, rdb, []string{key}, args...).Int64Slice()
		if err != nil {
			return fast, slow, fmt.Errorf("%s: %w", what, err)
		}
		if len(vals) != 4 && len(vals) != 8 {
			return fast, slow, fmt.Errorf("%s: the script answered %d values", what, len(vals))
		}
		var out [1]bucket.Result
		v := decodeTake(vals, tr, out[:])
		want := make([]bucket.Result, 1)
		allowed := sh.Take(v.now, tr.Limits, cost, want)
		var next int64
		if allowed {
			next = sh.Next(v.now, tr.Limits, nil, cost)
		}
		if v.allowed != allowed || out[0] != want[0] || v.next != next {
			return fast, slow, fmt.Errorf("%s: take at %d: Redis %+v %+v, model %v %+v next %d", what, v.now, v, out[0], allowed, want[0], next)
		}
		wantFast := (!present || plainState.MatchString(text)) && (allowed || l.Ban == 0)
		if (len(vals) == 4) != wantFast {
			return fast, slow, fmt.Errorf("%s: the fast path answered: %v, want %v (%d values)", what, len(vals) == 4, wantFast, len(vals))
		}
		if wantFast {
			fast++
		} else {
			slow++
		}
		raw, err := rdb.Get(bg, key).Result()
		if err != nil && err != redis.Nil {
			return fast, slow, err
		}
		if other != "" {
			if !strings.HasSuffix(raw, ";"+other) {
				return fast, slow, fmt.Errorf("%s: Redis holds %q, without the dropped quota's count", what, raw)
			}
			raw = strings.TrimSuffix(strings.TrimSuffix(raw, other), ";")
		}
		if stored, model := decodeStored(nil, raw), encodeShared(sh, v.now); !maps.Equal(stored, model) {
			return fast, slow, fmt.Errorf("%s: Redis holds %v, the model %v", what, stored, model)
		}
		if life := sh.Life(v.now, tr.Limits); life > 0 {
			pttl, err := rdb.PTTL(bg, key).Result()
			if err != nil {
				return fast, slow, err
			}
			if pttl.Microseconds()+time.Since(sent).Microseconds()+1000 < life {
				return fast, slow, fmt.Errorf("%s: the key expires in %s, the bucket is needed for %d µs", what, pttl, life)
			}
		}
	}
	return fast, slow, nil
}

// The fast path is package bucket's Take as the model takes it, on random
// stored buckets of every shape: those it answers, and those it must leave
// to the rest of the script, which answers them as before.
func TestRedisScriptFastPathMatchesTheModel(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	defer rdb.Close()
	cases := 3000
	if testing.Short() {
		cases = 600
	}
	fast, slow, err := checkFastPath(rdb, bucketScript, rand.New(rand.NewPCG(34, 1)), cases)
	if err != nil {
		t.Fatal(err)
	}
	if fast < cases/3 || slow < cases/5 {
		t.Fatalf("%d takes by the fast path and %d by the rest of %d: each shape should be common", fast, slow, cases)
	}
	t.Logf("%d takes by the fast path, %d by the rest", fast, slow)
}

// The fast path's property catches a fast path that breaks it: each
// mutation of the script below is a plausible slip, and the property must
// find a case it fails within the cases the test plays.
func TestTheFastPathPropertyCatchesABrokenScript(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client()
	defer rdb.Close()
	mutations := []struct{ name, from, to string }{
		{"the refill rounds down", "reset = floor((level - need) / iv), floor((d + need + k - 1) / k)", "reset = floor((level - need) / iv), floor((d + need) / k)"},
		{"the next wait only when empty", "if level - need < need then", "if level - need < 0 then"},
		{"a ban's mark read as a plain state", "'^(%d+) (%d+)$'", "'^(%d+) (%d+)'"},
		{"a debt read as an empty bucket", "if gap > 0 and gap > floor((units + slack) / k) then", "if false then"},
		{"a refusal under a ban starts none", "if x >= 0 or ban == 0 then", "if true then"},
		{"the key lives seconds, not milliseconds", "'PX', floor((full - now + 999) / 1000) + 1)", "'PX', floor((full - now + 999) / 1000000) + 1)"},
		{"the overdrawn retry is the refill's", "x, reset = floor((units - need + slack) / k) - gap, gap", "x, reset = -floor((need + k - 1) / k), gap"},
	}
	for _, m := range mutations {
		if strings.Count(bucketLua, m.from) != 1 {
			t.Fatalf("mutation %q: %q is not once in the script", m.name, m.from)
		}
		broken := redis.NewScript(strings.Replace(bucketLua, m.from, m.to, 1))
		if _, _, err := checkFastPath(rdb, broken, rand.New(rand.NewPCG(34, 1)), 3000); err == nil {
			t.Errorf("mutation %q: the property holds on the broken script", m.name)
		} else {
			t.Logf("mutation %q caught: %v", m.name, err)
		}
	}
}
