package redisbucket

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"weak"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A give-back computed under an older config creates no tokens, also when
// the reload changes the refill: rate_limit 10 1/s to rate_limit 1000 100/s.
// A request admitted under the old config and answered after the reload
// (count_status) gives back its token as the running limit counts it
// (Limit.Converted), and so does a lease table closed at the reload: one
// old token is not a second of the new bucket's refill (100 tokens).
func TestAGiveBackUnderAnOlderRateCreatesNoTokens(t *testing.T) {
	t.Parallel()
	old := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: second}}   // 10 1/s
	cur := bucket.Limit{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 10_000}} // 1000 100/s
	now := 10 * second
	st, _ := bucket.Take(bucket.State{}, now, cur, 200) // 800 left
	// The handler and a lease table closed by a reload give back in the
	// running config's limit, converted with Converted; the math never
	// sees an old limit.
	t.Run("GiveBack", func(t *testing.T) {
		got := bucket.Peek(bucket.GiveBack(st, now, cur, cur.Converted(1, old)), now, cur).Remaining
		if got != 801 {
			t.Errorf("800 left of 1000, one token given back under the old limit 10 1/s: %d left, want 801", got)
		}
		// A slower refill: one old token is a hundredth of a new one.
		if got := bucket.Peek(bucket.GiveBack(st, now, cur, old.Converted(1, cur)), now, old).Remaining; got > bucket.Peek(st, now, old).Remaining {
			t.Errorf("a token of 100/s given back under 1/s added %d", got-bucket.Peek(st, now, old).Remaining)
		}
	})
	t.Run("Shared.GiveBack", func(t *testing.T) {
		sh := &buckettest.Shared{Levels: []bucket.State{st}}
		sh.GiveBack(now, []bucket.Limit{cur}, cur.Converted(1, old))
		var out [1]bucket.Result
		sh.Peek(now, []bucket.Limit{cur}, out[:])
		if out[0].Remaining != 801 {
			t.Errorf("shared bucket, 800 left, one token back under the old limit: %d left, want 801", out[0].Remaining)
		}
	})
	t.Run("a lease table closed by the reload", func(t *testing.T) {
		// A node of the old config leased before the reload, and gives
		// back when its table closes, 2 s later, as the new config counts.
		clock := new(fakeClock)
		clock.micros.Store(now - 2*second)
		m := newSharedModel(clock.now)
		node := newModelTable(m, LeaseSize{tokens: 5}, time.Hour)
		node.current = func(string, bucket.Tier) (bucket.Tier, bool) { return bucket.Tier{Limits: []bucket.Limit{cur}}, true }
		for range 3 { // leases of 1, 2, 4: 3 held
			if res, _ := node.take(bg, []byte("k"), oneLimit(old), 1, nil); !res.Allowed {
				t.Fatal("denied from a full bucket")
			}
			tableSync(node)
		}
		clock.micros.Store(now)
		m.mu.Lock()
		var out [1]bucket.Result
		sh := m.bucket("k", 1)
		sh.Peek(now, []bucket.Limit{cur}, out[:])
		if !sh.Take(now, []bucket.Limit{cur}, out[0].Remaining-800, out[:]) {
			t.Fatalf("take down to 800: %+v", out[0])
		}
		m.mu.Unlock()
		before := m.level("k", cur)
		held := node.shard([]byte("k")).m["k"].tokens
		node.close()
		if after := m.level("k", cur); after > before+held {
			t.Errorf("%d leased tokens returned under the old limit: %d left, then %d, want at most %d", held, before, after, before+held)
		}
	})
}

