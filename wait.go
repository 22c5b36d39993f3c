package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
)

// Smoothing bursts (README: Smooth bursts instead of refusing them): with
// max_wait, a request whose tokens are due within it takes them at once
// and waits until they are due, then goes on. The store decides it, in the
// same step as any take; the handler only waits, on a timer, holding no
// lock, no store shard and no connection.

// defaultMaxWaiting bounds the requests of one policy that wait at once on
// a node, when max_waiting does not say.
const defaultMaxWaiting = 10000

// waiters counts each policy's waiting requests on this node: handlers of
// one policy (its routes, and the configs of a reload) share the bound.
var waiters sync.Map // policy name -> *atomic.Int64

func waitersFor(policy string) *atomic.Int64 {
	n, _ := waiters.LoadOrStore(policy, new(atomic.Int64))
	return n.(*atomic.Int64)
}

// checkWait checks max_wait, the handler's and each tier's, and
// max_waiting.
func (h *Handler) checkWait() error {
	if h.MaxWait < 0 || h.MaxWait > 0 && h.MaxWait < caddy.Duration(time.Microsecond) {
		return fmt.Errorf("max_wait %s: must be at least 1µs", time.Duration(h.MaxWait))
	}
	if h.MaxWaiting < 0 {
		return fmt.Errorf("max_waiting %d: must be at least 1", h.MaxWaiting)
	}
	for _, t := range h.Tiers {
		if t.MaxWait < 0 || t.MaxWait > 0 && t.MaxWait < caddy.Duration(time.Microsecond) {
			return fmt.Errorf("tier %q: max_wait %s: must be at least 1µs", t.Name, time.Duration(t.MaxWait))
		}
	}
	return nil
}

// errTooManyWaiting is the error behind the refusal of a request that
// would wait while max_waiting requests of its policy already do.
var errTooManyWaiting = errors.New("too many requests of this policy are waiting (max_waiting)")

// await holds an allowed request until its tokens are due. A request that
// would be one waiter too many is refused at once, and one whose client
// goes away gives its tokens back: either way, the tokens it took go back.
// It returns the result to answer with, or the client's error, for
// clientGone.
func (h *Handler) await(r *http.Request, d *decision, res bucket.Result) (bucket.Result, error) {
	if h.DryRun {
		// A dry run changes no request's timing.
		res.Wait = 0
		return res, nil
	}
	d.result = res // what giveBackTaken gives back from
	if !h.enterWaiting() {
		h.giveBackTaken(r, d, "max_waiting")
		d.refusedBy = refusedWaiting
		return bucket.Result{Remaining: res.Remaining, RetryAfter: res.Wait, ResetAfter: res.ResetAfter}, nil
	}
	defer h.waiting.Add(-1)
	timer := time.NewTimer(time.Duration(res.Wait) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		d.tier.waitTime.Observe(float64(res.Wait) / 1e6)
		// The results still speak from the decision, which a give-back
		// names its quota period by; the headers from when the request
		// goes on (decision.goingOn).
		return res, nil
	case <-r.Context().Done():
		h.giveBackTaken(r, d, "client gone")
		h.logDecision(d, "client went away while waiting; tokens given back", "")
		return res, r.Context().Err()
	}
}

// enterWaiting counts one more waiter, unless max_waiting already wait:
// the count never passes the bound, not even for a moment.
func (h *Handler) enterWaiting() bool {
	for {
		n := h.waiting.Load()
		if n >= int64(h.maxWaiting) {
			return false
		}
		if h.waiting.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// provisionWait sets up the waiting bound; the tiers' wait histograms are
// looked up here, not per request.
func (h *Handler) provisionWait() {
	h.maxWaiting = cmp.Or(h.MaxWaiting, defaultMaxWaiting)
	h.waiting = waitersFor(h.Name)
	for _, t := range h.Tiers {
		t.waitTime = waitSeconds.WithLabelValues(h.Name, t.Name)
		t.inFlight = inFlightGauge.WithLabelValues(h.Name, t.Name)
	}
}
