package redisbucket

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// TestRedisScriptReplicatesEffectsBeforeItReadsTime checks the script's
// first statement: before it reads TIME it asks for effects replication,
// which Redis 3.2 and 4 need to let it write after TIME, and which is
// guarded so that a Redis without the call (7 and later may drop it) runs
// the script all the same. The Redis tests run it on the installed Redis;
// no older Redis is at hand, so this reads the source.
func TestRedisScriptReplicatesEffectsBeforeItReadsTime(t *testing.T) {
	t.Parallel()
	const want = "if redis.replicate_commands then redis.replicate_commands() end"
	first, _, _ := strings.Cut(strings.TrimSpace(bucketLua), "\n")
	if first != want {
		t.Fatalf("the script opens with %q, want %q", first, want)
	}
	if strings.Index(bucketLua, want) > strings.Index(bucketLua, "redis.call('TIME')") {
		t.Fatal("the script reads TIME before it asks for effects replication")
	}
}

// TestRedisScriptExplainsARefusedWrite makes Redis refuse the script's
// write (maxmemory reached, the nearest a current Redis comes to the
// refusal of an old one) and checks that the error says what happened.
func TestRedisScriptExplainsARefusedWrite(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}})
	srv.Do("SET", "ballast", strings.Repeat("x", 1<<20))
	srv.Do("CONFIG", "SET", "maxmemory-policy", "noeviction")
	srv.Do("CONFIG", "SET", "maxmemory", "1")
	_, err := s.takeLimit(bg, bucketFor("refused"), slowLimit(5), 1)
	srv.Do("CONFIG", "SET", "maxmemory", "0")
	if err == nil || !strings.Contains(err.Error(), "rate_limit: Redis refused to write the bucket") {
		t.Fatalf("take with the write refused: %v, want the script to say the write was refused", err)
	}
}

// The bucket's key lives until every limit is full and every lease has
// expired, counting the cap that tokens out on lease put on the level:
// while they are out, the level refills only up to C - out, and it starts
// refilling from there when the lease's record expires, later than the
// stored FullAt says. A node leases 50 of a bucket of 100 at 100/s, with a
// record of 200 ms: once the key expires, Redis answers as the model does,
// and the fleet (the node spending its 50 at its lease_ttl, then a burst
// taking what Redis has) takes no more than C + floor(r*T).
func TestABucketKeyOutlivesTheLeaseCapOnItsLevel(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("real-time test (a key's expiry): skipped under -short")
	}
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 10_000}}} // 100 100/s
	key := string(bucketFor("capped"))
	a := bucket.LeaseAsk{Node: "n1", Seq: 1, Cost: 1, Want: 50, Hold: 200_000}
	v, err := s.call(bg, key, s.args("lease", bucket.Tier{Limits: ls}, 0, a.Cost, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend), false, leaseAnswer+2)
	if err != nil {
		t.Fatal(err)
	}
	leasedAt := v[7]
	sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	if want := sh.Lease(leasedAt, ls, a); v[0] != want.Granted || v[0] != 50 {
		t.Fatalf("lease: Redis granted %d, the model %d; want 50", v[0], want.Granted)
	}
	pttl := srv.Do("PTTL", key)
	redistest.WaitFor(t, 3*time.Second, "the key to expire", func() bool { return srv.Do("EXISTS", key) == int64(0) })
	var out, want [1]bucket.Result
	_, now, err := s.decideAt(bg, "peek", key, bucket.Tier{Limits: ls}, 0, out[:], false)
	if err != nil {
		t.Fatal(err)
	}
	sh.Peek(now, ls, want[:])
	t.Logf("PTTL after the lease %v ms; %d µs after the lease the key is gone: Redis %d left, the model %d", pttl, now-leasedAt, out[0].Remaining, want[0].Remaining)
	if out[0] != want[0] {
		t.Errorf("after the key expired, %d µs after the lease: Redis %+v, the model %+v", now-leasedAt, out[0], want[0])
	}
	// The burst: the node spent its 50 at its lease_ttl, 150 ms after the
	// lease; the fleet's strict takes now get what Redis has.
	burst, last := int64(0), now
	for {
		res, at, err := s.run(bg, key, ls[0], 1)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Allowed {
			break
		}
		burst, last = burst+1, at
	}
	spent := leasedAt + 150_000
	bound := ls[0].Capacity + (last-spent)*ls[0].Rate.Tokens/ls[0].Rate.Interval
	if 50+burst > bound {
		t.Errorf("the fleet took 50 + %d between %d and %d µs, more than C + floor(r*T) = %d", burst, spent, last, bound)
	}
}

