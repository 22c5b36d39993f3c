package ratelimit

import (
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
)

// In-flight limits (README: Protect a slow origin): with concurrency, a
// tier lets at most n of one client's requests be in flight, from when
// rate_limit passes the request on until the handlers after it return. A
// request takes its rate tokens first, then a slot; refused a slot, it
// gives its tokens back, so that it takes all or nothing. The slot is
// freed on every path, panics included (settle.go).

// slotSource is where a request's slot is held, to free it there.
type slotSource uint8

const (
	noSlot slotSource = iota
	// slotInStore: the policy's store.
	slotInStore
	// slotInLocal: this node's count, while the store failed
	// (on_store_error local).
	slotInLocal
	// slotInRunningStore and slotInRunningLocal: the same two, in their
	// order, of the running config, for a request of a config that a
	// reload unloaded (liveSlots); runningSlotOwners says which config.
	slotInRunningStore
	slotInRunningLocal
)

// runningSlotOwners holds, for a request whose slot is in a running
// config's store (slotInRunning...), that config's handler, by decision:
// kept off the decision, whose size sits at an allocation class's edge,
// for a case that only a reload makes.
var runningSlotOwners sync.Map // *decision -> *Handler

// errNoSlot is the error behind the refusal of a request whose client has
// n requests in flight already.
var errNoSlot = errors.New("too many requests of this client in flight (concurrency)")

// validateConcurrency checks a tier's concurrency: a tier may have it
// beside its limits or quotas or instead of them, and then takes no cost.
func (t *Tier) validateConcurrency() (only bool, err error) {
	if t.Concurrency < 0 || t.Concurrency > math.MaxInt32 {
		return false, fmt.Errorf("tier %q: concurrency %d: must be from 1 to %d", t.Name, t.Concurrency, math.MaxInt32)
	}
	if t.Concurrency == 0 || t.limitCount() > 0 || len(t.Quotas) > 0 {
		return false, nil
	}
	if t.Cost != 0 || t.CostPlaceholder != "" || t.CostFromResponse != "" {
		return false, fmt.Errorf("tier %q: a tier with concurrency and no rate limit takes no cost; give it a rate limit or a quota to count", t.Name)
	}
	return true, nil
}

// acquireSlot takes a slot for an allowed request of a tier with
// concurrency. Refused, the request gives back the rate tokens it took and
// is answered with Retry-After: 1. A store that fails is answered as
// on_store_error says; with local, this node counts alone.
func (h *Handler) acquireSlot(r *http.Request, d *decision, res bucket.Result) (bucket.Result, error) {
	n := d.tier.Concurrency
	d.result = res // what giveBackTaken gives back from
	from, owner := slotInStore, h
	slot, inUse, ok, err := h.store.acquire(r.Context(), &d.bucket, n)
	if errors.Is(err, errSlotsUnloaded) {
		// Each config tried is left out of the next look, should a second
		// reload close the one found too.
		for tried := []*Handler{h}; errors.Is(err, errSlotsUnloaded); tried = append(tried, owner) {
			if owner, n = liveSlots(h.Name, d.tier.Name, tried); owner == nil {
				// No running config of the policy counts this tier's
				// requests in flight (the reload took its concurrency
				// away, or the policy stopped): nothing limits the request.
				return res, nil
			}
			slot, inUse, ok, err = owner.store.acquire(r.Context(), &d.bucket, n)
		}
	}
	if err != nil && r.Context().Err() != nil {
		// The client went away: no store failed.
		h.giveBackTaken(r, d, "client gone")
		return res, errClientGone
	}
	if err != nil {
		// As the config that holds the slot says: its fallback is where
		// releaseSlot frees it.
		switch owner.onStoreError(err, "rate limit store failed to count requests in flight", h.DryRun) {
		case goOnUndecided:
			// Without a slot.
			return res, nil
		case refuseUndecided:
			h.giveBackTaken(r, d, "store failed")
			return res, err
		}
		from = slotInLocal
		slot, inUse, ok, _ = owner.local.acquire(r.Context(), &d.bucket, n)
	}
	if !ok {
		d.refusedBy = refusedNoSlot
		// Wait: it may have waited for its tokens first (goingOn).
		refused := bucket.Result{Remaining: res.Remaining, RetryAfter: 1e6, ResetAfter: res.ResetAfter, Wait: res.Wait}
		if h.DryRun {
			// Let through, as a dry run does, with the tokens it took.
			return refused, nil
		}
		h.giveBackTaken(r, d, "concurrency")
		d.untake()
		refused.Remaining = d.result.Remaining
		return refused, nil
	}
	if owner != h {
		runningSlotOwners.Store(d, owner)
		from += slotInRunningStore - slotInStore
	}
	d.slotFrom, d.slotID, d.slotLeft = from, slot, int32(n-inUse)
	d.tier.inFlight.Inc()
	return res, nil
}

