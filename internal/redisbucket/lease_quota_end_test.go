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

// Near the end of a quota's period no leased token is lost. A node 100 ms
// from the store holds a lease, more than half of it left, whose tokens
// lapse at midnight, when the quota period that counted them ends: a call
// for more of the old period in the last two round trips gains nothing,
// and one that lands after midnight has the store drop what the node
// holds, which the limit never gets back. Every token the limit lent is
// admitted or given back.
func TestNoLeasedTokenIsLostAcrossAQuotaPeriodsEnd(t *testing.T) {
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
	}
	for node.snapshot(key).size < 40 {
		take()
		tableSync(node)
		clock.advance(10 * time.Millisecond)
	}
	clock.micros.Store(midnight - 150_000)
	if e := node.snapshot(key); e.tokens*2 < e.size+2 || e.spendBy != midnight {
		t.Fatalf("setup: the node holds %d of a lease of %d, spendable until %d µs from midnight", e.tokens, e.size, e.spendBy-midnight)
	}
	gate := make(chan struct{})
	m.gate = gate
	take()
	// Whatever call that request started lands after midnight.
	clock.micros.Store(midnight + 10_000)
	close(gate)
	tableSync(node)
	m.gate = nil
	for clock.now() < midnight+300_000 {
		take()
		tableSync(node)
		clock.advance(10 * time.Millisecond)
	}
	node.close()
	if lent := l.Capacity - m.level(string(key), l); lent != admitted {
		t.Errorf("the limit lent %d tokens, the node admitted %d: %d leased tokens lost across midnight", lent, admitted, lent-admitted)
	}
}
