package redisbucket

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"go.uber.org/zap"
)

// TestTheNextCallAsksOnlyForTheWaitersStillThere: the requests a call left
// uncovered ask again in one call sized for them all (takeHeld's
// backlog); those whose clients went away while the call was out are not
// among them, so the call does not lease tokens for them that then sit
// idle on the node.
func TestTheNextCallAsksOnlyForTheWaitersStillThere(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}
	stepped := steppedModel{m, make(chan struct{})}
	node := newLeaseTable(stepped, m.now, LeaseSize{tokens: 10}, time.Second, 100*time.Millisecond, 1000, zap.NewNop())
	defer node.close()
	var wants []int64
	m.onAsk = func(a bucket.LeaseAsk, _ *buckettest.Shared, _ bucket.LeaseResult) { wants = append(wants, a.Want) }

	results := make(chan bucket.Result, 2)
	takeJoining(t, node, l, results, 0) // makes the first call: one request's cost
	const gone = 8
	ctx, hangUp := context.WithCancel(bg)
	errs := make(chan error, gone)
	for i := range gone {
		go func() {
			_, err := node.take(ctx, []byte("k"), oneLimit(l), 1, nil)
			errs <- err
		}()
		redistest.WaitFor(t, 5*time.Second, "the request to wait on the call", func() bool { return callJoinedBy(node, "k", i+1) })
	}
	takeJoining(t, node, l, results, gone+1) // stays
	hangUp()
	for range gone {
		if err := <-errs; !errors.Is(err, context.Canceled) {
			t.Fatalf("a request whose client went away: %v; want context.Canceled", err)
		}
	}
	clock.advance(10 * time.Millisecond)
	close(stepped.step) // the first call grants its maker's cost; the one left asks again
	for range 2 {
		if res := <-results; !res.Allowed {
			t.Fatalf("a request on a full bucket of 100: %+v", res)
		}
	}
	tableSync(node)
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(wants) != 2 {
		t.Fatalf("lease calls asked %v; want two calls", wants)
	}
	// The second call is within lease_ttl of the first (size 1): the
	// lease doubles to 2, which also covers the request left and the
	// first call's maker.
	if wants[1] > 2 {
		held := node.snapshot([]byte("k")).tokens
		t.Errorf("with %d of %d waiters gone before the answer, the next call asked for %d tokens (the node now holds %d idle); want at most 2, for the one request still waiting", gone, gone+1, wants[1], held)
	}
}

// TestACostlyWaiterIsRefusedByAnAnswerThatShowedTheLevelUnderItsCost: a
// request that waited on a cheaper request's lease call, whose answer
// showed the shared level under the waiter's own cost, is refused at that
// answer, as one bucket would refuse it, rather than wait on a call of its
// own (a round trip more far from the store) to hear the same.
func TestACostlyWaiterIsRefusedByAnAnswerThatShowedTheLevelUnderItsCost(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := slowLimit(20)
	m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, 15, make([]bucket.Result, 1)) // 5 left
	stepped := steppedModel{m, make(chan struct{})}
	node := newLeaseTable(stepped, m.now, LeaseSize{tokens: 10}, time.Second, 100*time.Millisecond, 1000, zap.NewNop())
	defer node.close()
	cheap := make(chan bucket.Result, 1)
	takeJoining(t, node, l, cheap, 0)
	costly := make(chan bucket.Result, 1)
	go func() {
		res, err := node.take(bg, []byte("k"), oneLimit(l), 8, nil)
		if err != nil {
			t.Error(err)
		}
		costly <- res
	}()
	redistest.WaitFor(t, 5*time.Second, "the request of 8 to wait on the call", func() bool { return callJoinedBy(node, "k", 1) })
	close(stepped.step)
	if res := <-cheap; !res.Allowed {
		t.Fatalf("a request of 1 beside a level of 5: %+v", res)
	}
	res := <-costly
	tableSync(node)
	m.mu.Lock()
	calls := m.calls
	m.mu.Unlock()
	if res.Allowed || calls != 1 {
		t.Errorf("a request of 8 that waited on a call whose answer showed a level of 4: allowed %v after %d lease calls; want refused after that one call", res.Allowed, calls)
	}
}