// errSlotsUnloaded is a slot store's refusal of a new slot once its config
// has unloaded: a request of that config still running (a reload caught
// it waiting, with max_wait) takes its slot in the running config's store.
var errSlotsUnloaded = redisbucket.ErrSlotsClosed

// liveSlots is where a request of a tier of policy takes its slot once
// the slots of its own config, and of those tried, have closed: the newest
// running handler of the policy whose tier of that name has concurrency,
// and that concurrency. The bucket is the same there, named by policy and
// tier. It is nil when none has: the running config does not limit that
// tier's requests in flight.
func liveSlots(policy, tier string, tried []*Handler) (*Handler, int64) {
	hs := runningHandlers()[policy]
	for i := len(hs) - 1; i >= 0; i-- {
		if slices.Contains(tried, hs[i]) {
			continue
		}
		for _, t := range hs[i].Tiers {
			if t.Name == tier && t.Concurrency > 0 {
				return hs[i], t.Concurrency
			}
		}
	}
	return nil, 0
}

// untake shows the decision's results as they stand once the request's
// tokens went back: each limit holds the cost more, up to its capacity.
func (d *decision) untake() {
	left := d.result.Remaining // the binding one's: for one limit, parts[0]
	parts := d.parts()
	for i, l := range d.tier.limits {
		parts[i].Remaining = min(parts[i].Remaining+d.cost, l.Capacity)
	}
	if int(d.binding) < len(d.tier.limits) {
		d.result.Remaining = min(left+d.cost, d.tier.limits[d.binding].Capacity)
	} else if j := int(d.binding) - len(d.tier.limits); j < len(d.tier.quotas) {
		d.result.Remaining = min(left+d.cost, d.tier.quotas[j].N)
	}
}

// releaseSlot frees the request's slot, if it holds one.
func (h *Handler) releaseSlot(d *decision) {
	owner, from := h, d.slotFrom
	if from >= slotInRunningStore {
		o, _ := runningSlotOwners.LoadAndDelete(d)
		owner, from = o.(*Handler), from-(slotInRunningStore-slotInStore)
	}
	switch from {
	case noSlot:
		return
	case slotInLocal:
		owner.local.release(&d.bucket, d.slotID)
	default:
		owner.store.release(&d.bucket, d.slotID)
	}
	d.tier.inFlight.Dec()
	d.slotFrom = noSlot
}

// errClientGone ends a request whose client went away before it got a
// slot.
var errClientGone = errors.New("the client went away")

// appendConcurrencyItem appends the RateLimit item of the tier's in-flight
// limit, in the list that starts at start of buf: the slots left, when the
// request asked for a slot; it says nothing of the slots of a request
// refused before it asked.
func (d *decision) appendConcurrencyItem(buf []byte, start int) []byte {
	if d.slotFrom == noSlot && d.refusedBy != refusedNoSlot {
		return buf
	}
	buf = appendSeparator(buf, start)
	buf = append(buf, d.tier.concurrencyName...)
	buf = append(buf, ";r="...)
	return strconv.AppendInt(buf, int64(d.slotLeft), 10)
}
