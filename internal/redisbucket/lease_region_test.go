package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Leases with a store far away (round trips of 100-300 ms): a request
// that finds no tokens is refused at once rather than wait a round trip,
// a lease is renewed before it ends, and the requests a call did not
// cover ask again only when its answer shows tokens left.

// slowRemote is the model store answering after a round trip of rtt on
// the fake clock: the call moves the clock on, as a far region's would.
type slowRemote struct {
	*sharedModel
	clock *fakeClock
	rtt   time.Duration
}

func (r slowRemote) lease(key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error) {
	r.clock.advance(r.rtt / 2)
	res, err := r.sharedModel.lease(key, tr, a, each)
	r.clock.advance(r.rtt / 2)
	return res, err
}

// After a hold-off ends, a node 100 ms from the store whose last answer
// showed the shared level empty refuses a request that finds no leased
// tokens at once, and fetches the next lease in the background: the
// request does not wait a round trip on the call (the bucket refills a
// token in 50 ms). The call's tokens are for the requests after it.
func TestAfterAHoldOffARequestThatFindsNoTokensIsRefusedAtOnce(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 20, Interval: 1_000_000}}
	clock, m := newModelStore()
	node := newLeaseTable(slowRemote{m, clock, 100 * time.Millisecond}, m.now, LeaseSize{tokens: 10}, 2*time.Second, time.Second, 1000, nopLogger)
	node.jitter = func(int64) int64 { return 0 }
	defer node.close()
	key := []byte("k")
	for i := 0; ; i++ {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		if !res.Allowed {
			break
		}
		if i > 2*int(l.Capacity) {
			t.Fatalf("%d requests on a bucket of %d all allowed", i, l.Capacity)
		}
	}
	e := node.snapshot(key)
	if e.holdUntil == 0 {
		t.Fatalf("the refused call set no hold-off: %+v", e)
	}
	clock.micros.Store(e.holdUntil)
	gate := make(chan struct{})
	m.gate = gate
	answer := make(chan bucket.Result, 1)
	go func() {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		if err != nil {
			t.Error(err)
		}
		answer <- res
	}()
	var res bucket.Result
	select {
	case res = <-answer:
	case <-time.After(5 * time.Second):
		close(gate)
		t.Fatal("the request after the hold-off waited on the lease call (a round trip of 100 ms), with no tokens held and the shared level last seen empty")
	}
	close(gate)
	tableSync(node)
	if res.Allowed || res.RetryAfter <= 0 {
		t.Errorf("the request after the hold-off: %+v; want refused with a retry time", res)
	}
	if got := node.snapshot(key); got.tokens == 0 {
		t.Errorf("no lease fetched in the background: entry %+v", got)
	}
	next, err := node.take(bg, key, oneLimit(l), 1, nil)
	if err != nil || !next.Allowed {
		t.Errorf("the next request, with the background lease in: %+v, %v", next, err)
	}
}

// A node fetches its next lease in the background when the newest one
// ends within two round trips, though it holds more than half of it: its
// requests then find tokens when the old ones lapse, rather than wait a
// round trip on a call.
func TestANodeFetchesItsNextLeaseWhenItsLeaseEndsWithinTwoRoundTrips(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	ttl := time.Second
	node := newLeaseTable(slowRemote{m, clock, 100 * time.Millisecond}, m.now, LeaseSize{tokens: 10}, ttl, time.Second, 1000, nopLogger)
	defer node.close()
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	key := []byte("k")
	take := func() {
		t.Helper()
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil || !res.Allowed {
			t.Fatalf("%+v, %v", res, err)
		}
	}
	// Requests 10 ms apart until the node holds a lease of 10 tokens.
	for node.snapshot(key).size < 10 {
		take()
		clock.advance(10 * time.Millisecond)
	}
	e := node.snapshot(key)
	if e.rtt != 100_000 {
		t.Fatalf("the round trip the node measured: %d µs; want 100 ms", e.rtt)
	}
	clock.micros.Store(e.leasedAt + ttl.Microseconds() - 150_000)
	if e.tokens*2 < e.size+2 {
		t.Fatalf("the node holds %d tokens of a lease of %d: the next request would prefetch at half", e.tokens, e.size)
	}
	calls := m.calls
	take()
	after := node.snapshot(key)
	if m.calls != calls+1 {
		t.Errorf("150 ms before its lease ends (round trip 100 ms), holding %d of %d tokens: %d lease calls; want one in the background", e.tokens, e.size, m.calls-calls)
	}
	if after.leasedAt <= e.leasedAt {
		t.Errorf("the lease still ends at %d µs", after.leasedAt+ttl.Microseconds())
	}
}

// A lease call's answer says whether the shared level is empty: a grant
// of all the node asked for that leaves it empty refuses the requests
// that waited on the call and that it did not cover, with no second round
// trip, as strict mode would refuse them.
func TestWaitersAreRefusedWhenAFullGrantLeavesTheSharedLevelEmpty(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	var out [1]bucket.Result
	m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, 9, out[:]) // one token left
	node := newModelTable(m, LeaseSize{tokens: 4}, time.Second)
	defer node.close()
	gate := make(chan struct{})
	m.gate = gate
	results := make(chan bucket.Result, 3)
	joined := func(n int) func() bool {
		return func() bool {
			sh := node.shard([]byte("k"))
			sh.mu.Lock()
			defer sh.mu.Unlock()
			e := sh.m["k"]
			return e != nil && e.call != nil && e.call.joined == n
		}
	}
	for i := range 3 {
		go func() {
			res, err := node.take(bg, []byte("k"), oneLimit(l), 1, nil)
			if err != nil {
				t.Error(err)
			}
			results <- res
		}()
		redistest.WaitFor(t, 5*time.Second, "the request to wait on the call", joined(i))
	}
	close(gate)
	allowed := 0
	for range 3 {
		if res := <-results; res.Allowed {
			allowed++
		}
	}
	tableSync(node)
	if allowed != 1 || m.calls != 1 {
		t.Errorf("3 requests on one token, the first call granting it all: %d allowed, %d lease calls; want 1 and 1 (the answer showed the level empty)", allowed, m.calls)
	}
}