// BenchmarkRedisLeaseCalls is a node's lease call and the give-back of the
// lease, on one limit over 1,000 keys, in the script's short forms (its
// lease fast paths) and in the long form, in the same run: redis-µs/call
// is Redis's own time per call (INFO commandstats), allocs/op the node's
// for the two calls.
func BenchmarkRedisLeaseCalls(b *testing.B) {
	srv := redistest.Start(b)
	s := newTestStore(b, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
	l := bucket.Limit{Capacity: 10_000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}} // bench/caddy/i.Caddyfile's
	tr := oneLimit(l)
	var keys [1000]string
	for i := range keys {
		keys[i] = string(bucketFor("lease-calls-" + strconv.Itoa(i)))
	}
	evalsha := func() (calls, usec float64) {
		for f := range strings.SplitSeq(srv.Info("commandstats", "cmdstat_evalsha"), ",") {
			k, v, _ := strings.Cut(f, "=")
			n, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "calls":
				calls = n
			case "usec":
				usec = n
			}
		}
		return calls, usec
	}
	for _, form := range []string{"short", "long"} {
		b.Run(form, func(b *testing.B) {
			b.ReportAllocs()
			calls, usec := evalsha()
			var seq int64
			for b.Loop() {
				seq++
				key := keys[seq%int64(len(keys))]
				a := bucket.LeaseAsk{Node: "n1", Seq: seq, Cost: 1, Want: 1000, Hold: 1_350_000, Spend: 1}
				lease, back := s.leaseArgs(tr, a), s.returnArgs(tr, 999, a.Node, seq)
				if form == "long" {
					lease = s.args("lease", tr, 0, a.Cost, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend, 0)
					back = s.args("return", tr, 0, 999, a.Node, seq)
				}
				if v, err := s.call(bg, key, lease, false, leaseAnswer+2); err != nil || v[0] != a.Want {
					b.Fatalf("lease: %v %v", v, err)
				}
				if v, err := s.call(bg, key, back, false, 2); err != nil || v[0] != 999 {
					b.Fatalf("return: %v %v", v, err)
				}
			}
			calls2, usec2 := evalsha()
			b.ReportMetric((usec2-usec)/(calls2-calls), "redis-µs/call")
		})
	}
}

// Against a real redis-server, the script answers a request that a ban
// with max_wait refuses, while another node's record still holds tokens
// out, as the shared model does: retry when the request goes on within
// max_wait on the level those tokens cap, in a strict take and a lease
// call alike. A take then is admitted, waiting; one a second earlier is
// refused.
func TestTheScriptsBanRetryWithMaxWaitCountsTheTokensOutOnLease(t *testing.T) {
	f := newBanRetryFixture(t, "ban retry beside a lease")
	hold, s := f.hold, f.s
	// Node a holds 2 tokens; node b's response is charged 20 more; its
	// request of cost 3 is refused and bans.
	if g, _ := f.lease(bucket.LeaseAsk{Node: "a", Seq: 1, Cost: 1, Want: 2, Hold: hold}); g.Granted != 2 {
		t.Fatalf("node a's lease: %+v, want 2 tokens", g)
	}
	f.charge(20)
	const cost = 3
	refused, _ := f.lease(bucket.LeaseAsk{Node: "b", Seq: 1, Cost: cost, Want: cost, Spend: cost, Hold: hold})
	if refused.Granted != 0 || !refused.Banned {
		t.Fatalf("node b's lease of %d: %+v, want refused, starting a ban", cost, refused)
	}
	r := f.take(cost)
	if r.Allowed || r.RetryAfter < refused.RetryAfter-second || r.RetryAfter > refused.RetryAfter {
		t.Fatalf("a strict take of %d under the ban: %+v; the leased refusal said retry after %d µs", cost, r, refused.RetryAfter)
	}
	// Jump the script's clock to a second before the retry time, then to
	// it (a few milliseconds pass between calls: 0.1% of a token).
	s.clockOffset += r.RetryAfter - second
	if early := f.take(cost); early.Allowed {
		t.Fatalf("a take a second before the retry time: %+v, want refused", early)
	}
	s.clockOffset += second
	if again := f.take(cost); !again.Allowed || again.Wait == 0 {
		t.Fatalf("a take at the retry time: %+v, want admitted, waiting", again)
	}
}