// Once a node gives back, the shared store holds every token not spent
// (TestLeasingNodesConserveEveryToken), also the tokens a node held across
// a refused call (a prefetch at half the lease, or a request of cost 2 on
// the last token): the give-back names the refused call, and the store
// must still return what the node held.
func TestTokensHeldAcrossARefusedCallGoBackAtTheGiveBack(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name string
		cost int64
	}{{"a refused prefetch", 1}, {"a refused request of cost 2", 2}} {
		t.Run(tt.name, func(t *testing.T) {
			clock, m := newModelStore()
			l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}} // 100 1/h
			ls := []bucket.Limit{l}
			node := newModelTable(m, LeaseSize{tokens: 10}, time.Second)
			key := []byte("k")
			spent := int64(0)
			take := func(cost int64) bucket.Result {
				res, err := node.take(bg, key, oneLimit(l), cost, nil)
				tableSync(node)
				if err != nil {
					t.Fatal(err)
				}
				if res.Allowed {
					spent += cost
				}
				return res
			}
			held := func() int64 { return node.shard(key).m["k"].tokens }
			for range 8 { // leases of 1, 2, 4, 8, then 10 at half
				take(1)
			}
			t.Logf("after 8 requests the node holds %d, its lease is %d", held(), node.shard(key).m["k"].size)
			// Another node takes what the shared bucket holds.
			m.mu.Lock()
			var out [1]bucket.Result
			sh := m.bucket("k", 1)
			sh.Peek(clock.now(), ls, out[:])
			other := out[0].Remaining
			if !sh.Take(clock.now(), ls, other, out[:]) {
				t.Fatalf("another node's take of %d: %+v", other, out[0])
			}
			m.mu.Unlock()
			spent += other
			calls := m.calls
			if tt.cost == 1 {
				// Under half the lease, the node prefetches: refused.
				for m.calls == calls && held() > 0 {
					take(1)
				}
			} else {
				take(1)
				for held() > 1 {
					take(1)
				}
				if res := take(2); res.Allowed {
					t.Fatalf("a request of cost 2 on 1 token held, the shared bucket empty: %+v", res)
				}
			}
			if m.calls == calls {
				t.Fatal("no call was refused")
			}
			h := held()
			node.close() // a reload; lease_ttl's sweep gives back the same way
			clock.advance(10 * time.Second)
			level := m.level("k", l)
			t.Logf("spent %d; the node held %d after its refused call; after the give-back the shared bucket holds %d", spent, h, level)
			if spent+level != l.Capacity {
				t.Errorf("spent %d + in the shared bucket %d = %d, want the capacity %d: the %d tokens the node held were lost", spent, level, spent+level, l.Capacity, l.Capacity-spent-level)
			}
		})
	}
}

// The lease table is bounded by deny_cache_size entries, the channels of
// the give-backs of evicted entries included: an evicted entry's give-back
// leaves a channel for the key's next entry to wait on, which must not
// outlive the give-back until the next sweep. A flood of distinct keys,
// each seen twice (its second lease holds a token), through a table of 64
// entries with lease_ttl 1m (a sweep every 15 s).
func TestEvictionsLeaveNoAnsweredGiveBacksBehind(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	l := bucket.Limit{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 1000}}
	node := newLeaseTable(m, m.now, LeaseSize{tokens: 10}, time.Minute, 100*time.Millisecond, leaseShards, nopLogger)
	defer node.close()
	const keys = 20_000
	for i := range keys {
		key := []byte{'k', byte(i), byte(i >> 8), byte(i >> 16)}
		for range 2 {
			if res, err := node.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
				t.Fatalf("key %d: %+v %v", i, res, err)
			}
		}
		if i%1000 == 0 {
			tableSync(node)
		}
	}
	tableSync(node)
	entries, returning := 0, 0
	for i := range node.shards {
		sh := &node.shards[i]
		sh.mu.Lock()
		entries += len(sh.m)
		returning += len(sh.returning)
		sh.mu.Unlock()
	}
	t.Logf("%d keys through a table of %d entries: %d entries, %d give-back channels kept (every give-back answered)", keys, leaseShards, entries, returning)
	if entries+returning > 2*leaseShards {
		t.Errorf("the table of %d entries holds %d entries and %d channels of give-backs already answered", leaseShards, entries, returning)
	}
}

