package redisbucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"go.uber.org/zap"
)

// A request found by its bucket's id (takeByID) is decided as the same
// request found by its key: two nodes, each on its own copy of the model
// store and on one clock, one asking by id first and the other by key,
// play the same random traces (requests of cost 1 to 3 on six keys, clock
// steps past lease_ttl, resets, a table small enough to evict, keys whose
// ids share a hint's slot, credit or none, a ban setting, a quota whose
// period ends, a second limit) and answer alike at every request, holding the
// same tokens after it. The id way must decide most requests, or the test
// shows nothing; and a node that spends by id from a dropped entry (the
// mutation) must answer apart.
func TestALeasedRequestFoundByIDIsDecidedAsByKey(t *testing.T) {
	byID := 0
	for seed := range uint64(20) {
		n, err := playByIDAndByKey(seed, false)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		byID += n
	}
	if byID < 1000 {
		t.Errorf("%d requests decided by id over the traces; want most of them", byID)
	}
	caught := false
	for seed := range uint64(20) {
		if _, err := playByIDAndByKey(seed, true); err != nil {
			caught = true
			break
		}
	}
	if !caught {
		t.Error("a node that spends by id from a dropped entry answered as by key: the test cannot fail")
	}
}

// playByIDAndByKey plays one trace on the two nodes and reports how many
// requests the id way decided, or the first difference. staleHints is the
// mutation: an entry dropped from its shard is still found by id.
func playByIDAndByKey(seed uint64, staleHints bool) (int, error) {
	rng := rand.New(rand.NewPCG(seed, 34))
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 20_000}}
	tr := bucket.Tier{Limits: []bucket.Limit{l}}
	switch seed % 4 {
	case 1:
		tr.Limits[0].Ban = 300_000
	case 2:
		// A day's quota, crossed by a trace started near its end.
		tr.Quotas = []bucket.Quota{{N: 150, Period: bucket.Day, Loc: time.UTC}}
		_, end := tr.Quotas[0].Bounds(0)
		clock.micros.Store(end - 20_000_000)
	case 3:
		tr.Limits = append(tr.Limits, bucket.Limit{Capacity: 60, Rate: bucket.Rate{Tokens: 1, Interval: 30_000}})
	}
	tables := [2]*leaseTable{}
	for i := range tables {
		// 64 entries: one a shard, so that keys of one shard evict each
		// other.
		tables[i] = newLeaseTable(newSharedModel(clock.now), clock.now, LeaseSize{tokens: 8}, time.Second, 100*time.Millisecond, 64, zap.NewNop())
		tables[i].jitter = rand.New(rand.NewPCG(seed, 1)).Int64N
		// A new key's first requests on credit, in a third of the traces.
		tables[i].credit = int64(seed%3) * 2
	}
	// One seed, so that the same keys share a shard, and evict each other,
	// in both.
	tables[1].seed = tables[0].seed
	defer tables[0].close()
	defer tables[1].close()
	keys := make([][]byte, 6)
	ids := make([]uint64, len(keys))
	for k := range keys {
		keys[k] = []byte("rl:{p}:t:" + strconv.Itoa(k))
		// Keys 0 and 1, 2 and 3, 4 and 5 share a hint's slot.
		ids[k] = 1 + uint64(k/2) + uint64(k%2)*hintSlots
	}
	decided := 0
	for step := range 400 {
		k := rng.IntN(len(keys))
		switch op := rng.IntN(100); {
		case op < 75:
			cost := 1 + rng.Int64N(3)
			var res [2]bucket.Result
			var outs [2][]bucket.Result
			var errs [2]error
			for i, tb := range tables {
				out := make([]bucket.Result, tr.Parts())
				outs[i] = out
				if i == 0 {
					if staleHints {
						reviveHint(tb, ids[k])
					}
					r, ok := tb.takeByID(ids[k], tr, cost, out)
					if ok {
						decided++
						res[i] = r
						tableSync(tb)
						continue
					}
					res[i], errs[i] = tb.takeNamed(context.Background(), keys[k], ids[k], tr, cost, out)
				} else {
					res[i], errs[i] = tb.take(context.Background(), keys[k], tr, cost, out)
				}
				tableSync(tb)
			}
			if res[0] != res[1] || !slices.Equal(outs[0], outs[1]) || (errs[0] == nil) != (errs[1] == nil) {
				return decided, fmt.Errorf("step %d, key %d, cost %d: by id %+v %+v (%v), by key %+v %+v (%v)", step, k, cost, res[0], outs[0], errs[0], res[1], outs[1], errs[1])
			}
			if a, b := tables[0].heldNow(keys[k]), tables[1].heldNow(keys[k]); a != b {
				return decided, fmt.Errorf("step %d, key %d: %d tokens held by id, %d by key", step, k, a, b)
			}
		case op < 97:
			clock.advance(time.Duration(rng.IntN(400)) * time.Millisecond)
		default:
			for _, tb := range tables {
				tb.reset(keys[k])
			}
		}
	}
	return decided, nil
}

