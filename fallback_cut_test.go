package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
)

// The cut bound of on_store_error local <share> [reconcile], over random
// traces: a fleet of provisioned handlers shares one bucket table (the
// shared store, on the test's clock), and some of them lose it for a
// while. Over every window T the fleet admits at most C + floor(rT) +
// n_cut x (floor(sC) + floor(s r T_c)); with deny, C + floor(rT); with
// reconcile, over the run, at most the run's allowance + 1%.

// errCut is a cut-off node's store failing.
var errCut = errors.New("cut off from the shared store")

// fleetStore is one node's link to the fleet's shared bucket table: it
// fails while the node is cut off. Every node's buckets are one bucket
// there, whatever the node's policy name (each node's fallback table is
// its policy's).
type fleetStore struct {
	shared *LocalStore
	cut    atomic.Bool
	// dropCharges is a mutation: reconcile's charges do nothing.
	dropCharges bool
}

func (s *fleetStore) name(b *Bucket) *Bucket {
	nb := *b
	// Renamed, the bucket's local id is hashed afresh (Bucket.prefix).
	nb.Policy, nb.prefix = "fleet", 0
	return &nb
}

func (s *fleetStore) take(ctx context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	if s.cut.Load() {
		return false, errCut
	}
	return s.shared.take(ctx, s.name(b), tr, cost, out)
}