// No goroutine or timer leak after close: a config's lease table stops with
// the config. A pending hold-off's timer (the root's store sets after to
// time.AfterFunc) does not keep the closed table, every entry of its
// shards, until it fires, up to the refused call's Retry-After (an hour
// for a limit of 1/h): the table is collected at once, as it is with no
// hold-off pending (the control).
func TestAClosedLeaseTableIsNotHeldByItsHoldOffTimer(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}} // 100 1/h
	for _, tt := range []struct {
		name    string
		holdOff bool
	}{{"no hold-off (control)", false}, {"a hold-off pending", true}} {
		t.Run(tt.name, func(t *testing.T) {
			srv.Do("FLUSHALL")
			plan, err := NewPlan(Options{Addresses: []string{srv.URL()}, Timeout: 500 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			conn := plan.Connect(nopLogger)
			defer conn.Close()
			s := NewStore(conn, StoreOptions{Lease: LeaseSize{tokens: 10}})
			b := bucketFor("held-by-its-timer")
			requests := 5
			if tt.holdOff {
				requests = 200
			}
			refused := 0
			for range requests {
				res, err := s.takeLimit(bg, b, l, 1)
				if err != nil {
					t.Fatal(err)
				}
				if !res.Allowed {
					refused++
				}
			}
			if tt.holdOff && refused == 0 {
				t.Fatal("no request refused: no hold-off")
			}
			table := weak.Make(s.leases)
			s.Close()
			s.leases = nil
			// A lease call in flight at Close may hold the table until it
			// answers, within the 500 ms timeout; an hour's timer holds it
			// longer.
			collected := false
			for deadline := time.Now().Add(1500 * time.Millisecond); time.Now().Before(deadline); {
				runtime.GC()
				if table.Value() == nil {
					collected = true
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if !collected {
				t.Errorf("the lease table closed by Cleanup is still reachable after GC (%d requests refused, a hold-off of up to an hour pending)", refused)
			}
		})
	}
}

// With leases, a waiter's give-back does not go into the node's lease: its
// tokens came from the shared bucket, where the queue keeps their deficit.
// The next request waits its turn as in strict mode (one bucket, the same
// history), not admitted at once; the origin never sees two of a client's
// requests closer than the rate allows after a hang-up.
func TestAWaitersGiveBackWithLeasesWaitsItsTurnAsInStrictMode(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	// capacity 10, 10/s, max_wait 1s; leases of 50%.
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	ls := []bucket.Limit{l}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	key := []byte("lease")
	strict := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	take := func(what string) (lease, one bucket.Result) {
		t.Helper()
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		var out [1]bucket.Result
		strict.Take(clock.now(), ls, 1, out[:])
		return res, out[0]
	}
	// 20 at once: 10 now, 10 waiting up to 1 s, in both modes.
	var waits []int64
	for i := range 20 {
		res, one := take("burst")
		if !res.Allowed || !one.Allowed {
			t.Fatalf("request %d of the burst: leases %+v, one bucket %+v; want both allowed", i, res, one)
		}
		waits = append(waits, res.Wait)
	}
	// At 250 ms, the 5 last waiters hang up: 5 tokens back.
	clock.advance(250 * time.Millisecond)
	rest := node.giveBackHeld(key, 5)
	m.mu.Lock()
	m.bucket(string(key), 1).GiveBack(clock.now(), ls, rest)
	m.mu.Unlock()
	strict.GiveBack(clock.now(), ls, 5)
	// At 300 ms, the next request: one bucket makes it wait its turn
	// behind the 5 waiters left.
	clock.advance(50 * time.Millisecond)
	res, one := take("after")
	t.Logf("burst waits %v; given back into the lease %d of 5", waits, 5-rest)
	if !one.Allowed || one.Wait == 0 {
		t.Fatalf("one bucket: %+v; want allowed, waiting", one)
	}
	if res.Allowed && res.Wait < one.Wait {
		t.Fatalf("leases admit the request after the give-back waiting %d µs, one bucket (strict mode) makes it wait %d µs: the give-back went into the node's lease, spendable at once, while the queue's deficit stays in the shared bucket", res.Wait, one.Wait)
	}
}

// TestAWaitersGiveBackWithLeasesWaitsItsTurnAsInStrictMode on a real
// redis-server through Store: after a burst that queued waiters in the
// shared bucket, 5 tokens given back (5 waiters hung up) let none of the
// next requests through at once, the shared bucket's level being still
// below zero.
func TestAWaitersGiveBackWithLeasesOnRedisAdmitsNothingAtOnce(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: "50%"})
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	key := bucketFor("lease-redis")
	waiting := 0
	for i := range 20 {
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d of the burst: %+v, %v; want allowed", i, res, err)
		}
		if res.Wait > 0 {
			waiting++
		}
	}
	if waiting < 5 {
		t.Fatalf("%d of the burst wait; want at least 5", waiting)
	}
	// 5 waiters hang up.
	if err := s.GiveBack(bg, key, oneLimit(l), 5, 5, 0); err != nil {
		t.Fatal(err)
	}
	// The shared bucket still lacks tokens: one bucket would make every
	// next request wait.
	var out [1]bucket.Result
	if _, _, err := s.decideAt(bg, "peek", string(key), bucket.Tier{Limits: []bucket.Limit{l}}, 0, out[:], false); err != nil {
		t.Fatal(err)
	}
	atOnce := 0
	for range 5 {
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed && res.Wait == 0 {
			atOnce++
		}
	}
	if atOnce > 0 {
		t.Fatalf("after the give-back, %d of 5 requests were admitted at once although the shared bucket holds nothing now (peek %+v) and %d requests wait in it: the give-back went into this node's lease", atOnce, out[0], waiting-5)
	}
}