// On a tier with max_wait and no ban holding it (ban 0, or a ban setting
// that this refusal does not start: the request fits within max_wait), a
// refused lease says retry when the shared bucket holds the cost, as
// without max_wait, in the script and the model: strict mode's wait
// within max_wait answers only refusals under a ban (LeaseResult's
// RetryAfter). The node calls again by then (lease_call.go's holdUntil).
func TestARefusedLeaseWithMaxWaitAndNoBanSaysWhenTheCostIsBack(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	for _, ban := range []int64{0, 60 * second} {
		// Capacity 4, one token every 10 s, max_wait 30 s.
		l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 10 * second}, Ban: ban, MaxWait: 30 * second}
		ls, tr := []bucket.Limit{l}, oneLimit(l)
		key := string(bucketFor(fmt.Sprint("refused lease with max_wait, ban ", ban)))
		sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
		lease := func(a bucket.LeaseAsk) (bucket.LeaseResult, int64) {
			t.Helper()
			got, now, err := s.leaseAt(bg, key, tr, a, nil)
			if err != nil {
				t.Fatal(err)
			}
			if want := sh.Lease(now, ls, a); got != want {
				t.Fatalf("ban %d: lease %+v at %d: Redis %+v, model %+v", ban, a, now, got, want)
			}
			return got, now
		}
		// Node a spends the whole bucket at once; node b's request of 1
		// finds it empty, its token due in 10 s, within max_wait.
		if g, _ := lease(bucket.LeaseAsk{Node: "a", Seq: 1, Cost: 4, Want: 4, Spend: 4, Hold: 60 * second}); g.Granted != 4 {
			t.Fatalf("ban %d: node a's lease: %+v, want the 4 tokens", ban, g)
		}
		a, at := lease(bucket.LeaseAsk{Node: "b", Seq: 1, Cost: 1, Want: 1, Spend: 1, Hold: 60 * second})
		if a.Granted != 0 || a.Banned || a.BanHolds {
			t.Fatalf("ban %d: node b's lease: %+v, want refused, no ban", ban, a)
		}
		var peek [1]bucket.Result
		sh.Peek(at, ls, peek[:])
		// The bucket is full 40 s after a's lease, so it holds a token 30 s
		// before it is full.
		if want := peek[0].ResetAfter - 30*second; a.RetryAfter != want || a.LimitRetry != want {
			t.Errorf("ban %d: the refused lease says retry after %d µs (limits' %d), want %d: when the token is back", ban, a.RetryAfter, a.LimitRetry, want)
		}
	}
}

