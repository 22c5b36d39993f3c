package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
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

// leaseBeside runs one key on a leasing node and, beside it, the same
// requests and charges on a strict bucket (the shared model with no lease
// out), on one clock.
type leaseBeside struct {
	t      *testing.T
	clock  *fakeClock
	m      *sharedModel
	node   *leaseTable
	strict *buckettest.Shared
	l      bucket.Limit
	key    []byte
}

func newLeaseBeside(t *testing.T, l bucket.Limit, size int64) *leaseBeside {
	clock, m := newModelStore()
	return &leaseBeside{t: t, clock: clock, m: m, node: newModelTable(m, LeaseSize{tokens: size}, time.Hour),
		strict: &buckettest.Shared{Levels: make([]bucket.State, 1)}, l: l, key: []byte("charged")}
}

// take is one request of cost 1 on both: the node's answer, and strict
// mode's ResetAfter.
func (b *leaseBeside) take() (bucket.Result, int64) {
	b.t.Helper()
	res := takeSynced(b.t, b.node, b.key, b.l)
	var out [1]bucket.Result
	if ok := b.strict.Take(b.clock.now(), []bucket.Limit{b.l}, 1, out[:]); ok != res.Allowed {
		b.t.Fatalf("leased %+v, strict %+v: they disagree", res, out[0])
	}
	return res, out[0].ResetAfter
}

// charge is a cost_from_response charge of n on both, as Store.Charge
// makes it: from the node's lease when it covers it, the rest to the
// shared bucket.
func (b *leaseBeside) charge(n int64) {
	if rest := b.node.chargeHeld(b.key, n); rest > 0 {
		b.m.mu.Lock()
		b.m.bucket(string(b.key), 1).Charge(b.clock.now(), []bucket.Limit{b.l}, rest)
		b.m.mu.Unlock()
	}
	b.strict.Charge(b.clock.now(), []bucket.Limit{b.l}, n)
}

// held is what the node holds on lease.
func (b *leaseBeside) held() int64 {
	sh := b.node.shard(b.key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[string(b.key)].tokens
}

// modelReset is when the shared bucket, as the lease model keeps it, is
// full again: what the script answers a lease call.
func (b *leaseBeside) modelReset() int64 {
	b.m.mu.Lock()
	defer b.m.mu.Unlock()
	var out [1]bucket.Result
	b.m.bucket(string(b.key), 1).Peek(b.clock.now(), []bucket.Limit{b.l}, out[:])
	return out[0].ResetAfter
}

// After a cost_from_response charge, a leased request's ResetAfter is the
// shared bucket's as its lease call left it, to the microsecond: the
// lease model's (buckettest.Shared, which the script matches). With
// leases of one token, which leave nothing held, it is strict mode's. A
// lease of more is later than strict mode's by the refill of the tokens
// the node holds, which the shared bucket counts as taken (one interval
// when the call after a charge doubles the lease from 1 to 2), and of held
// tokens a charge spent since the last call: the shared bucket does not
// refill over tokens out on lease until a call says they are spent, which
// keeps the fleet within one bucket (docs/fleet.md).
func TestALeasedResetAfterAChargeIsTheSharedBucketsAsTheLeaseCallLeftIt(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	interval := l.Rate.Interval / l.Rate.Tokens
	for _, size := range []int64{1, 10} {
		b := newLeaseBeside(t, l, size)
		if res, strict := b.take(); res.ResetAfter != strict || b.held() != 0 {
			t.Fatalf("lease %d: first request: leased %+v, strict reset %d, %d held; want strict's, none held", size, res, strict, b.held())
		}
		// Nothing held: the charge goes to the shared bucket whole. With
		// leases of 10, the next request's call doubles the lease: it
		// takes 2 and holds 1.
		b.charge(3)
		res, strict := b.take()
		if model := b.modelReset(); res.ResetAfter != model {
			t.Fatalf("lease %d: after a charge to the shared bucket: leased reset %d, the lease model's %d", size, res.ResetAfter, model)
		}
		h := b.held()
		if h != min(size-1, 1) || res.ResetAfter != strict+h*interval {
			t.Fatalf("lease %d: after a charge to the shared bucket: leased reset %d, strict %d, %d held; want strict's plus the held tokens' refill", size, res.ResetAfter, strict, h)
		}
		if size == 1 {
			continue
		}
		// A charge spends the held token, with no call.
		calls := b.m.calls
		b.charge(1)
		if b.held() != 0 || b.m.calls != calls {
			t.Fatalf("a charge of the held token: %d held, %d calls; want 0 and none", b.held(), b.m.calls-calls)
		}
		// Long enough for a strict bucket to be full again.
		b.clock.advance(20 * time.Second)
		res, strict = b.take()
		if model := b.modelReset(); res.ResetAfter != model {
			t.Fatalf("the call after the charge spent the lease: leased reset %d, the lease model's %d", res.ResetAfter, model)
		}
		if h, want := b.held(), strict+(b.held()+1)*interval; res.ResetAfter != want {
			t.Fatalf("the call after the charge spent the lease: leased reset %d, strict %d, %d held; want strict's plus the refill of the held tokens and of the one the charge spent, %d", res.ResetAfter, strict, h, want)
		}
	}
}