// A count_status give-back goes into the node's lease only if the request
// was taken in that lease's quota period. The old period's tokens stay
// spendable while the call that brings the new period's is out; a request
// that spends one of them then, and gives it back after the answer, gives
// it to the shared bucket and the old period, not to the lease, which now
// holds tokens the new period counted: quota 20/day admits at most 20 in
// the new day.
func TestAGiveBackOfTheOldPeriodDoesNotGoIntoTheNewPeriodsLease(t *testing.T) {
	t.Parallel()
	// Room enough that a lease's half-of-what-is-left bound does not bite.
	day := bucket.Quota{N: 20, Period: bucket.Day, Loc: time.UTC}
	_, midnight := day.Bounds(time.Date(2026, 5, 4, 12, 0, 0, 0, time.UTC).UnixMicro())
	clock := new(fakeClock)
	clock.micros.Store(midnight - 10*second)
	m := newSharedModel(clock.now)
	tb := newModelTable(m, LeaseSize{tokens: 4}, time.Hour)
	defer tb.close()
	s := &Store{leases: tb}
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	qs := []bucket.Quota{day}
	key := []byte("k")
	take := func(sync bool) bool {
		t.Helper()
		out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
		ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout)
		if err != nil {
			t.Fatal(err)
		}
		if sync {
			tableSync(tb)
		}
		return ok
	}
	// Yesterday: leases of 1, 2, then a prefetch of 4.
	for i := range 3 {
		if !take(true) {
			t.Fatalf("yesterday's request %d refused", i+1)
		}
	}
	if e := tb.snapshot(key); e.tokens != 4 || e.size != 4 {
		t.Fatalf("set-up: the node holds %d (lease size %d); want 4 of 4", e.tokens, e.size)
	}
	// Two more, then the one that brings the lease to half starts a
	// prefetch, which is slow: it reaches Redis after midnight.
	take(true)
	take(true)
	m.gate = make(chan struct{})
	if !take(false) {
		t.Fatal("the request that starts the prefetch was refused")
	}
	if e := tb.snapshot(key); e.tokens != 1 || e.call == nil {
		t.Fatalf("set-up: the node holds %d with a call in flight %v; want 1 and true", e.tokens, e.call != nil)
	}
	// 1 ms before midnight, while the call is out: the last of
	// yesterday's tokens is spent, by a request the origin will answer
	// with a status that does not count.
	clock.micros.Store(midnight - 1000)
	took := clock.now()
	if !take(false) {
		t.Fatal("yesterday's last token refused")
	}
	// The call reaches Redis after midnight: a lease of today's tokens.
	clock.micros.Store(midnight + 1000)
	close(m.gate)
	tableSync(tb)
	m.gate = nil

	today := 0
	if take(true) {
		today++
	}
	// The give-back of yesterday's request, as Store.fromLease makes it;
	// what the lease does not take goes to the shared bucket, to the
	// quota only in the period it was counted in.
	if left := tb.giveBackHeldSince(key, 1, took); left > 0 {
		m.mu.Lock()
		sh := m.states[string(key)]
		sh.GiveBack(clock.now(), ls, left)
		sh.GiveBackQuotas(clock.now(), took, qs, left)
		m.mu.Unlock()
	}
	for range 40 {
		clock.advance(time.Millisecond)
		if take(true) {
			today++
		}
	}
	if today > int(day.N) {
		t.Errorf("today admitted %d requests; quota %d/day admits at most %d (yesterday's give-back went into today's lease)", today, day.N, day.N)
	}
}

