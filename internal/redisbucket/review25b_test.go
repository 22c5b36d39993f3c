package redisbucket

import (
	"fmt"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Adversarial review of issue 25 (leases over every limit and quota of a
// tier). Tests named ...Defect... FAIL on the code under review; the
// others probe and pass.

// review25bEntry reads, under its shard's lock, what node holds of key.
func review25bEntry(tb *leaseTable, key []byte) (tokens, size int64, inFlight bool) {
	sh := tb.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.m[string(key)]
	if e == nil {
		return 0, 0, false
	}
	return e.tokens, e.size, e.call != nil
}

// FAILS. Breaks claim 2 ("a count_status give-back goes into the node's
// lease only if the request was taken in that lease's period") and so
// claim 1 ("over-admission stays 0 on every quota period").
//
// Mechanism: lease_call.go periodOf (lease_call.go:148-158) marks the new
// quota period as starting at periodFrom = sent, the moment the call that
// brought the new period's tokens was SENT. But the old period's tokens
// stay spendable while that call is out (lease.go takeHeld, lease.go:354:
// e.tokens >= cost && !lapsed, with a prefetch in flight), up to spendBy,
// the old period's end. A request that spends one of them after the call
// was sent has took >= periodFrom, so giveBackHeldSince
// (lease_return.go:51) puts its count_status give-back into the lease,
// which now holds tokens the NEW period's quota counted: the new period
// then admits that token on top of its n. Here quota 10/day: the new day
// admits 11.
//
// Fix: start the period at the answer, not the send: periodFrom = t.now()
// when apply records a grant of a new period (the old period's tokens are
// dropped then, lr.Drop, so none is spent after it); or keep, per request,
// which lease period it spent from.
func TestReview25bDefectOldPeriodsGiveBackGoesIntoTheNewPeriodsLease(t *testing.T) {
	// Room enough that a lease's half-of-what-is-left bound does not bite.
	day := bucket.Quota{N: 20, Period: bucket.Day, Loc: time.UTC}
	_, midnight := day.Bounds(time.Date(2026, 5, 4, 12, 0, 0, 0, time.UTC).UnixMicro())
	clock := new(fakeClock)
	clock.micros.Store(midnight - 10*second)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
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
	if tok, size, _ := review25bEntry(tb, key); tok != 4 || size != 4 {
		t.Fatalf("set-up: the node holds %d (lease size %d); want 4 of 4", tok, size)
	}
	// Two more, then the one that brings the lease to half starts a
	// prefetch, which is slow: it reaches Redis after midnight.
	take(true)
	take(true)
	m.gate = make(chan struct{})
	if !take(false) {
		t.Fatal("the request that starts the prefetch was refused")
	}
	if tok, _, inFlight := review25bEntry(tb, key); tok != 1 || !inFlight {
		t.Fatalf("set-up: the node holds %d with a call in flight %v; want 1 and true", tok, inFlight)
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

// The skewed node's give-back (claims 1 and 3): in review24_test.go,
// TestReview24RedisGiveBackAfterTheBoundaryDoesNotRefundTheNewDay.

// FAILS. Breaks claim 4 ("the deny cache serves tiers of several limits;
// a refused client costs no Redis call until its retry time") and DESIGN
// section 5 ("a denial is remembered locally until its retry time ... a
// flood from one client then costs Redis nothing") for a tier with a
// quota, in strict mode.
//
// Mechanism: Store.TakeQuotas (quota.go:46-53) goes straight to
// s.takeQuotas, a script call, with no deny cache lookup or put (compare
// takeAllStrict, store.go:194-211); so does Store.reserve for a tier with
// quotas (store.go:251-255), the path of a max_wait request with leases.
// A client that used its monthly quota costs Redis one call per request
// for the rest of the month.
//
// Fix: route TakeQuotas through the deny cache as takeAllStrict does
// (getAll/putAll over the limits' and quotas' results, the worst retry
// being the period's end), and drop the entry on GiveBackQuotas (already
// done there).
func TestReview25bDefectRedisDenyCacheServesTiersWithQuotas(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 2 * time.Second})
	ls := []bucket.Limit{
		{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}},
		{Capacity: 1000, Rate: bucket.Rate{Tokens: 1, Interval: 60_000_000}},
	}
	qs := []bucket.Quota{{N: 2, Period: bucket.Month, Loc: time.UTC}}
	key := bucketFor("review25b-deny-quota")
	out, qout := make([]bucket.Result, 2), make([]bucket.Result, 1)
	for range 2 {
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || ok || qout[0].RetryAfter <= 0 {
		t.Fatalf("the third: %v %v %+v; want refused by the quota", ok, err, qout[0])
	}
	srv.Do("CONFIG", "RESETSTAT")
	for range 100 {
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || ok {
			t.Fatalf("the flood: %v %v", ok, err)
		}
	}
	if n := evalCalls(t, srv); n != 0 {
		t.Errorf("100 requests refused by the monthly quota made %d script calls, want 0 (the deny cache, until the month ends)", n)
	}
}

// FAILS. Breaks claim 7's spirit and DESIGN section 13 ("a reload that
// changes n keeps the count"; a quota starts over only at its boundary)
// for a reload that ADDS a quota while a request is at the origin.
//
// Mechanism: the script keeps only the counts of the quotas a call names
// (script.go:129-135: a "q<p>:..." segment that matches no quota of the
// call is not kept, and save rewrites the key without it). A request
// decided under the old config settles under it: settle.go giveBackTaken
// (settle.go:156-161) and chargeFromResponse (settle.go:125-136) pass
// d.tier.quotas, the OLD tier's, and sameLimitsRun (settle.go:189-202)
// compares only the limits. Its give-back (or charge) after the reload
// names the day quota only, and the script drops the month quota's count
// that the new config has been keeping: the month starts over mid-month.
// (The old config's lease table, still sweeping with e.tier until
// Cleanup, does the same with its "return" calls.)
//
// Fix: keep, in the script, the count segments of quotas a call does not
// name (as it keeps limits' segments in extra), until their period ends;
// and/or compare quotas too in sameLimitsRun and settle with the running
// tier's quotas.
func TestReview25bDefectRedisGiveBackNamingFewerQuotasKeepsTheOthersCount(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	s.clockOffset = time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	key := bucketFor("review25b-fewer-quotas")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out := make([]bucket.Result, 1)
	// A request under the old config (day quota only) is at the origin.
	if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day}, 1, out, make([]bucket.Result, 1)); err != nil || !ok {
		t.Fatal(ok, err)
	}
	taken := time.Now().UnixMicro() + s.clockOffset
	// The reload adds the month quota; the new config admits 5.
	qout := make([]bucket.Result, 2)
	for range 5 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day, month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	// The old request's response does not count: its give-back names the
	// old tier's quotas.
	if err := s.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: []bucket.Quota{day}}, 1, 1, taken); err != nil {
		t.Fatal(err)
	}
	if err := s.peekQuotas(bg, key, ls, []bucket.Quota{day, month}, out, qout); err != nil {
		t.Fatal(err)
	}
	if qout[1].Remaining != 995 {
		t.Errorf("the month quota after an old request's give-back: %d left, want 995 (5 counted since the reload): its count was dropped", qout[1].Remaining)
	}
	if qout[0].Remaining != 45 {
		t.Errorf("the day quota: %d left, want 45", qout[0].Remaining)
	}
}