func (s *fleetStore) peek(ctx context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error {
	if s.cut.Load() {
		return errCut
	}
	return s.shared.peek(ctx, s.name(b), tr, out)
}

func (s *fleetStore) giveBack(ctx context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error {
	if s.cut.Load() {
		return errCut
	}
	return s.shared.giveBack(ctx, s.name(b), tr, limitsN, n, at)
}

func (s *fleetStore) charge(ctx context.Context, b *Bucket, tr bucket.Tier, n int64) error {
	if s.cut.Load() {
		return errCut
	}
	if s.dropCharges {
		return nil
	}
	return s.shared.charge(ctx, s.name(b), tr, n)
}

func (s *fleetStore) reset(ctx context.Context, b *Bucket) error {
	return s.shared.reset(ctx, s.name(b))
}

func (s *fleetStore) acquire(ctx context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	return s.shared.acquire(ctx, s.name(b), n)
}

func (s *fleetStore) release(b *Bucket, slot uint64) { s.shared.release(s.name(b), slot) }

func (s *fleetStore) inFlight(ctx context.Context, b *Bucket) (int64, error) {
	return s.shared.inFlight(ctx, s.name(b))
}

// cutRun is one trace's setup: the fleet's limit, the fallback, the cut.
type cutRun struct {
	seed         uint64
	nodes, nCut  int
	capacity     int64
	perSecond    int64
	onStoreError string // the handlers' JSON fields
	dropCharges  bool
	cutFrom      time.Duration
	cutFor       time.Duration
	length       time.Duration
	// label names the run's policies apart from every other run's, whose
	// fallback tables stay until the test ends.
	label string
}

// admissions runs the trace and returns when each admitted request was
// admitted (µs of the test's clock, from the run's start): a hot key, from
// one client, at each step on a random node, every 0 to 40 ms.
func (c cutRun) admissions(t *testing.T) []int64 {
	t.Helper()
	rng := rand.New(rand.NewPCG(c.seed, 35))
	clock := newFakeClock()
	start := clock.now()
	shared := &LocalStore{buckets: localbucket.New(localOptions(1000, clock.clocks()))}
	links := make([]*fleetStore, c.nodes)
	handlers := make([]*Handler, c.nodes)
	for i := range handlers {
		cfg := fmt.Sprintf(`{
			"name": "cut-%d-%d-%s-%s",
			"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"]},
			%s,
			"tiers": [{"name": "t", "capacity": %d, "refill": "%d/s"}]
		}`, c.seed, i, c.label, t.Name(), freePort(t), c.onStoreError, c.capacity, c.perSecond)
		h, done := provisionedHandlerOn(t, clock.clocks(), cfg)
		t.Cleanup(done)
		links[i] = &fleetStore{shared: shared, dropCharges: c.dropCharges}
		h.store = links[i]
		if h.owed != nil {
			h.owed.store = links[i]
		}
		handlers[i] = h
	}
	var admitted []int64
	for now := time.Duration(0); now < c.length; now = time.Duration(clock.now()-start) * time.Microsecond {
		cut := now >= c.cutFrom && now < c.cutFrom+c.cutFor
		for i := range c.nCut {
			links[i].cut.Store(cut)
		}
		i := rng.IntN(c.nodes)
		w, _ := serveOne(handlers[i], benchRequest("198.51.100.1"), nopHandler)
		if h := handlers[i]; h.owed != nil {
			h.owed.wait() // the charges a success started, at this moment
		}
		if w.Code == http.StatusOK {
			admitted = append(admitted, clock.now()-start)
		}
		clock.advance(time.Duration(rng.IntN(40_001)) * time.Microsecond)
	}
	return admitted
}

// mostInWindow is the most admissions within any window of length w (µs),
// both ends included.
func mostInWindow(ts []int64, w int64) int64 {
	var most int64
	j := 0
	for i := range ts {
		for ts[i]-ts[j] > w {
			j++
		}
		most = max(most, int64(i-j+1))
	}
	return most
}

// windowsWithin checks every window of each length against bound(T), and
// says where one is over it.
func windowsWithin(ts []int64, bound func(w int64) int64) error {
	for _, w := range []time.Duration{100 * time.Millisecond, time.Second, 3 * time.Second, 7 * time.Second, time.Hour} {
		us := w.Microseconds()
		if got, most := mostInWindow(ts, us), bound(us); got > most {
			return fmt.Errorf("a window of %s admitted %d; the bound is %d", w, got, most)
		}
	}
	return nil
}

// TestTheCutBoundHoldsOverRandomTraces runs random traces of a fleet with
// some nodes cut off from the shared store, with local 1/nodes, deny, and
// local 1/nodes reconcile, checks the bounds, and checks that a broken
// fallback (the share not applied; reconcile charging nothing) breaks
// them.
func TestTheCutBoundHoldsOverRandomTraces(t *testing.T) {
	t.Parallel()
	const nodes, capacity, perSecond = 4, 20, 10
	seeds := []uint64{1, 2, 3}
	if !testing.Short() {
		seeds = append(seeds, 4, 5, 6, 7, 8)
	}
	for _, seed := range seeds {
		rng := rand.New(rand.NewPCG(seed, 0))
		base := cutRun{
			seed: seed, nodes: nodes, nCut: 1 + rng.IntN(2), capacity: capacity, perSecond: perSecond,
			cutFrom: time.Duration(2+rng.IntN(4)) * time.Second,
			cutFor:  time.Duration(2+rng.IntN(6)) * time.Second,
			length:  20 * time.Second,
		}
		t.Logf("seed %d: %d of %d nodes cut off for %s from %s", seed, base.nCut, nodes, base.cutFor, base.cutFrom)
		// floor(s C) and floor(s r T_c) with s = 1/nodes.
		sC := int64(capacity / nodes)
		srTc := perSecond * base.cutFor.Microseconds() / (nodes * 1e6)
		fleet := func(w int64) int64 { return capacity + perSecond*w/1e6 }
		cutBound := func(w int64) int64 { return fleet(w) + int64(base.nCut)*(sC+srTc) }
		runAllowance := fleet(base.length.Microseconds())

		local, whole := base, base
		local.label, whole.label = "local", "whole"
		local.onStoreError = `"on_store_error": "local", "on_store_error_share": "1/4"`
		whole.onStoreError = `"on_store_error": "local"` // the mutation: no share
		if err := windowsWithin(local.admissions(t), cutBound); err != nil {
			t.Errorf("seed %d, local 1/4: %v", seed, err)
		}
		if windowsWithin(whole.admissions(t), cutBound) == nil {
			t.Errorf("seed %d: local without the share kept within the share's bound: the check catches nothing", seed)
		}

		deny := base
		deny.label = "deny"
		deny.onStoreError = `"on_store_error": "deny"`
		if err := windowsWithin(deny.admissions(t), fleet); err != nil {
			t.Errorf("seed %d, deny: %v", seed, err)
		}

		rec, dropped := base, base
		rec.label, dropped.label = "reconcile", "dropped"
		rec.onStoreError = `"on_store_error": "local", "on_store_error_share": "1/4", "on_store_error_reconcile": true`
		dropped.onStoreError, dropped.dropCharges = rec.onStoreError, true // the mutation: nothing charged
		most := runAllowance + runAllowance/100
		got, gotDropped := int64(len(rec.admissions(t))), int64(len(dropped.admissions(t)))
		t.Logf("seed %d: over the run, %d admitted with reconcile, %d when it charges nothing; the allowance is %d", seed, got, gotDropped, runAllowance)
		if got > most {
			t.Errorf("seed %d, local 1/4 reconcile: %d admitted over the run; want at most %d (the allowance %d + 1%%)", seed, got, most, runAllowance)
		}
		if gotDropped <= most {
			t.Errorf("seed %d: reconcile charging nothing admitted %d, within %d: the check catches nothing", seed, gotDropped, most)
		}
	}
}