// A lease record written before quotas (no :qstop:mask) parses, and its
// give-back returns tokens to the limits only.
func TestALeaseRecordWithoutQuotaFieldsParses(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	key := string(bucketFor("old-record"))
	ls := []bucket.Limit{{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}}
	qs := []bucket.Quota{{N: 100, Period: bucket.Day, Loc: time.UTC}}
	// Build a record by the script, then strip its quota fields.
	lr, now, err := s.leaseAt(bg, key, bucket.Tier{Limits: ls, Quotas: qs}, bucket.LeaseAsk{Node: "n1", Seq: 1, Cost: 1, Want: 4, Hold: 60 * second}, nil)
	if err != nil || lr.Granted != 4 {
		t.Fatalf("lease: %+v %v", lr, err)
	}
	v := srv.Do("GET", key).(string)
	var old string
	for i, seg := range strings.Split(v, ";") {
		if i > 0 {
			old += ";"
		}
		if len(seg) > 2 && seg[:2] == "l:" {
			var node string
			var tok, exp, seq, void int64
			var qstop, mask int64
			if _, err := fmt.Sscanf(strings.ReplaceAll(seg[2:], ":", " "), "%s %d %d %d %d %d %d", &node, &tok, &exp, &seq, &void, &qstop, &mask); err != nil {
				t.Fatalf("record %q: %v", seg, err)
			}
			seg = fmt.Sprintf("l:%s:%d:%d:%d:%d", node, tok, exp, seq, void)
		}
		old += seg
	}
	srv.Do("SET", key, old, "PX", 60000)
	_ = now
	n, err := s.giveBack("n1", []leaseReturn{{key: key, tier: bucket.Tier{Limits: ls, Quotas: qs}, tokens: 4, seq: 1, done: make(chan struct{})}})
	if err != nil || n != 4 {
		t.Errorf("give-back of an old record: %d %v; want 4 returned", n, err)
	}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	if err := s.peekQuotas(bg, []byte(key), ls, qs, out, qout); err != nil {
		t.Fatal(err)
	}
	if out[0].Remaining != 10 || qout[0].Remaining != 96 {
		t.Errorf("after: limit %d, quota %d; want 10 and 96 (an old record's tokens do not go back to the quota)", out[0].Remaining, qout[0].Remaining)
	}
}

