package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// cost_from_response with leases (issue 25): every allowed request is
// charged a reported cost after it, taken from the node's lease when it
// covers it, else from the shared bucket: no token is made or lost.
func TestLeasingNodesConserveEveryTokenWithCharges(t *testing.T) {
	t.Parallel()
	if _, charged := conserveTokens(t, 5000, 5); charged == 0 {
		t.Error("nothing was charged")
	}
}

// A charge the lease covers makes no call; one it does not is charged to
// the shared bucket, into debt: the client is refused until it refilled.
func TestLeaseChargeSpendsTheLeaseThenChargesTheSharedBucket(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}} // 20, 1/s
	tb := newModelTable(m, LeaseSize{tokens: 10}, time.Hour)
	defer tb.close()
	key := []byte("charge-me")
	// A few requests, so that the leases grow (they double from the cost).
	for range 4 {
		if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
			t.Fatal(res, err)
		}
		tableSync(tb)
	}
	sh := tb.shard(key)
	sh.mu.Lock()
	e := sh.m[string(key)]
	held, leased := e.tokens, e.recorded
	sh.mu.Unlock()
	if held < 1 {
		t.Fatalf("the node holds %d after its first lease", held)
	}
	calls := m.calls
	// A charge the held tokens cover comes from them, with no call.
	if rest := tb.chargeHeld(key, held); rest != 0 || m.calls != calls {
		t.Fatalf("a charge of %d against %d held: %d left over, %d calls; want 0 and none", held, held, rest, m.calls-calls)
	}
	// Nothing held: a charge of 30 goes to the shared bucket, which lent
	// the node its lease and now owes 30 - (20 - leased).
	rest := tb.chargeHeld(key, 30)
	if rest != 30 {
		t.Fatalf("a charge of 30 with nothing held: %d left over, want 30", rest)
	}
	level := m.level(string(key), l)
	m.mu.Lock()
	m.bucket(string(key), 1).Charge(clock.now(), []bucket.Limit{l}, rest)
	var out [1]bucket.Result
	allowed := m.bucket(string(key), 1).Take(clock.now(), []bucket.Limit{l}, 1, out[:])
	m.mu.Unlock()
	if want := (30 - level + 1) * 1_000_000; allowed || out[0].RetryAfter != want {
		t.Fatalf("after a charge of 30 on %d left (%d leased): %+v; want refused until the debt and one more token refill: %d µs", level, leased, out[0], want)
	}
}

// cost_from_response with leases on a tier of two limits and a quota, on
// two nodes: each request takes from both limits and the quota at once,
// and each charge from the node's lease or, beyond it, from all three in
// Redis; no token of any is made or lost.
func TestLeasingNodesConserveEveryTokenOfATier(t *testing.T) {
	t.Parallel()
	hour := bucket.Rate{Tokens: 1, Interval: 3_600_000_000}
	tr := bucket.Tier{
		Limits: []bucket.Limit{{Capacity: 5000, Rate: hour}, {Capacity: 8000, Rate: hour}},
		Quotas: []bucket.Quota{{N: 9000, Period: bucket.Month, Loc: time.UTC}},
	}
	if allowed, charged := conserveTier(t, tr, 5); allowed != 320 || charged == 0 {
		t.Errorf("%d allowed of 320 under every limit, %d charged; want all, and some charged", allowed, charged)
	}
}