// Against a real redis-server: the lease call whose refusal starts a ban
// with max_wait, from a node that holds tokens, says retry without
// reckoning with that node's own tokens, which it drops at the answer (it
// gives back what it did not spend): as strict mode answers once they are
// back, in the script and the model. A retry then is admitted.
func TestALeaseThatStartsABanWithMaxWaitRetriesWithoutTheTokensItsNodeDrops(t *testing.T) {
	f := newBanRetryFixture(t, "ban started by a node that holds tokens")
	hold, ls, sh := f.hold, f.ls, f.sh
	// Node b holds 2 tokens; its response is charged 20 more; its next
	// request, of cost 3, is refused and bans.
	if g, _ := f.lease(bucket.LeaseAsk{Node: "b", Seq: 1, Cost: 1, Want: 2, Hold: hold}); g.Granted != 2 {
		t.Fatalf("node b's lease: %+v, want 2 tokens", g)
	}
	f.charge(20)
	const cost = 3
	refused, now := f.lease(bucket.LeaseAsk{Node: "b", Seq: 2, Held: 2, Cost: cost, Want: cost, Spend: cost, Hold: hold})
	if refused.Granted != 0 || !refused.Banned || !refused.Drop || !refused.Void {
		t.Fatalf("node b's lease of %d: %+v, want refused, starting a ban, its tokens dropped and given back", cost, refused)
	}
	// The node gives its 2 tokens back (the ban voided them: nothing goes
	// back to the level); strict mode then says when a retry is admitted.
	sh.Return(now, ls, "b", 2, 2)
	var out [1]bucket.Result
	if sh.Take(now, ls, cost, out[:]); refused.RetryAfter != out[0].RetryAfter {
		t.Errorf("the refusal that started the ban says retry after %d µs; strict mode, with the node's tokens back, %d µs", refused.RetryAfter, out[0].RetryAfter)
	}
	if admitted := sh.Take(now+refused.RetryAfter, ls, cost, out[:]); !admitted {
		t.Errorf("a retry at %d µs: %+v, want admitted", refused.RetryAfter, out[0])
	}
}

// banRetryFixture is a real redis-server's bucket beside the shared model,
// for the ban-with-max_wait retry tests: capacity 4, one token every 10 s,
// ban 20 s, max_wait 30 s, records that live 10 min (hold). Each call
// checks Redis's answer against the model's.
type banRetryFixture struct {
	t    *testing.T
	s    *Store
	key  string
	ls   []bucket.Limit
	tr   bucket.Tier
	sh   *buckettest.Shared
	hold int64
}

func newBanRetryFixture(t *testing.T, name string) *banRetryFixture {
	t.Parallel()
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 10 * second}, Ban: 20 * second, MaxWait: 30 * second}
	return &banRetryFixture{
		t:    t,
		s:    newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second}),
		key:  string(bucketFor(name)),
		ls:   []bucket.Limit{l},
		tr:   oneLimit(l),
		sh:   &buckettest.Shared{Levels: make([]bucket.State, 1)},
		hold: 600 * second,
	}
}

// lease makes the lease call a, and returns its answer and Redis's time.
func (f *banRetryFixture) lease(a bucket.LeaseAsk) (bucket.LeaseResult, int64) {
	f.t.Helper()
	got, now, err := f.s.leaseAt(bg, f.key, f.tr, a, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	if want := f.sh.Lease(now, f.ls, a); got != want {
		f.t.Fatalf("lease %+v at %d: Redis %+v, model %+v", a, now, got, want)
	}
	return got, now
}

// take is a strict take of cost.
func (f *banRetryFixture) take(cost int64) bucket.Result {
	f.t.Helper()
	var out [1]bucket.Result
	_, now, err := f.s.decideAt(bg, "take", f.key, f.tr, cost, out[:], false)
	if err != nil {
		f.t.Fatal(err)
	}
	var want [1]bucket.Result
	f.sh.Take(now, f.ls, cost, want[:])
	if out != want {
		f.t.Fatalf("take %d at %d: Redis %+v, model %+v", cost, now, out[0], want[0])
	}
	return out[0]
}

// charge charges n tokens of a response (cost_from_response).
func (f *banRetryFixture) charge(n int64) {
	f.t.Helper()
	v, err := f.s.call(bg, f.key, f.s.args("charge", f.tr, 0, n), false, 3)
	if err != nil {
		f.t.Fatal(err)
	}
	f.sh.Charge(v[1], f.ls, n)
}