// A client whose requests on one node come a lease_ttl apart (a login
// form's attempts): each request finds its lease just past lease_ttl, whose
// unused tokens go back in the background, while the request's own lease
// call, sent at once with Held 0, may reach Redis first. The tokens are
// not lost and no ban starts: rate_limit 5 1/h, ban 15m, lease 50%
// allows all five attempts, as one bucket does. The
// node's clock is injected (requests 1 s apart); Redis's is real, so no
// record expires meanwhile.
func TestRequestsALeaseTTLApartKeepTheirTokensAndAreNotBanned(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}, Ban: 15 * 60 * second}
	for round := range 3 {
		s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Lease: "50%"})
		clock := new(fakeClock)
		clock.micros.Store(1_000_000)
		s.leases.close()
		s.leases = newLeaseTable(s, clock.now, LeaseSize{percent: 50}, time.Second, 100*time.Millisecond, 1000, nopLogger)
		b := bucketFor("spaced-" + string(rune('a'+round)))
		var got strings.Builder
		for range 5 {
			res, err := s.takeLimit(bg, b, l, 1)
			if err != nil {
				t.Fatal(err)
			}
			s.leases.calls.Wait()
			switch {
			case res.Allowed:
				got.WriteString("allowed ")
			case res.Banned:
				got.WriteString("BANNED ")
			default:
				got.WriteString("refused ")
			}
			clock.advance(time.Second)
		}
		s.leases.close()
		if got.String() != strings.Repeat("allowed ", 5) {
			t.Errorf("round %d: 5 attempts 1 s apart (lease_ttl 1s) on a limit of 5 an hour: %s; one bucket allows all 5", round, got.String())
		}
	}
}

// A table closed by a reload while requests still run through it starts no
// eviction, give-back or lease after close returns (it used to call
// WaitGroup.Add beside Wait and give back on a closed client), and a
// count_status give-back that reaches it goes to the shared bucket.
func TestClosedLeaseTableStartsNothingAndPassesGiveBacksOn(t *testing.T) {
	t.Parallel()
	m := newSharedModel(monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1 << 20, Interval: 1}}
	rounds := 20
	if testing.Short() {
		rounds = 4
	}
	for range rounds {
		node := newLeaseTable(m, m.now, LeaseSize{percent: 10}, time.Second, time.Second, leaseShards, nopLogger)
		var takes atomic.Int64
		stop := make(chan struct{})
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				node.take(bg, []byte{byte(i), byte(i >> 8)}, oneLimit(l), 1, nil)
				takes.Add(1)
			}
		}()
		redistest.WaitFor(t, 5*time.Second, "requests through the table", func() bool { return takes.Load() > 100 })
		node.close()
		m.mu.Lock()
		calls := m.calls
		m.mu.Unlock()
		closedAt := takes.Load()
		redistest.WaitFor(t, 5*time.Second, "requests after close", func() bool { return takes.Load() > closedAt+100 })
		close(stop)
		<-finished
		m.mu.Lock()
		after := m.calls
		m.mu.Unlock()
		if after != calls {
			t.Fatalf("%d lease calls after close returned", after-calls)
		}
		if rest := node.giveBackHeld([]byte{0, 0}, 3); rest != 3 {
			t.Fatalf("a give-back to a closed table kept %d of 3, want none: they go to the shared bucket", 3-rest)
		}
	}
}

// Tokens leased and unused go back after lease_ttl, and all of them when
// the table closes (a reload or shutdown).
func TestUnusedLeasedTokensGoBack(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}} // no refill to speak of
	level := func() int64 { return m.level("k", l) }
	node := newModelTable(m, LeaseSize{tokens: 40}, time.Second)
	for range 20 {
		node.take(bg, []byte("k"), oneLimit(l), 1, nil)
		tableSync(node)
	}
	held := node.shard([]byte("k")).m["k"].tokens
	if got := level() + held + 20; got != 100 {
		t.Fatalf("shared %d + held %d + spent 20 = %d, want 100", level(), held, got)
	}
	clock.advance(time.Second)
	if back := node.sweep(clock.now(), false); len(back) != 1 {
		t.Fatalf("sweep after lease_ttl gave back %v", back)
	} else {
		node.giveBackNow(back)
	}
	if level() != 80 {
		t.Errorf("after lease_ttl the shared bucket holds %d, want 80", level())
	}
	node.take(bg, []byte("k"), oneLimit(l), 1, nil)
	tableSync(node)
	node.close()
	if level() != 79 {
		t.Errorf("after close the shared bucket holds %d, want 79", level())
	}
}