// reviveHint is the mutation of playByIDAndByKey: the entry id's hint
// points to counts as never dropped.
func reviveHint(tb *leaseTable, id uint64) {
	if e := tb.hints[id%hintSlots].Load(); e != nil && e.id == id {
		e.shard.mu.Lock()
		e.gone = false
		e.shard.mu.Unlock()
	}
}

// The fleet bound, over the traces of the lease property tests (single
// limits, tiers of several limits and a quota whose period ends; bans,
// max_wait, give-backs, huge charges, reloads mid-call, a store that goes
// down), with every node deciding each request as the root does: by the
// bucket's id first. No request the tokens held cover may go by key, and
// the property must catch an id way that spends a lapsed lease.
func TestLeasesFoundByIDNeverAdmitMoreThanOneBucketOverAnyWindow(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name  string
		round func(rng *rand.Rand, steps int) fleetRound
	}{
		{"one limit", func(rng *rand.Rand, steps int) fleetRound { return randomFleetRound(rng, steps) }},
		{"tiers", func(rng *rand.Rand, steps int) fleetRound { return withTier(rng, randomFleetRound(rng, steps)) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			way := new(idWay)
			playRounds(t, rand.New(rand.NewPCG(40, 2)), 150, func(rng *rand.Rand, steps int) fleetRound {
				r := tt.round(rng, steps)
				r.byID = way
				return r
			})
			// A request that went by key while the tokens held covered it
			// is one the id way missed.
			if way.fromHeld > 0 || way.decided < way.allowed/4 {
				t.Errorf("%d requests decided by id, %d allowed by key, %d of them covered by the tokens held", way.decided, way.allowed, way.fromHeld)
			}
			t.Logf("%d requests decided by id, %d allowed by key", way.decided, way.allowed)
		})
	}
	t.Run("mutation: the id way spends a lapsed lease", func(t *testing.T) {
		rng := rand.New(rand.NewPCG(40, 2))
		for round := range 300 {
			r := randomFleetRound(rng, 800)
			r.byID = &idWay{spendLapsed: true}
			if err := runFleet(rng, r); err != nil {
				t.Logf("caught in round %d: %v", round, err)
				return
			}
		}
		t.Fatal("no round caught an id way that spends a lapsed lease")
	})
}

// The window bound under concurrency (runConcurrentFleet), with every
// request decided by id first: requests of one instant spend by id beside
// calls in flight, give-backs, sweeps, reloads and outages, and, in every
// other round, beside other clients whose ids share the bucket's hint
// slot and whose entries evict the bucket's. Under -race, it checks too
// that takeByID reads nothing the table writes unlocked.
func TestAConcurrentFleetFoundByIDKeepsTheWindowBound(t *testing.T) {
	t.Parallel()
	rounds := 40
	if testing.Short() {
		rounds = 10
	}
	rng := rand.New(rand.NewPCG(40, 7))
	way := new(idWay)
	for round := range rounds {
		r := randomFleetRound(rng, 0)
		r.byID = way
		if err := runConcurrentFleet(rng, r, 150, round%2 == 1); err != nil {
			t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes): %v", round, r.limit, r.size, r.ttl, r.nodes, err)
		}
	}
	if way.decided == 0 {
		t.Error("no request was decided by id: the test shows nothing")
	}
	t.Logf("%d requests decided by id", way.decided)
}

