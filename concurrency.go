package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strconv"
	"sync"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"go.uber.org/zap"
)

// In-flight limits (README: Protect a slow origin): with concurrency, a
// tier lets at most n of one client's requests be in flight, from when
// rate_limit passes the request on until the handlers after it return. A
// request takes its rate tokens first, then a slot; refused a slot, it
// gives its tokens back, so that it takes all or nothing. The slot is
// freed on every path, panics included (settle.go).

// SlotStore is a store that counts a bucket's requests in flight.
type SlotStore interface {
	// Acquire takes one of n slots of the bucket: it reports whether it
	// got one, how many are in use with it, and the slot to free.
	Acquire(ctx context.Context, b *Bucket, n int64) (slot uint64, inUse int64, ok bool, err error)
	// Release frees a slot Acquire gave.
	Release(b *Bucket, slot uint64)
	// InFlight is the bucket's slots in use.
	InFlight(ctx context.Context, b *Bucket) (int64, error)
}

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
	slot, inUse, ok, err := h.slots.Acquire(r.Context(), &d.bucket, n)
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
			slot, inUse, ok, err = owner.slots.Acquire(r.Context(), &d.bucket, n)
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
		owner.storeErrors.Inc()
		owner.storeLog.Warn("rate limit store failed to count requests in flight", zap.String("policy", h.Name), zap.String("on_store_error", owner.OnStoreError), zap.Error(err))
		switch owner.OnStoreError {
		case "allow":
			return res, nil
		case "deny":
			if h.DryRun {
				// A dry run never refuses: it goes on without a slot.
				return res, nil
			}
			h.giveBackTaken(r, d, "store failed")
			return res, errStoreDown
		}
		from = slotInLocal
		slot, inUse, ok, _ = owner.local.Acquire(r.Context(), &d.bucket, n)
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
	liveHandlers.Lock()
	defer liveHandlers.Unlock()
	hs := liveHandlers.byPolicy[policy]
	for i := len(hs) - 1; i >= 0; i-- {
		if hs[i].slots == nil || slices.Contains(tried, hs[i]) {
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
	for i, l := range d.tier.limits {
		if d.limits != nil {
			d.limits[i].Remaining = min(d.limits[i].Remaining+d.cost, l.Capacity)
		}
	}
	if int(d.binding) < len(d.tier.limits) {
		d.result.Remaining = min(d.result.Remaining+d.cost, d.tier.limits[d.binding].Capacity)
	} else if j := int(d.binding) - len(d.tier.limits); j < len(d.tier.quotas) {
		d.result.Remaining = min(d.result.Remaining+d.cost, d.tier.quotas[j].N)
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
		owner.local.Release(&d.bucket, d.slotID)
	default:
		owner.slots.Release(&d.bucket, d.slotID)
	}
	d.tier.inFlight.Dec()
	d.slotFrom = noSlot
}

// errClientGone ends a request whose client went away before it got a
// slot.
var errClientGone = errors.New("the client went away")

// errStoreDown answers a request whose slot the store could not count,
// with on_store_error deny.
var errStoreDown = errors.New("rate limit store unavailable")

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

// Acquire implements SlotStore: the count is kept beside the policy's
// buckets, under the same shard lock, only while requests are in flight.
func (s *LocalStore) Acquire(_ context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	inUse, ok := s.buckets.Acquire(localID(b), n)
	return 0, inUse, ok, nil
}

// Release implements SlotStore.
func (s *LocalStore) Release(b *Bucket, _ uint64) { s.buckets.Release(localID(b)) }

// InFlight implements SlotStore.
func (s *LocalStore) InFlight(_ context.Context, b *Bucket) (int64, error) {
	return s.buckets.InFlight(localID(b)), nil
}

// Acquire implements SlotStore.
func (s *RedisStore) Acquire(ctx context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	var buf [192]byte
	return s.engine.Acquire(ctx, s.key(buf[:0], b), n)
}

// Release implements SlotStore.
func (s *RedisStore) Release(b *Bucket, slot uint64) {
	var buf [192]byte
	s.engine.Release(s.key(buf[:0], b), slot)
}

// InFlight implements SlotStore.
func (s *RedisStore) InFlight(ctx context.Context, b *Bucket) (int64, error) {
	var buf [192]byte
	return s.engine.InFlight(ctx, s.key(buf[:0], b))
}

// Interface guards
var (
	_ SlotStore = (*LocalStore)(nil)
	_ SlotStore = (*RedisStore)(nil)
)