// Probe (passes): a lease record written before quotas (no ":qstop:mask")
// parses, and its give-back returns tokens to the limits only.
func TestReview25bRedisOldLeaseRecordWithoutQuotaFieldsParses(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	key := string(bucketFor("review25b-old-record"))
	ls := []bucket.Limit{{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}}
	qs := []bucket.Quota{{N: 100, Period: bucket.Day, Loc: time.UTC}}
	// Build a record by the script, then strip its quota fields.
	lr, now, err := s.leaseAt(key, bucket.Tier{Limits: ls, Quotas: qs}, bucket.LeaseAsk{Node: "n1", Seq: 1, Cost: 1, Want: 4, Hold: 60 * second}, nil)
	if err != nil || lr.Granted != 4 {
		t.Fatalf("lease: %+v %v", lr, err)
	}
	v := srv.Do("GET", key).(string)
	var old string
	for i, seg := range splitSegs(v) {
		if i > 0 {
			old += ";"
		}
		if len(seg) > 2 && seg[:2] == "l:" {
			var node string
			var tok, exp, seq, void int64
			var qstop, mask int64
			if _, err := fmt.Sscanf(replaceColons(seg[2:]), "%s %d %d %d %d %d %d", &node, &tok, &exp, &seq, &void, &qstop, &mask); err != nil {
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

func splitSegs(v string) []string {
	var segs []string
	start := 0
	for i := range len(v) {
		if v[i] == ';' {
			segs = append(segs, v[start:i])
			start = i + 1
		}
	}
	return append(segs, v[start:])
}

func replaceColons(s string) string {
	b := []byte(s)
	for i := range b {
		if b[i] == ':' {
			b[i] = ' '
		}
	}
	return string(b)
}