// A request still in flight through an unloaded config finds its lease
// table closed: it starts no lease call, whose tokens no one would give
// back, and the store decides it in strict mode.
func TestClosedLeaseTableStartsNoCall(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	m := newSharedModel(clock.now)
	node := newModelTable(m, LeaseSize{percent: 10}, time.Second)
	node.close()
	_, err := node.take(bg, []byte("k"), oneLimit(bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}), 1, nil)
	if !errors.Is(err, errLeasesClosed) || m.calls != 0 {
		t.Errorf("take after close: %v with %d calls; want errLeasesClosed and none", err, m.calls)
	}
}

// A request's tokens given back while a renewal of the lease is out are
// not lost: those it took before the renewal was sent, which the renewal
// no longer names, go to the shared bucket rather than into the lease,
// whose answer keeps only what it named. Every token is in the lease, on
// its way to the shared bucket, or spent.
// Regression test for issue 34 (a renewal racing a give-back).
func TestAGiveBackWhileARenewalIsOutLosesNoToken(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	var granted int64
	m.onAsk = func(_ bucket.LeaseAsk, _ *buckettest.Shared, lr bucket.LeaseResult) { granted = lr.Granted }
	ttl := time.Second
	node := newLeaseTable(m, m.now, LeaseSize{tokens: 1000}, ttl, 100*time.Millisecond, 1000, nopLogger)
	defer node.close()
	l := bucket.Limit{Capacity: 10_000, Rate: bucket.Rate{Tokens: 1000, Interval: 1_000_000}}
	key := []byte("k")
	take := func() {
		t.Helper()
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		if err != nil || !res.Allowed {
			t.Fatalf("a request under the limit: %+v, %v", res, err)
		}
	}
	for node.snapshot(key).size < 64 {
		take()
		tableSync(node)
		clock.advance(10 * time.Millisecond)
	}
	e := node.snapshot(key)
	clock.micros.Store(e.renewAt - 1)
	take() // a request the renewal will not name
	tableSync(node)
	if got := node.snapshot(key); got.call != nil || got.renewAt != e.renewAt {
		t.Fatalf("the request before the renewal made a call: %+v", got)
	}
	gate := make(chan struct{})
	m.mu.Lock()
	m.gate = gate
	m.mu.Unlock()
	clock.micros.Store(e.renewAt)
	take() // the renewal, held at the gate
	held := node.snapshot(key).tokens
	if node.snapshot(key).call == nil {
		t.Fatal("no renewal out")
	}
	// The first request's give-back (count_status), while the renewal is out.
	left := node.giveBackHeld(key, 1)
	close(gate)
	tableSync(node)
	after := node.snapshot(key).tokens
	if after+left != held+granted+1 {
		t.Errorf("after the renewal (%d granted beside %d held): the lease holds %d and %d went to the shared bucket; want %d in all, the given-back token too",
			granted, held, after, left, held+granted+1)
	}
}

// answeredThenHeld is the shared model whose lease answers, once gate is
// set, are computed at once, as Redis would on the call's arrival, and
// then held until gate closes, as a slow link back would hold them: a call
// answered by a bucket that a reset deleted before the answer came back.
type answeredThenHeld struct {
	*sharedModel
	answered chan struct{}
	gate     atomic.Pointer[chan struct{}]
}

func (r *answeredThenHeld) lease(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error) {
	lr, err := r.sharedModel.lease(ctx, key, tr, a, each)
	if gate := r.gate.Load(); gate != nil {
		r.answered <- struct{}{}
		<-*gate
	}
	return lr, err
}

