package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A reconcile charge that fails is tried again later, with what the
// bucket still owes: a give-back or an admin reset that lands while the
// failed charge was out counts in it.

// heldCharges is a node's link to a shared bucket table whose reconcile
// charges wait until the test lets each go, answering with its error.
type heldCharges struct {
	fleetStore
	entered chan struct{}
	answer  chan error
}

func (s *heldCharges) charge(ctx context.Context, b *Bucket, tr bucket.Tier, n int64) error {
	s.entered <- struct{}{}
	if err := <-s.answer; err != nil {
		return err
	}
	return s.fleetStore.charge(ctx, b, tr, n)
}

// settleDuringAFailedCharge cuts a node off, has its fallback admit three
// requests of one client, the first of which waits in the origin, brings
// the store back, and holds the pass's charge; meanwhile settle runs (it
// may let the waiting request go on). The charge then fails, is tried
// again a second later and lands. It returns what the shared bucket of
// capacity 10 has left.
func settleDuringAFailedCharge(t *testing.T, name string, settle func(h *Handler, b *Bucket, release chan<- struct{}, served <-chan struct{})) int64 {
	t.Helper()
	clock := newFakeClock()
	h, done := provisionedHandlerOn(t, clock.clocks(), fmt.Sprintf(`{
		"name": %q,
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"]},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"count_status": ["2xx"],
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, name, freePort(t)))
	t.Cleanup(done)
	link := &heldCharges{
		fleetStore: fleetStore{shared: &LocalStore{buckets: localbucket.New(localOptions(100, clock.clocks()))}},
		entered:    make(chan struct{}), answer: make(chan error),
	}
	h.store, h.owed.store = &link.fleetStore, link
	const client, prober = "192.0.2.80", "192.0.2.81"
	r := benchRequest(client)
	d := h.newDecision(r)
	if err := nameAndChoose(h, r, d); err != nil {
		t.Fatal(err)
	}
	b := d.bucket
	b.Value = append([]byte(nil), b.Value...)

	link.cut.Store(true)
	release, served := make(chan struct{}), make(chan struct{})
	origin := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		<-release
		return caddyhttp.Error(http.StatusInternalServerError, errors.New("origin failed"))
	})
	go func() {
		defer close(served)
		serveOne(h, benchRequest(client), origin)
	}()
	waitFor(t, 5*time.Second, "the first request admitted by the fallback", func() bool {
		return h.owed.pending.Load()
	})
	for range 2 {
		if w, _ := serveOne(h, benchRequest(client), nopHandler); w.Code != http.StatusOK {
			t.Fatalf("cut off: %d, want 200 from the fallback", w.Code)
		}
	}

	link.cut.Store(false)
	serveOne(h, benchRequest(prober), nopHandler) // the store answers: a pass starts
	<-link.entered
	settle(h, &b, release, served)
	link.answer <- errors.New("the store failed again")
	h.owed.wait()

	clock.advance(reconcileRetry)
	go func() {
		for range link.entered {
			link.answer <- nil
		}
	}()
	serveOne(h, benchRequest(prober), nopHandler) // the retry
	h.owed.wait()
	close(link.entered)
	out := make([]bucket.Result, 1)
	if err := h.store.peek(context.Background(), &b, d.tier.shape(), out); err != nil {
		t.Fatal(err)
	}
	return out[0].Remaining
}

// TestAGiveBackDuringAFailedReconcileChargeIsNotChargedOnRetry: of three
// requests the fallback admitted, one is answered 500 (count_status 2xx
// gives it back) while the charge of all three is out and then fails:
// the retry charges two.
func TestAGiveBackDuringAFailedReconcileChargeIsNotChargedOnRetry(t *testing.T) {
	t.Parallel()
	got := settleDuringAFailedCharge(t, "reconcile-retry-giveback", func(h *Handler, b *Bucket, release chan<- struct{}, served <-chan struct{}) {
		close(release)
		<-served
	})
	if got != 10-2 {
		t.Fatalf("the shared bucket after the retried charge: %d left; want %d: two kept, one given back while the failed charge was out", got, 10-2)
	}
}

// TestAnAdminResetDuringAFailedReconcileChargeForgivesItsRetry: a bucket
// reset while its charge is out, a charge that then fails, is charged
// nothing on retry: the reset forgave it.
func TestAnAdminResetDuringAFailedReconcileChargeForgivesItsRetry(t *testing.T) {
	t.Parallel()
	got := settleDuringAFailedCharge(t, "reconcile-retry-reset", func(h *Handler, b *Bucket, release chan<- struct{}, served <-chan struct{}) {
		resetBucket(context.Background(), h, b)
		close(release)
		<-served
	})
	// The waiting request, answered 500 after the reset, gave its token
	// back to a full bucket.
	if got != 10 {
		t.Fatalf("the shared bucket after the retried charge: %d left; want 10: the admin reset forgave what the fallback admitted", got)
	}
}

// TestAReconcileChargeWhoseAnswerWasLostIsNotChargedAgain: Redis stops
// (SIGSTOP) while a reconcile charge is on its way, so the node times out
// and Redis runs the charge once it goes on. The node cannot know it
// landed: trying it again would charge the client twice.
func TestAReconcileChargeWhoseAnswerWasLostIsNotChargedAgain(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	clock := newFakeClock()
	h, done := provisionedHandlerOn(t, clock.clocks(), fmt.Sprintf(`{
		"name": "reconcile-lost-answer",
		"store": {"store": "redis", "addresses": ["redis://%s"], "timeout": "100ms", "breaker_failures": 100},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, proxy.Addr()))
	defer done()
	const client, prober = "192.0.2.85", "192.0.2.86"
	lost := reconcileLostTokens.WithLabelValues("reconcile-lost-answer")
	before := counterValue(t, lost)

	proxy.Cut()
	for range 3 {
		if w, _ := serveOne(h, benchRequest(client), nopHandler); w.Code != http.StatusOK {
			t.Fatalf("cut off: %d, want 200 from the fallback", w.Code)
		}
	}
	proxy.Restore()
	// A connection in the pool, made by a peek, which starts no charge.
	if got := sharedRemaining(t, h, client); got != 10 {
		t.Fatalf("the shared bucket after the cut: %d left; want 10", got)
	}
	srv.pause()
	h.owed.storeAnswered() // as a call that just succeeded does
	h.owed.wait()          // the charge timed out, Redis stopped
	srv.Resume()
	if got := counterValue(t, lost) - before; got != 3 {
		t.Errorf("lost tokens after a charge that got no answer: %v; want 3, counted once as not charged again", got)
	}
	waitFor(t, 5*time.Second, "Redis to run the charge it received while stopped", func() bool {
		return sharedRemaining(t, h, client) == 10-3
	})

	clock.advance(reconcileRetry)
	for range 3 {
		serveOne(h, benchRequest(prober), nopHandler)
		h.owed.wait()
	}
	if got := sharedRemaining(t, h, client); got != 10-3 {
		t.Fatalf("the shared bucket once the store answers again: %d left; want %d: the three requests the fallback admitted, charged once", got, 10-3)
	}
}
