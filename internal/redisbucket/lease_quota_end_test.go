package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// measuredRemote is the model store with a measured round trip of rtt µs,
// as the Redis store's (rtt.go); its calls answer at once.
type measuredRemote struct {
	*sharedModel
	rtt int64
}

func (r measuredRemote) roundTripMicros() int64 { return r.rtt }

// midnightLease is a node 100 ms from the store leasing 40 tokens at a
// time of a limit of 200 and a daily quota, a few seconds before midnight,
// when the quota period that counts the tokens ends.
type midnightLease struct {
	t        *testing.T
	l        bucket.Limit
	tr       bucket.Tier
	clock    *fakeClock
	m        *sharedModel
	node     *leaseTable
	key      []byte
	midnight int64
	admitted int64
}

// newMidnightLease starts the node and grows its lease to 40 tokens.
func newMidnightLease(t *testing.T) *midnightLease {
	l := slowLimit(200)
	ml := &midnightLease{t: t, l: l, key: []byte("k"), tr: bucket.Tier{
		Limits: []bucket.Limit{l},
		Quotas: []bucket.Quota{{N: 100_000, Period: bucket.Day, Loc: time.UTC}},
	}}
	ml.clock, ml.m = newModelStore()
	_, ml.midnight = ml.tr.Quotas[0].Bounds(ml.clock.now())
	ml.clock.micros.Store(ml.midnight - 5*second)
	ml.node = newLeaseTable(measuredRemote{ml.m, 100_000}, ml.m.now, LeaseSize{tokens: 40}, 10*time.Second, time.Second, 1000, nopLogger)
	ml.node.jitter = func(int64) int64 { return 0 }
	for ml.node.snapshot(ml.key).size < 40 {
		ml.take()
		ml.clock.advance(10 * time.Millisecond)
	}
	return ml
}

// take sends one request of cost 1, counts it if admitted, and lets the
// calls it started answer.
func (ml *midnightLease) take() {
	ml.t.Helper()
	res, err := ml.node.take(bg, ml.key, ml.tr, 1, nil)
	if err != nil {
		ml.t.Fatal(err)
	}
	if res.Allowed {
		ml.admitted++
	}
	tableSync(ml.node)
}

// acrossMidnight sends one request 150 ms before midnight whose call, if it
// starts one, lands after it; then requests until 300 ms after midnight;
// then closes the node and checks that every token the limit lent was
// admitted or given back.
func (ml *midnightLease) acrossMidnight() {
	ml.t.Helper()
	gate := make(chan struct{})
	ml.m.gate = gate
	res, err := ml.node.take(bg, ml.key, ml.tr, 1, nil)
	if err != nil || !res.Allowed {
		ml.t.Fatalf("a request 150 ms before midnight: %+v, %v", res, err)
	}
	ml.admitted++
	ml.clock.micros.Store(ml.midnight + 10_000)
	close(gate)
	tableSync(ml.node)
	ml.m.gate = nil
	for ml.clock.now() < ml.midnight+300_000 {
		ml.take()
		ml.clock.advance(10 * time.Millisecond)
	}
	ml.node.close()
	if lent := ml.l.Capacity - ml.m.level(string(ml.key), ml.l); lent != ml.admitted {
		ml.t.Errorf("the limit lent %d tokens, the node admitted %d: %d leased tokens lost across midnight", lent, ml.admitted, lent-ml.admitted)
	}
}

// Near the end of a quota's period no leased token is lost. A node 100 ms
// from the store holds a lease, more than half of it left, whose tokens
// lapse at midnight, when the quota period that counted them ends: a call
// for more of the old period in the last two round trips gains nothing,
// and one that lands after midnight has the store drop what the node
// holds, which the limit never gets back. Every token the limit lent is
// admitted or given back.
func TestNoLeasedTokenIsLostAcrossAQuotaPeriodsEnd(t *testing.T) {
	t.Parallel()
	ml := newMidnightLease(t)
	ml.clock.micros.Store(ml.midnight - 150_000)
	if e := ml.node.snapshot(ml.key); e.tokens*2 < e.size+2 || e.spendBy != ml.midnight {
		t.Fatalf("setup: the node holds %d of a lease of %d, spendable until %d µs from midnight", e.tokens, e.size, e.spendBy-ml.midnight)
	}
	ml.acrossMidnight()
}

// TestNoLeasedTokenIsLostWhenALeaseFallsToHalfJustBeforeItsQuotaPeriodEnds:
// a node 100 ms from the store whose lease falls under half in the last
// two round trips before midnight, when the quota period that counted its
// tokens ends, does not prefetch then either: the call would land after
// midnight and have the store drop what the node holds, which the limit
// never gets back. Every token the limit lent is admitted or given back.
func TestNoLeasedTokenIsLostWhenALeaseFallsToHalfJustBeforeItsQuotaPeriodEnds(t *testing.T) {
	t.Parallel()
	ml := newMidnightLease(t)
	// Spend down to half the lease, which starts no prefetch yet.
	for e := ml.node.snapshot(ml.key); e.tokens*2 > e.size; e = ml.node.snapshot(ml.key) {
		ml.take()
	}
	ml.clock.micros.Store(ml.midnight - 150_000)
	if e := ml.node.snapshot(ml.key); e.tokens*2 != e.size || e.call != nil || e.spendBy != ml.midnight {
		t.Fatalf("setup: the node holds %d of a lease of %d (a call out: %v), spendable until %d µs from midnight", e.tokens, e.size, e.call != nil, e.spendBy-ml.midnight)
	}
	ml.acrossMidnight()
}