// An admin reset while a lease call is out: the call's answer came from
// the bucket the reset deleted, and refused. It must not hold the node's
// next requests off: the fresh bucket admits them, as one bucket would
// after a reset.
// Regression test for issue 34's review (a reset during a lease call).
func TestAResetWhileALeaseCallIsOutLetsTheNextRequestsThrough(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	remote := &answeredThenHeld{sharedModel: m, answered: make(chan struct{}, 1)}
	node := newLeaseTable(remote, m.now, LeaseSize{tokens: 2}, time.Minute, time.Second, 1000, nopLogger)
	defer node.close()
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	key := []byte("k")
	for i := 0; takeSynced(t, node, key, l).Allowed; i++ {
		if i > 8 {
			t.Fatalf("%d requests on a bucket of 4 all allowed", i+1)
		}
	}
	// Emptied and held off. Let the hold-off pass with the bucket still
	// empty, so that the next request calls again and is refused; hold
	// that answer back.
	clock.advance(time.Hour)
	m.mu.Lock()
	m.states[string(key)].Levels[0] = bucket.State{FullAt: clock.now() + 4*3_600_000_000}
	m.mu.Unlock()
	admitted := 0
	if resetDuringCall(t, remote, node, key, l).Allowed {
		admitted++
	}
	tableSync(node)
	for range 5 {
		if takeSynced(t, node, key, l).Allowed {
			admitted++
		}
	}
	if admitted != 4 {
		t.Fatalf("the request whose call was out at the reset and 5 after it: %d allowed; want 4, the fresh bucket's", admitted)
	}
}

// A request whose lease call was granted while an admin reset came is
// admitted with a remaining count a bucket of its capacity can report,
// not the void answer's unbounded level.
func TestARequestGrantedAcrossAResetReportsNoMoreThanTheCapacity(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	remote := &answeredThenHeld{sharedModel: m, answered: make(chan struct{}, 1)}
	node := newLeaseTable(remote, m.now, LeaseSize{tokens: 2}, time.Minute, time.Second, 1000, nopLogger)
	defer node.close()
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	key := []byte("k")
	res := resetDuringCall(t, remote, node, key, l)
	if !res.Allowed || res.Remaining < 0 || res.Remaining > l.Capacity-1 {
		t.Fatalf("granted across the reset: allowed %v, remaining %d; want allowed with 0 to %d remaining", res.Allowed, res.Remaining, l.Capacity-1)
	}
}

// A peek (the admin API's read) while this node's lease call is out would
// see the shared level after the call's grant and the node's tokens
// before it: it waits for the call, so that what it reports after each
// request of one client is the bucket's, exactly. The link is 20 ms each
// way, so that a prefetch is out right after most requests.
// Regression test for TestAdminRetryAfterSaysWhetherTheNextRequestPassesInEveryStoreMode
// reading 0 remaining while the node's prefetch was out.
func TestAPeekDuringALeaseCallCountsItsGrant(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 20*time.Millisecond)
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 2 * time.Second, Lease: "50%"})
	tr := oneLimit(slowLimit(10))
	key := bucketFor("peeked")
	for n := int64(1); n <= 10; n++ {
		out := make([]bucket.Result, 1)
		if ok, err := s.Take(bg, key, tr, 1, out); err != nil || !ok {
			t.Fatalf("request %d: %v, %v", n, ok, err)
		}
		if err := s.Peek(bg, key, tr, out); err != nil {
			t.Fatal(err)
		}
		if out[0].Remaining != 10-n {
			t.Fatalf("after request %d: the peek read %d remaining; want %d", n, out[0].Remaining, 10-n)
		}
	}
}

// resetDuringCall sends a request for key on the lone limit l to node,
// whose lease call remote answers at once and holds back; meanwhile an
// admin reset empties node's entry, then deletes the shared bucket (the
// DEL). It returns the request's result once the answer came back.
func resetDuringCall(t *testing.T, remote *answeredThenHeld, node *leaseTable, key []byte, l bucket.Limit) bucket.Result {
	t.Helper()
	gate := make(chan struct{})
	remote.gate.Store(&gate)
	done := takeLater(t, node, key, oneLimit(l))
	<-remote.answered
	node.reset(key)
	remote.mu.Lock()
	delete(remote.states, string(key))
	remote.mu.Unlock()
	remote.gate.Store(nil)
	close(gate)
	return <-done
}
