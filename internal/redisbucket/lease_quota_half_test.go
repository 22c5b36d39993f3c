package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// TestNoLeasedTokenIsLostWhenALeaseFallsToHalfJustBeforeItsQuotaPeriodEnds:
// a node 100 ms from the store whose lease falls under half in the last
// two round trips before midnight, when the quota period that counted its
// tokens ends, does not prefetch then either: the call would land after
// midnight and have the store drop what the node holds, which the limit
// never gets back. Every token the limit lent is admitted or given back.
func TestNoLeasedTokenIsLostWhenALeaseFallsToHalfJustBeforeItsQuotaPeriodEnds(t *testing.T) {
	t.Parallel()
	l := slowLimit(200)
	tr := bucket.Tier{
		Limits: []bucket.Limit{l},
		Quotas: []bucket.Quota{{N: 100_000, Period: bucket.Day, Loc: time.UTC}},
	}
	clock, m := newModelStore()
	_, midnight := tr.Quotas[0].Bounds(clock.now())
	clock.micros.Store(midnight - 5*second)
	node := newLeaseTable(measuredRemote{m, 100_000}, m.now, LeaseSize{tokens: 40}, 10*time.Second, time.Second, 1000, nopLogger)
	node.jitter = func(int64) int64 { return 0 }
	key := []byte("k")
	var admitted int64
	take := func() {
		t.Helper()
		res, err := node.take(bg, key, tr, 1, nil)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed {
			admitted++
		}
		tableSync(node)
	}
	for node.snapshot(key).size < 40 {
		take()
		clock.advance(10 * time.Millisecond)
	}
	// Spend down to half the lease, which starts no prefetch yet.
	for e := node.snapshot(key); e.tokens*2 > e.size; e = node.snapshot(key) {
		take()
	}
	clock.micros.Store(midnight - 150_000)
	if e := node.snapshot(key); e.tokens*2 != e.size || e.call != nil || e.spendBy != midnight {
		t.Fatalf("setup: the node holds %d of a lease of %d (a call out: %v), spendable until %d µs from midnight", e.tokens, e.size, e.call != nil, e.spendBy-midnight)
	}
	gate := make(chan struct{})
	m.gate = gate
	// Whatever call the next request starts lands after midnight.
	res, err := node.take(bg, key, tr, 1, nil)
	if err != nil || !res.Allowed {
		t.Fatalf("a request beside half a lease: %+v, %v", res, err)
	}
	admitted++
	clock.micros.Store(midnight + 10_000)
	close(gate)
	tableSync(node)
	m.gate = nil
	for clock.now() < midnight+300_000 {
		take()
		clock.advance(10 * time.Millisecond)
	}
	node.close()
	if lent := l.Capacity - m.level(string(key), l); lent != admitted {
		t.Errorf("the limit lent %d tokens, the node admitted %d: %d leased tokens lost across midnight", lent, admitted, lent-admitted)
	}
}
