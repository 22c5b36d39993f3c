package redisbucket

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"regexp"
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

// decodeStored reads a bucket's value into encodeShared's form, with each
// quota's count as "q<period>": "<start>:<used>:<end>".
func decodeStored(v string) (map[string]string, error) {
	m := map[string]string{}
	if v == "" {
		return m, nil
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
				return nil, fmt.Errorf("segment %q of %q: not a bucket", seg, v)
			}
			m[at] = state
		}
	}
	return m, nil
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

// The script-model property: traces of every operation of the bucket
// script, from every kind of stored state, step for step against
// buckettest's Shared (the model of a shared bucket).

// modelStarts are the stored states a trace starts from.
var modelStarts = []string{
	"fresh", "part spent", "banned", "in debt", "the deepest debt", "waiters past empty",
	"written by another config", "leases held", "quotas counted", "a dropped quota's count",
}

// modelOps are the steps of a trace: a take (in the short form when the
// tier has its shape, takeArgs), a take in the long form whatever the
// tier, a peek, a lease, the give-back of a lease, a give-back outside
// leases, a charge, a reset, and a reload that changes the limits.
var modelOps = []string{"take", "long take", "peek", "lease", "return", "giveback", "charge", "reset", "reload"}

// modelRates are the limits' rates: slow and fast, fractional, and some
// whose interval is no multiple of their tokens.
var modelRates = []string{"1/s", "3/s", "7/s", "100/s", "0.5/s", "1/10s", "30/m", "7/250ms", "2.25/s", "13/7s", "999999/s", "1000000/s", "2000000/s", "1/h"}

// modelZones and modelEdges are where a tier of quotas starts: in one of
// five zones, near a calendar edge (a DST change, a leap February, the
// turn of a year, a Sunday night).
var modelZones = []string{"UTC", "America/New_York", "Europe/Berlin", "Asia/Kolkata", "Australia/Lord_Howe"}
var modelEdges = []time.Time{
	time.Date(2026, 3, 8, 6, 0, 0, 0, time.UTC),
	time.Date(2026, 11, 1, 5, 0, 0, 0, time.UTC),
	time.Date(2028, 2, 28, 23, 0, 0, 0, time.UTC),
	time.Date(2027, 2, 28, 22, 0, 0, 0, time.UTC),
	time.Date(2026, 12, 31, 22, 0, 0, 0, time.UTC),
	time.Date(2026, 12, 6, 22, 0, 0, 0, time.UTC),
}

// modelLimit draws a limit: a small capacity, now and then the largest
// one its rate allows (quotients near 2^52).
func modelLimit(rng *rand.Rand) bucket.Limit {
	rate, err := bucket.ParseRate(modelRates[rng.IntN(len(modelRates))])
	if err != nil {
		panic(err)
	}
	l := bucket.Limit{Capacity: 1 + rng.Int64N(12), Rate: rate}
	if rng.IntN(10) == 0 {
		l.Capacity = (1 << 52) / l.Rate.Interval
	}
	return l
}