// Requests by id race the table's resets, evictions and sweeps, then, at
// a quiet moment, admin resets (the shared bucket's and the node's entry)
// start some keys over, and the table is closed at the end: on every key,
// the node admits no more than the shared bucket's capacity between two
// resets (nothing refills), though keys that share a shard evict each
// other and share hint slots, and a reset of the node's entry alone
// (Store.Forget) drops its tokens while requests are out. Under -race, it
// checks too that the id way reads nothing the table writes unlocked. A
// node that spends by id from a dropped entry (the mutation) is caught.
func TestRequestsByIDRacingResetsEvictionsAndCloseAdmitNoMoreThanTheBucket(t *testing.T) {
	t.Parallel()
	for _, stale := range []bool{false, true} {
		over := false
		for seed := range uint64(8) {
			n, err := raceByID(seed, stale)
			if err != nil && !stale {
				t.Fatalf("seed %d: %v", seed, err)
			}
			if !stale && n == 0 {
				t.Fatalf("seed %d: no request was decided by id", seed)
			}
			if err != nil {
				t.Logf("the mutation is caught at seed %d: %v", seed, err)
				over = true
				break
			}
		}
		if stale && !over {
			t.Error("a node that spends by id from a dropped entry kept within the capacity: the test cannot fail")
		}
	}
}

// raceByID plays one race of
// TestRequestsByIDRacingResetsEvictionsAndCloseAdmitNoMoreThanTheBucket
// and reports how many requests the id way decided, or a key's admissions
// over capacity. staleHints is the mutation, as in playByIDAndByKey.
func raceByID(seed uint64, staleHints bool) (int64, error) {
	const capacity, nkeys = 12, 24
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	tr := oneLimit(bucket.Limit{Capacity: capacity, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}})
	m := newSharedModel(clock.now)
	// One entry a shard: keys of one shard evict each other.
	tb := newLeaseTable(m, clock.now, LeaseSize{tokens: 6}, time.Second, 100*time.Millisecond, leaseShards, zap.NewNop())
	var jmu sync.Mutex
	jitter := rand.New(rand.NewPCG(seed, 2))
	tb.jitter = func(n int64) int64 {
		// Calls land under different shards' locks at once.
		jmu.Lock()
		defer jmu.Unlock()
		return jitter.Int64N(n)
	}
	keyOf := func(k int) []byte { return []byte("rl:{p}:t:" + strconv.Itoa(k)) }
	// Keys k, k+8 and k+16 share a hint slot.
	idOf := func(k int) uint64 { return 1 + uint64(k%8) + uint64(k/8)*hintSlots }
	var admitted [nkeys]atomic.Int64
	var byID atomic.Int64
	rng := rand.New(rand.NewPCG(seed, 99))
	for round := range 12 {
		// Light rounds leave the entries holding tokens, for the admin
		// resets after them; heavy ones use up every bucket.
		requests := 10
		if round%2 == 1 {
			requests = 120
		}
		var wg sync.WaitGroup
		for w := range 6 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(seed, uint64(round*6+w)))
				for range requests {
					k := rng.IntN(nkeys)
					cost := 1 + rng.Int64N(2)
					if staleHints {
						reviveHint(tb, idOf(k))
					}
					res, ok := tb.takeByID(idOf(k), tr, cost, nil)
					if ok {
						byID.Add(1)
					} else {
						var err error
						if res, err = tb.takeNamed(bg, keyOf(k), idOf(k), tr, cost, nil); err != nil {
							continue
						}
					}
					if res.Allowed {
						admitted[k].Add(cost)
					}
				}
			})
		}
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(1000+round)))
			for range 20 {
				// The node's entry alone: the shared bucket counts its
				// tokens as spent.
				tb.reset(keyOf(rng.IntN(nkeys)))
				if back := tb.sweep(clock.now(), false); len(back) > 0 {
					tb.giveBackNow(back)
				}
			}
		})
		wg.Wait()
		tableSync(tb)
		for k := range admitted {
			if n := admitted[k].Load(); n > capacity {
				return byID.Load(), fmt.Errorf("round %d, key %d: %d tokens admitted from a bucket of %d that never refilled", round, k, n, capacity)
			}
		}
		// Admin resets, after a light round of every key, else of a third
		// of them: each starts over.
		for i := range nkeys {
			k := i
			if round%2 == 1 {
				if i >= nkeys/3 {
					break
				}
				k = rng.IntN(nkeys)
			}
			m.mu.Lock()
			delete(m.states, string(keyOf(k)))
			m.mu.Unlock()
			tb.reset(keyOf(k))
			admitted[k].Store(0)
		}
	}
	var wg sync.WaitGroup
	// The config unloads while requests still come.
	for k := range nkeys {
		wg.Go(func() { tb.takeByID(idOf(k), tr, 1, nil) })
	}
	tb.close()
	wg.Wait()
	return byID.Load(), nil
}