// modelValid gives every limit of ls the ban and max_wait, the latter cut
// to what each limit's Validate accepts.
func modelValid(ls []bucket.Limit, ban, mw int64) []bucket.Limit {
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

// refillOf is how long limit l takes to refill from empty.
func refillOf(l bucket.Limit) int64 { return bucket.CeilDiv(l.Units(), l.Rate.Tokens) }

// deepestGap is how far ahead of now the deepest debt of limit l puts its
// full time (package bucket's maxDeficit over the rate).
func deepestGap(l bucket.Limit) int64 {
	u := l.Units()
	return (u + min(u*1000, 1<<52-u)) / l.Rate.Tokens
}

// modelTrace is one trace's tier, its model and what the key holds that
// the model does not: a dropped quota's count and when it ends.
type modelTrace struct {
	start       string
	ls          []bucket.Limit
	qs          []bucket.Quota
	sh          *buckettest.Shared
	other       string
	otherPeriod string
	otherEnd    int64
	charge      int64 // a first step's charge (the deepest debt), 0 for none
}

// minCap is the smallest capacity of the trace's limits.
func (m *modelTrace) minCap() int64 {
	c := m.ls[0].Capacity
	for _, l := range m.ls {
		c = min(c, l.Capacity)
	}
	return c
}

// drawModelTrace draws a tier and a stored state of the kind start names,
// around base (the server's time of the first step, about), and the key's
// value for it.
func drawModelTrace(rng *rand.Rand, start string, base int64) (*modelTrace, string) {
	m := &modelTrace{start: start}
	// Half the traces have the short form's shape: one limit, no quota,
	// no max_wait.
	lone := rng.IntN(2) == 0 && start != "waiters past empty" && start != "quotas counted"
	var ban, mw int64
	if start == "the deepest debt" {
		// Two limits Validate accepts at the ends of the range: 2^32
		// tokens at 3 per 1.048576 s (units 2^52), and 100 a year.
		r1, _ := bucket.ParseRate("3/1.048576s")
		r2, _ := bucket.ParseRate("1/365d")
		m.ls = [][]bucket.Limit{{{Capacity: 1 << 32, Rate: r1}}, {{Capacity: 100, Rate: r2}}}[rng.IntN(2)]
		m.charge, lone = 1<<40, true
	} else {
		m.ls = []bucket.Limit{modelLimit(rng)}
		if !lone {
			for range rng.IntN(3) {
				m.ls = append(m.ls, modelLimit(rng))
			}
		}
	}
	full := refillOf(m.ls[0])
	if rng.IntN(3) == 0 || start == "banned" {
		// At most a year: a ban of centuries on a yearly rate puts a full
		// time past 2^53 µs, beyond the script's exact doubles.
		ban = 1 + rng.Int64N(min(5*full, 366*24*3600*second)+1)
	}
	if !lone && (rng.IntN(3) == 0 || start == "waiters past empty") {
		mw = 1 + rng.Int64N(3*full+1)
	}
	m.ls = modelValid(m.ls, ban, mw)
	if start == "waiters past empty" && m.ls[0].MaxWait == 0 {
		// The largest capacity leaves no room to wait.
		m.ls = modelValid([]bucket.Limit{{Capacity: 5, Rate: m.ls[0].Rate}}, ban, 1+rng.Int64N(3*full+1))
	}
	if !lone && (rng.IntN(3) == 0 || start == "quotas counted" || start == "a dropped quota's count") {
		loc, err := time.LoadLocation(modelZones[rng.IntN(len(modelZones))])
		if err != nil {
			panic(err)
		}
		for _, p := range rng.Perm(3)[:1+rng.IntN(2)] {
			m.qs = append(m.qs, bucket.Quota{N: 1 + rng.Int64N(30), Period: bucket.Period(1 + p), Loc: loc})
		}
	}
	sh := &buckettest.Shared{Levels: make([]bucket.State, len(m.ls))}
	m.sh = sh
	for i, l := range m.ls {
		full := refillOf(l)
		var gap int64
		switch start {
		case "fresh", "the deepest debt":
			continue
		case "part spent":
			gap = rng.Int64N(full + 1)
		case "banned":
			gap = full + 1 + rng.Int64N(l.Ban+1)
			sh.Levels[i].Banned = true
		case "in debt":
			gap = full + 1 + rng.Int64N(20*full+1)
		case "waiters past empty":
			gap = full + rng.Int64N(l.MaxWait/2+2)
		case "written by another config":
			// Another rate's slack, which may pass this one's tokens, and
			// a full time anywhere, past this limit's whole refill too.
			gap = rng.Int64N(3*full + 3600*second)
			sh.Levels[i] = bucket.State{FullAt: base + min(gap, deepestGap(l)), Slack: rng.Int64N(modelLimit(rng).Rate.Tokens), Banned: rng.IntN(3) == 0}
			continue
		default:
			gap = rng.Int64N(2*full + 1)
		}
		sh.Levels[i].FullAt, sh.Levels[i].Slack = base+min(gap, deepestGap(l)), rng.Int64N(l.Rate.Tokens)
	}
	if start == "leases held" {
		for k, node := range []string{"a1", "b2", "c3"}[:1+rng.IntN(3)] {
			h := buckettest.Held{Node: node, Tokens: 1 + rng.Int64N(max(1, min(m.minCap(), 12)/2)), Expires: base + rng.Int64N(min(2*full, 3600*second)+1), Seq: int64(k + 1), Void: rng.IntN(5) == 0}
			if len(m.qs) > 0 && rng.IntN(2) == 0 {
				h.QStop, h.Mask = buckettest.QuotaStop(base, m.qs)
			}
			sh.Held = append(sh.Held, h)
		}
	}
	if start == "quotas counted" {
		for _, q := range m.qs {
			s, _ := q.Bounds(base)
			sh.Quotas = append(sh.Quotas, bucket.QuotaState{Start: s, Used: rng.Int64N(q.N + 1)})
		}
	}
	text := r34Text(sh, m.qs)
	if start == "a dropped quota's count" {
		// A yearly quota a reload dropped: its count stays until its
		// period ends.
		q := bucket.Quota{N: 9, Period: bucket.Year, Loc: time.UTC}
		s, end := q.Bounds(base)
		m.other, m.otherPeriod, m.otherEnd = fmt.Sprintf("%d:3:%d", s, end), fmt.Sprintf("q%d", q.Period), end
		text += fmt.Sprintf(";q%d:%s", q.Period, m.other)
	}
	return m, text
}

// r34Text is the key's value for sh, as the script writes it.
func r34Text(sh *buckettest.Shared, qs []bucket.Quota) string {
	enc := encodeShared(sh, 0)
	segs := []string{enc["1"]}
	for i := 2; i <= len(sh.Levels); i++ {
		if v, ok := enc[strconv.Itoa(i)]; ok {
			segs = append(segs, fmt.Sprintf("%d:%s", i, v))
		}
	}
	for _, h := range sh.Held {
		segs = append(segs, "l:"+h.Node+":"+enc["l:"+h.Node])
	}
	for j, q := range sh.Quotas {
		if q.Used > 0 {
			_, end := qs[j].Bounds(q.Start)
			segs = append(segs, fmt.Sprintf("q%d:%d:%d:%d", qs[j].Period, q.Start, q.Used, end))
		}
	}
	return strings.Join(segs, ";")
}

// plainBucket is the value of a bucket of one limit and no lease, which
// the short form's fast path answers.
var plainBucket = regexp.MustCompile(`^\d+ \d+$`)

// modelCounts are what the property's traces reached.
type modelCounts struct {
	starts, ops              map[string]int
	fast, shortLong          int // short-form takes the fast path answered, and those it left to the rest
	waited, banned, quotaRef int
}

// checkScriptModel plays traces traces of steps each, on s (whose script
// is bucketScript), and says how the first step that differs from the
// model differs: in its answer, in what the key holds, or in how long it
// lives; or whether the short form's fast path answered a take it must
// leave to the rest of the script, or the other way round.
func checkScriptModel(s *Store, rdb *redis.Client, rng *rand.Rand, traces, steps int) (modelCounts, error) {
	c := modelCounts{starts: map[string]int{}, ops: map[string]int{}}
	nodes := []string{"a1", "b2", "c3"}
	for ti := range traces {
		err := func() error {
			start := modelStarts[ti%len(modelStarts)]
			s.clockOffset = 0
			if rng.IntN(2) == 0 {
				s.clockOffset = modelEdges[rng.IntN(len(modelEdges))].UnixMicro() - time.Now().UnixMicro()
			}
			base := time.Now().UnixMicro() + s.clockOffset + 2*second
			m, text := drawModelTrace(rng, start, base)
			c.starts[start]++
			key := string(bucketFor(fmt.Sprint("model-", ti)))
			if text == "" {
				if err := rdb.Del(bg, key).Err(); err != nil {
					return err
				}
			} else if err := rdb.Set(bg, key, text, time.Hour).Err(); err != nil {
				return err
			}
			seq := map[string]int64{}
			var now int64
			for j := range steps {
				if j > 0 {
					full := refillOf(m.ls[0])
					gap := rng.Int64N(2*min(full, 3600*second) + 1)
					if len(m.qs) > 0 && rng.IntN(8) == 0 {
						gap = rng.Int64N(30 * 3600 * second)
					}
					s.clockOffset += gap * int64(rng.IntN(4)) / 3
				}
				ls, qs, sh := m.ls, m.qs, m.sh
				tr := bucket.Tier{Limits: ls, Quotas: qs}
				parts := tr.Parts()
				minCap := m.minCap()
				cost := 1 + rng.Int64N(min(minCap, 12))
				if rng.IntN(8) == 0 {
					cost = 1 + rng.Int64N(minCap)
				}
				op := modelOps[[]int{0, 0, 0, 0, 1, 2, 3, 3, 3, 4, 5, 6, 7, 8}[rng.IntN(14)]]
				if j == 0 && m.charge > 0 {
					op = "charge"
				}
				what := fmt.Sprintf("trace %d (from %s) step %d, %s: limits %+v, quotas %v", ti, start, j, op, ls, qs)
				read := time.Now()
				var get *redis.StringCmd
				var ttl *redis.DurationCmd
				if _, err := rdb.Pipelined(bg, func(p redis.Pipeliner) error {
					get, ttl = p.Get(bg, key), p.PTTL(bg, key)
					return nil
				}); err != nil && err != redis.Nil {
					return err
				}
				before := get.Val()
				sent := time.Now()
				c.ops[op]++
				switch op {
				case "take", "long take":
					if rng.IntN(6) == 0 {
						cost = 0
					}
					var args []any
					if op == "take" {
						args = s.takeArgs(tr, cost)
					}
					short := args != nil
					if !short {
						args = s.args("take", tr, 0, cost)
					}
					vals, err := s.call(bg, key, args, false, 4, 4+4*parts)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					out := make([]bucket.Result, parts)
					v := decodeTake(vals, tr, out)
					now = v.now
					want, wantQ := make([]bucket.Result, len(ls)), make([]bucket.Result, len(qs))
					allowed := sh.TakeWithQuotas(now, ls, qs, cost, want, wantQ)
					var next int64
					if allowed {
						next = sh.Next(now, ls, qs, cost)
					}
					if v.allowed != allowed || !slices.Equal(out[:len(ls)], want) || !slices.Equal(out[len(ls):], wantQ) || v.next != next {
						return fmt.Errorf("%s: take %d at %d (stored %q): Redis %+v %+v, model %v %+v %+v next %d", what, cost, now, before, v, out, allowed, want, wantQ, next)
					}
					if short {
						wantFast := (before == "" || plainBucket.MatchString(before)) && (allowed || ls[0].Ban == 0)
						// A key that lives a few milliseconds (a bucket that
						// refills in microseconds) may expire in real time
						// between the read above and the call: the call then
						// found no key, which the fast path answers.
						if expired := ttl.Val() >= 0 && ttl.Val() <= time.Since(read)+time.Millisecond; expired && len(vals) == 4 && (allowed || ls[0].Ban == 0) {
							wantFast = true
						}
						if (len(vals) == 4) != wantFast {
							return fmt.Errorf("%s: take %d of %q: the fast path answered: %v, want %v", what, cost, before, len(vals) == 4, wantFast)
						}
						if wantFast {
							c.fast++
						} else {
							c.shortLong++
						}
					}
					switch {
					case allowed && slices.ContainsFunc(want, func(r bucket.Result) bool { return r.Wait > 0 }):
						c.waited++
					case !allowed && len(want) > 0 && want[0].Banned:
						c.banned++
					case !allowed && slices.ContainsFunc(wantQ, func(r bucket.Result) bool { return !r.Allowed }):
						c.quotaRef++
					}
				case "peek":
					out := make([]bucket.Result, parts)
					v, err := s.decideBy(bg, "peek", key, tr, 0, out, false)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					now = v.now
					want := make([]bucket.Result, parts)
					sh.Peek(now, ls, want[:len(ls)])
					sh.PeekQuotas(now, qs, want[len(ls):])
					if !slices.Equal(out, want) {
						return fmt.Errorf("%s: peek at %d (stored %q): Redis %+v, model %+v", what, now, before, out, want)
					}
				case "lease":
					node := nodes[rng.IntN(len(nodes))]
					seq[node] = max(seq[node], 3) + 1
					a := bucket.LeaseAsk{Node: node, Seq: seq[node], Held: rng.Int64N(min(minCap, 12)), Cost: cost, Want: cost + rng.Int64N(min(minCap, 12)-min(cost, min(minCap, 12))+1), Hold: rng.Int64N(3 * min(refillOf(ls[0]), 3600*second))}
					if rng.IntN(2) == 0 {
						a.Spend = cost
					} else if rng.IntN(2) == 0 {
						a.Prefetch = true
					}
					each, wantEach := make([]bucket.Result, parts), make([]bucket.Result, parts)
					got, at, err := s.leaseAt(bg, key, tr, a, each)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					now = at
					want := sh.LeaseQuotas(now, ls, qs, a)
					if sh.ReportEach(now, ls, qs, wantEach); got != want || !slices.Equal(each, wantEach) {
						return fmt.Errorf("%s: lease %+v at %d (stored %q): Redis %+v %+v, model %+v %+v", what, a, now, before, got, each, want, wantEach)
					}
				case "return":
					node := nodes[rng.IntN(len(nodes))]
					n, at := 1+rng.Int64N(min(minCap, 12)), max(seq[node], 3)-rng.Int64N(2)
					if seq[node] == 0 {
						at = 1 + rng.Int64N(3) // a record the trace started with
					}
					args := s.args("return", tr, 0, n, node, at)
					if rng.IntN(2) == 0 {
						// The short form where the tier has its shape.
						args = s.returnArgs(tr, n, node, at)
					}
					v, err := s.call(bg, key, args, false, 2)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					now = v[1]
					if want := sh.ReturnQuotas(now, ls, qs, node, at, n); v[0] != want {
						return fmt.Errorf("%s: return %d of %s seq %d (stored %q): Redis %d, model %d", what, n, node, at, before, v[0], want)
					}
				case "giveback":
					// For a request taken a moment ago, or (now and then)
					// before the last boundary.
					at := time.Now().UnixMicro() + s.clockOffset - rng.Int64N(2)*rng.Int64N(30*3600*second)
					v, err := s.call(bg, key, s.args("giveback", tr, at, cost), false, 2)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					now = v[1]
					sh.GiveBack(now, ls, cost)
					sh.GiveBackQuotas(now, at, qs, cost)
				case "charge":
					n := rng.Int64N(3 * min(minCap, 12))
					if j == 0 && m.charge > 0 {
						n = m.charge
					}
					v, err := s.call(bg, key, s.args("charge", tr, 0, n), false, 3)
					if err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					now = v[1]
					debt := sh.Charge(now, ls, n)
					sh.ChargeQuotas(now, qs, n)
					if v[2] != debt {
						return fmt.Errorf("%s: the script says the bucket is out of debt in %d µs, the model in %d", what, v[2], debt)
					}
				case "reset":
					if err := s.Reset(bg, []byte(key)); err != nil {
						return err
					}
					*sh = buckettest.Shared{Levels: make([]bucket.State, len(ls))}
					m.other = ""
				case "reload":
					// New rates and capacities, or a limit more; the stored
					// states stay, as another config wrote them.
					next := slices.Clone(ls)
					for i := range next {
						if rng.IntN(2) == 0 && m.charge == 0 {
							next[i] = modelLimit(rng)
						}
					}
					if len(next) < 3 && rng.IntN(3) == 0 && m.charge == 0 {
						next = append(next, modelLimit(rng))
						sh.Levels = append(sh.Levels, bucket.State{})
					}
					m.ls = modelValid(next, ls[0].Ban, ls[0].MaxWait)
					if err := keepForReload(rdb, key, m, now, ls); err != nil {
						return fmt.Errorf("%s: %w", what, err)
					}
					continue
				}
				if err := checkStored(rdb, key, m, now, before, sent); err != nil {
					return fmt.Errorf("%s: %w", what, err)
				}
			}
			return nil
		}()
		if err != nil {
			return c, err
		}
	}
	return c, nil
}

// keepForReload keeps the key for the limits a reload brought, when they
// need the bucket longer than the old ones (a lease's tokens settle into a
// slower or an added limit: Shared.Life depends on the limits). The key
// lives as long as the limits of the call that wrote it needed it; under
// the new ones the first request would write a longer life, but a pause
// of the test (a loaded machine) could outlast the old one first. A key
// already gone is a bucket that was full under the limits that wrote it,
// as a request under the new config would find it: the model starts
// afresh, which only a bucket without quota counts may.
func keepForReload(rdb *redis.Client, key string, m *modelTrace, now int64, old []bucket.Limit) error {
	life := m.sh.Life(now, m.ls)
	if life <= m.sh.Life(now, old) {
		return nil
	}
	kept, err := rdb.PExpire(bg, key, time.Duration(life+2000)*time.Microsecond).Result()
	if err != nil || kept {
		return err
	}
	for _, q := range m.sh.Quotas {
		if q.Used > 0 {
			return fmt.Errorf("the key is gone, with a quota's count the model holds: %+v", m.sh.Quotas)
		}
	}
	if m.other != "" && m.otherEnd > now {
		return fmt.Errorf("the key is gone, with a dropped quota's count the model holds")
	}
	*m.sh = buckettest.Shared{Levels: make([]bucket.State, len(m.ls)), Quotas: make([]bucket.QuotaState, len(m.sh.Quotas))}
	return nil
}

// checkStored says how what the key holds after a step at now differs
// from the model m: its limits and leases (encodeShared), its quotas'
// counts of the periods that hold now, a dropped quota's count, and, when
// the step wrote it, how long it lives: as long as the model needs the
// bucket, and no longer than its last period or limit needs.
func checkStored(rdb *redis.Client, key string, m *modelTrace, now int64, before string, sent time.Time) error {
	raw, err := rdb.Get(bg, key).Result()
	if err != nil && err != redis.Nil {
		return err
	}
	stored, err := decodeStored(raw)
	if err != nil {
		return err
	}
	quotas := map[string]string{}
	for f, v := range stored {
		if strings.HasPrefix(f, "q") {
			quotas[f] = v
			delete(stored, f)
		}
	}
	// A step that writes nothing (a peek, a refusal) may leave a limit's
	// state that is full by now: the same as none.
	maps.DeleteFunc(stored, func(f, v string) bool {
		at, _, _ := strings.Cut(v, " ")
		full, err := strconv.ParseInt(at, 10, 64)
		return !strings.HasPrefix(f, "l:") && err == nil && full <= now
	})
	sh := m.sh
	want := encodeShared(sh, now)
	elapsed := time.Since(sent).Microseconds()
	// The key's expiry runs on Redis's real clock, not on the offset one:
	// a key may be gone once the real time since the step covers all the
	// model still keeps.
	if raw == "" && len(want) > 0 && sh.Life(now, m.ls) <= elapsed {
		return nil
	}
	if !maps.Equal(stored, want) {
		return fmt.Errorf("at %d Redis holds %v (%q, before %q), the model %v", now, stored, raw, before, want)
	}
	last := sh.Life(now, m.ls)
	for i, l := range sh.Levels[len(m.ls):] {
		_ = i
		last = max(last, l.FullAt-now)
	}
	for j, q := range m.qs {
		start, end := q.Bounds(now)
		f := fmt.Sprintf("q%d", q.Period)
		var st bucket.QuotaState
		if j < len(sh.Quotas) {
			st = sh.Quotas[j]
		}
		got, _, _ := strings.Cut(quotas[f], ":")
		switch {
		case st.Used > 0 && st.Start == start:
			if w := fmt.Sprintf("%d:%d:%d", start, st.Used, end); quotas[f] != w {
				return fmt.Errorf("at %d Redis holds quota %s %q, the model %q (%q)", now, f, quotas[f], w, raw)
			}
			last = max(last, end-now)
		case got == strconv.FormatInt(start, 10):
			return fmt.Errorf("at %d Redis holds quota %s %q of this period, the model %+v (%q)", now, f, quotas[f], st, raw)
		}
	}
	if m.other != "" && m.otherEnd > now {
		if quotas[m.otherPeriod] != m.other {
			return fmt.Errorf("at %d Redis holds %q, without the dropped quota's count %s:%s", now, raw, m.otherPeriod, m.other)
		}
		last = max(last, m.otherEnd-now)
	}
	if raw == before || raw == "" {
		return nil
	}
	pttl, err := rdb.PTTL(bg, key).Result()
	if err != nil {
		return err
	}
	// The real time since the step, PTTL's reading included.
	elapsed = time.Since(sent).Microseconds()
	if life := sh.Life(now, m.ls); pttl.Microseconds()+elapsed+1000 < life {
		return fmt.Errorf("the key expires in %s, the bucket is needed for %d µs (%q)", pttl, life, raw)
	}
	if pttl.Milliseconds() > last/1000+2000 {
		return fmt.Errorf("the key lives %s, its last period or limit needs %d µs (%q)", pttl, last, raw)
	}
	return nil
}

// The bucket script is buckettest's Shared, step for step and to the
// unit: random traces of every operation (takes in the short form and the
// long, peeks, leases of several nodes and their give-backs, give-backs
// outside leases, charges, resets, reloads that change the limits), on
// tiers of one to three limits with bans and max_wait and of calendar
// quotas across DST days, month and year ends in five zones, from every
// kind of stored state (fresh, banned, in debt to the deepest, waiters
// past empty, written by another config, leases held, quotas counted, a
// dropped quota's count), against a real redis-server. After each step
// the answers match, the key holds the model's bucket field for field, and
// lives as long as the model needs it and no longer than its last period.
// The fast path answers exactly the short-form takes it can. Leases, and
// half the give-backs, go in the short forms where the tier has their
// shape (leaseArgs, returnArgs).
func TestRedisScriptMatchesTheSharedModel(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("SCRIPT_MODEL_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (SCRIPT_MODEL_SEED=%d replays it)", seed, seed)
	traces, steps := 400, 40
	if testing.Short() {
		traces, steps = 120, 30
	}
	c, err := checkScriptModel(s, rdb, rand.New(rand.NewPCG(34, seed)), traces, steps)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("starts %v; steps %v; short-form takes: %d by the fast path, %d by the rest; %d allowed takes waited, %d started a ban, %d refused by a quota",
		c.starts, c.ops, c.fast, c.shortLong, c.waited, c.banned, c.quotaRef)
	for _, op := range modelOps {
		if c.ops[op] < traces/4 {
			t.Errorf("only %d steps %s", c.ops[op], op)
		}
	}
	if c.fast < traces || c.shortLong < traces/20 || c.waited < traces/20 || c.banned < traces/20 || c.quotaRef < traces/20 {
		t.Errorf("too few of some kind of take to say anything")
	}
}

// The property catches a script that breaks it: each mutation below is a
// plausible slip, in the short form's fast path or the rest, and the
// property finds a step it fails.
func TestTheScriptModelPropertyCatchesABrokenScript(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	mutations := []struct{ name, from, to string }{
		{"the fast path's refill rounds down", "reset = floor((level - need) / iv), floor((d + need + k - 1) / k)", "reset = floor((level - need) / iv), floor((d + need) / k)"},
		{"the fast path's next wait only when empty", "if level - need < need then", "if level - need < 0 then"},
		{"the fast path's key lives seconds, not milliseconds", "'PX', floor((full - now + 999) / 1000) + 1)", "'PX', floor((full - now + 999) / 1000000) + 1)"},
		{"the fast path reads a debt as an empty bucket", "if gap > 0 and gap > floor((units + slack) / k) then", "if false then"},
		{"the tier's fast path refills a unit short", "local refill = floor((d + need + l.tok - 1) / l.tok)", "local refill = floor((d + need) / l.tok)"},
		{"the tier's fast path's next wait forgets the quotas", "if out[1] == 1 and q.used + count > q.n then nxt", "if false then nxt"},
		{"the tier's fast path reads another period's count as this one's", "if Q[j].p == p + 0 and Q[j].start == s + 0 then", "if Q[j].p == p + 0 then"},
		{"a quota admits one more", "if q.used + cost > q.n then return {ok = false", "if q.used + cost > q.n + 1 then return {ok = false"},
		{"a charge's debt forgets the slack", "debt = math.max(debt, S[i].full - now - idiv(L[i].units + S[i].slack, L[i].tok))", "debt = math.max(debt, S[i].full - now - idiv(L[i].units, L[i].tok))"},
	}
	defer func(orig *redis.Script) { bucketScript = orig }(bucketScript)
	for _, m := range mutations {
		if strings.Count(bucketLua, m.from) != 1 {
			t.Fatalf("mutation %q: %q is not once in the script", m.name, m.from)
		}
		bucketScript = redis.NewScript(strings.Replace(bucketLua, m.from, m.to, 1))
		if _, err := checkScriptModel(s, rdb, rand.New(rand.NewPCG(34, 1)), 200, 30); err == nil {
			t.Errorf("mutation %q: the property holds on the broken script", m.name)
		} else {
			t.Logf("mutation %q caught: %v", m.name, err)
		}
	}
}

// checkLeaseShortForms plays traces of leases and give-backs on one limit
// without quotas, max_wait or a ban, sent in the script's short forms
// ("l" and "r": leaseArgs and returnArgs), from a fresh bucket, a spent
// one, one in debt, and one holding a lease of the node that calls, of
// another node, or one about to expire; and says how the first step that
// differs from buckettest's Shared differs: in its answer, in what the key
// holds, or in how long it lives.
func checkLeaseShortForms(s *Store, rdb *redis.Client, rng *rand.Rand, traces, steps int) error {
	for ti := range traces {
		s.clockOffset = 0
		base := time.Now().UnixMicro() + 2*second
		l := modelValid([]bucket.Limit{modelLimit(rng)}, 0, 0)[0]
		ls := []bucket.Limit{l}
		sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
		m := &modelTrace{ls: ls, sh: sh}
		full, half := refillOf(l), max(1, min(l.Capacity, 12)/2)
		switch ti % 5 {
		case 1:
			sh.Levels[0] = bucket.State{FullAt: base + rng.Int64N(full+1), Slack: rng.Int64N(l.Rate.Tokens)}
		case 2:
			sh.Levels[0] = bucket.State{FullAt: base + min(full+1+rng.Int64N(20*full+1), deepestGap(l)), Slack: rng.Int64N(l.Rate.Tokens)}
		case 3, 4:
			sh.Levels[0] = bucket.State{FullAt: base + rng.Int64N(full+1), Slack: rng.Int64N(l.Rate.Tokens)}
			node := []string{"a1", "b2"}[ti%5-3]
			sh.Held = []buckettest.Held{{Node: node, Tokens: 1 + rng.Int64N(half), Expires: base + rng.Int64N(min(2*full, 3600*second)+1), Seq: 1}}
		}
		key := string(bucketFor(fmt.Sprint("lease-short-", ti)))
		if text := r34Text(sh, nil); text == "" {
			if err := rdb.Del(bg, key).Err(); err != nil {
				return err
			}
		} else if err := rdb.Set(bg, key, text, time.Hour).Err(); err != nil {
			return err
		}
		seq := map[string]int64{"a1": 1, "b2": 1}
		for j := range steps {
			if j > 0 {
				s.clockOffset += rng.Int64N(2*min(full, 3600*second)+1) * int64(rng.IntN(4)) / 3
			}
			node := "a1"
			if rng.IntN(4) == 0 {
				node = "b2"
			}
			what := fmt.Sprintf("trace %d step %d: limit %+v", ti, j, l)
			before, err := rdb.Get(bg, key).Result()
			if err != nil && err != redis.Nil {
				return err
			}
			sent := time.Now()
			var now int64
			if rng.IntN(3) > 0 {
				seq[node]++
				c := min(l.Capacity, 12)
				cost := 1 + rng.Int64N(c)
				a := bucket.LeaseAsk{Node: node, Seq: seq[node], Held: rng.Int64N(c), Cost: cost, Want: cost + rng.Int64N(c-cost+1), Hold: rng.Int64N(3 * min(full, 3600*second))}
				prefetch := 0
				switch rng.IntN(3) {
				case 0:
					a.Spend = cost
				case 1:
					a.Prefetch, prefetch = true, 1
				}
				args := []any{"l", a.Cost, l.Capacity, l.Rate.Tokens, l.Rate.Interval, s.clockOffset, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend, prefetch}
				v, err := s.call(bg, key, args, false, leaseAnswer+2)
				if err != nil {
					return fmt.Errorf("%s: lease %+v: %w", what, a, err)
				}
				now = v[7]
				got := bucket.LeaseResult{Granted: v[0], Remaining: v[1], RetryAfter: v[2], HoldOff: v[3], ResetAfter: v[4], Banned: v[5] == 1, Drop: v[6] == 1,
					Until: v[8], QuotaHold: v[9], Void: v[10] == 1, BanHolds: v[11] == 1, LimitRetry: v[12]}
				each := []bucket.Result{{Remaining: v[13], ResetAfter: v[14]}}
				want, wantEach := sh.LeaseQuotas(now, ls, nil, a), make([]bucket.Result, 1)
				if sh.ReportEach(now, ls, nil, wantEach); got != want || !slices.Equal(each, wantEach) {
					return fmt.Errorf("%s: lease %+v at %d (stored %q): Redis %+v %+v, model %+v %+v", what, a, now, before, got, each, want, wantEach)
				}
			} else {
				n, at := 1+rng.Int64N(half+1), seq[node]-rng.Int64N(2)
				v, err := s.call(bg, key, []any{"r", n, l.Capacity, l.Rate.Tokens, l.Rate.Interval, s.clockOffset, node, at}, false, 2)
				if err != nil {
					return fmt.Errorf("%s: return: %w", what, err)
				}
				now = v[1]
				if want := sh.ReturnQuotas(now, ls, nil, node, at, n); v[0] != want {
					return fmt.Errorf("%s: return %d of %s seq %d at %d (stored %q): Redis %d, model %d", what, n, node, at, now, before, v[0], want)
				}
			}
			if err := checkStored(rdb, key, m, now, before, sent); err != nil {
				return fmt.Errorf("%s: %w", what, err)
			}
		}
	}
	return nil
}

// A lease and its give-back on one limit without quotas, max_wait or a
// ban go in the script's short forms, which its fast paths answer as
// buckettest's Shared does, step for step and to the unit (seed fixed).
func TestALoneLimitsLeaseAndReturnInTheShortFormsMatchTheModel(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	if err := checkLeaseShortForms(s, rdb, rand.New(rand.NewPCG(34, 3)), 300, 30); err != nil {
		t.Fatal(err)
	}
}

// The short forms' property catches a fast path that breaks it: each
// mutation below is a plausible slip in the lease or the return fast path.
func TestTheLeaseShortFormPropertyCatchesABrokenScript(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()
	mutations := []struct{ name, from, to string }{
		{"the lease fast path grants past half the capacity", "local grant = min(want, idiv(c, 2) - ht, idiv(units - d, iv))", "local grant = min(want, c - ht, idiv(units - d, iv))"},
		{"the lease fast path counts what the node spends as held", "ht + grant - min(spend, grant), now + hold", "ht + grant, now + hold"},
		{"the lease fast path trusts the node's held over the record", "ht = min(ht, math.max(held, 0))", "ht = math.max(held, 0)"},
		{"the fast paths forget the cap a lease puts on the level", "elseif def(now) < f then", "elseif false then"},
		{"the fast paths keep an expired lease", "if def(he) < f then put(he, f) end\n      hn = nil", "if def(he) < f then put(he, f) end"},
		{"the return fast path takes a give-back of an older call", "if hn and hs == seq then", "if hn then"},
		{"the return fast path gives nothing back to the level", "local d2 = raw - min(back, c) * iv", "local d2 = raw"},
		{"the fast paths' key forgets the cap the lease leaves when it expires", "if def(he) < min(ht, c) * iv then put(he, min(ht, c) * iv) end", "local _ = he"},
		{"the lease fast path's hold-off says the cost's wait", "hold_off = waitfor(want) end", "hold_off = lretry end"},
	}
	defer func(orig *redis.Script) { bucketScript = orig }(bucketScript)
	for _, m := range mutations {
		if strings.Count(bucketLua, m.from) != 1 {
			t.Fatalf("mutation %q: %q is not once in the script", m.name, m.from)
		}
		bucketScript = redis.NewScript(strings.Replace(bucketLua, m.from, m.to, 1))
		if err := checkLeaseShortForms(s, rdb, rand.New(rand.NewPCG(34, 3)), 300, 30); err == nil {
			t.Errorf("mutation %q: the property holds on the broken script", m.name)
		} else {
			t.Logf("mutation %q caught: %v", m.name, err)
		}
	}
}
