package localbucket

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

func TestConcurrentBurstAdmitsCapacityPlusRefillExactly(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	lb := newStore(1000, clock.now)
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}} // 10/s
	b := idFor("127.0.0.1")

	burst := func() int64 {
		var allowed atomic.Int64
		var wg sync.WaitGroup
		for range 64 {
			wg.Go(func() {
				for range 10 {
					if take(lb, b, l, 1).Allowed {
						allowed.Add(1)
					}
				}
			})
		}
		wg.Wait()
		return allowed.Load()
	}
	if got := burst(); got != 100 {
		t.Fatalf("64 goroutines × 10 on a full bucket of 100: allowed %d, want 100", got)
	}
	clock.advance(1500 * time.Millisecond)
	if got := burst(); got != 15 {
		t.Fatalf("after 1.5 s at 10/s: allowed %d, want the refill, 15", got)
	}
}
func TestLocalStoreMatchesReferenceModel(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	lb := newStore(100, clock.now)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 100 {
		tr := buckettest.RandomTrace(rng)
		ref := buckettest.NewReference(tr.Limit)
		b := idFor("client-" + strconv.Itoa(i))
		for j := range tr.Gaps {
			clock.micros.Add(tr.Gaps[j])
			want := ref.Take(clock.now(), tr.Costs[j])
			if got := take(lb, b, tr.Limit, tr.Costs[j]); got != want {
				t.Fatalf("trace %d step %d: got %+v, want %+v", i, j, got, want)
			}
		}
	}
}
func TestMaxKeysBoundsMemoryUnderAFloodOfKeys(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	lb := newStore(1000, clock.now)
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	for i := range 50_000 {
		take(lb, idFor(strconv.Itoa(i)), l, 1)
		if n := lb.Len(); n > 1000 {
			t.Fatalf("after %d distinct keys: %d buckets held, want at most max_keys 1000", i+1, n)
		}
	}
	if lb.Evictions() < 49_000 {
		t.Errorf("evictions %d, want at least the 49000 keys over the bound", lb.Evictions())
	}
}
func TestFullBucketsAreDroppedBeforeLiveOnes(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	lb := newStore(100, clock.now)
	slow := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}} // 1/h
	fast := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000}}         // full again within 10 ms
	// Ten live clients that have spent their whole bucket.
	for i := range 10 {
		b := idFor("live-" + strconv.Itoa(i))
		for range 10 {
			take(lb, b, slow, 1)
		}
	}
	// Ninety that will have refilled.
	for i := range 90 {
		take(lb, idFor("idle-"+strconv.Itoa(i)), fast, 1)
	}
	clock.advance(time.Second)
	for i := range 50 {
		take(lb, idFor("new-"+strconv.Itoa(i)), fast, 1)
	}
	if got := lb.Evictions(); got != 0 {
		t.Errorf("evictions %d, want 0: full buckets were there to drop", got)
	}
	if got := lb.FullDrops(); got == 0 {
		t.Errorf("full drops 0, want some")
	}
	for i := range 10 {
		if res := take(lb, idFor("live-"+strconv.Itoa(i)), slow, 1); res.Allowed {
			t.Fatalf("live client %d was allowed: its empty bucket was dropped", i)
		}
	}
}

// Serial: AllocsPerRun counts every goroutine's allocations.
func TestLocalTakeDoesNotAllocate(t *testing.T) {
	lb := newStore(1000, monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1, Interval: 1}}
	b := idFor("127.0.0.1")
	take(lb, b, l, 1)
	if allocs := testing.AllocsPerRun(1000, func() { take(lb, b, l, 1) }); allocs != 0 {
		t.Errorf("take on an existing bucket: %v allocations, want 0", allocs)
	}
}

// banLimit is a login's limit: 3 attempts an hour, then a ban of 15
// minutes.
var banLimit = bucket.Limit{Capacity: 3, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}, Ban: 15 * 60_000_000}

// banned takes from id on l until a denial starts a ban, and returns that
// denial.
func banned(t *testing.T, s *Store, id uint64, l bucket.Limit) bucket.Result {
	t.Helper()
	for range l.Capacity + 1 {
		if res := take(s, id, l, 1); res.Banned {
			return res
		}
	}
	t.Fatalf("no ban after %d takes", l.Capacity+1)
	return bucket.Result{}
}

// Regression test: a flood of distinct keys could evict a banned state and
// lift its ban (docs/logins.md).
func TestABannedStateOutlivesAFloodOfDistinctKeys(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	const maxKeys = 100
	lb := newStore(maxKeys, clock.now)
	alice := idFor("alice")
	for i := range maxKeys - 1 {
		take(lb, idFor("user-"+strconv.Itoa(i)), banLimit, 1)
	}
	banned(t, lb, alice, banLimit)
	banEnd := clock.now() + banLimit.Ban
	// Each attempt on a new username is live (an hour's refill) and
	// harmless to the attacker: ten times the table over, in 10 s.
	for i := range 10 * maxKeys {
		clock.advance(10 * time.Millisecond)
		take(lb, idFor("flood-"+strconv.Itoa(i)), banLimit, 1)
		if n := lb.Len(); n > maxKeys {
			t.Fatalf("after %d flood keys: %d states held, want at most %d", i+1, n, maxKeys)
		}
	}
	if lb.Evictions() < 10*maxKeys-maxKeys {
		t.Errorf("evictions %d, want the flood's %d at least", lb.Evictions(), 9*maxKeys)
	}
	if res := take(lb, alice, banLimit, 1); res.Allowed {
		t.Fatalf("alice after the flood, %v into her ban: allowed, want refused", time.Duration(clock.now()-(banEnd-banLimit.Ban))*time.Microsecond)
	}
	if st, ok := lb.shard(alice).states.get(alice); !ok || !st.Banned {
		t.Fatalf("after the flood alice's state is %+v (held %v), want her banned state", st, ok)
	}
	clock.micros.Store(banEnd - 1)
	if res := take(lb, alice, banLimit, 1); res.Allowed || res.RetryAfter <= banLimit.Rate.Interval {
		t.Fatalf("a microsecond before the ban ends: %+v, want refused until the ban and a token's refill", res)
	}
	clock.micros.Store(banEnd + banLimit.Rate.Interval)
	if res := take(lb, alice, banLimit, 1); !res.Allowed {
		t.Fatalf("after the ban and a token's refill: %+v, want allowed", res)
	}
}

// flood takes once from n new distinct buckets of banLimit, 10 ms apart,
// each live for an hour.
func flood(t *testing.T, s *Store, clock *fakeClock, n int, maxKeys int) {
	t.Helper()
	for i := range n {
		clock.advance(10 * time.Millisecond)
		take(s, idFor("flood-"+strconv.Itoa(i)), banLimit, 1)
		if got := s.Len(); got > maxKeys {
			t.Fatalf("after %d flood keys: %d states held, want at most %d", i+1, got, maxKeys)
		}
	}
}

// A tier of several limits is banned in each of them (bucket.Refuse), and
// each limit's state outlives a flood, not only the first's.
// Regression test: a flood of distinct keys could lift a ban.
func TestEveryLimitOfABannedTierOutlivesAFloodOfDistinctKeys(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	const maxKeys = 100
	lb := newStore(maxKeys, clock.now)
	minute := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 30_000_000}, Ban: banLimit.Ban}
	tr := bucket.Tier{Limits: []bucket.Limit{banLimit, minute}}
	out := make([]bucket.Result, 2)
	alice := idFor("alice")
	lb.Take(alice, tr, 1, out)
	lb.Take(alice, tr, 1, out)
	if lb.Take(alice, tr, 1, out) || !out[0].Banned {
		t.Fatalf("the third attempt, past the second limit: %+v, want refused, starting a ban", out)
	}
	banEnd := clock.now() + banLimit.Ban
	flood(t, lb, clock, 10*maxKeys, maxKeys)
	for i := range tr.Limits {
		if st, ok := lb.shard(alice).states.get(limitID(alice, i)); !ok || !st.Banned {
			t.Errorf("after the flood, limit %d's state is %+v (held %v), want banned", i, st, ok)
		}
	}
	if lb.Take(alice, tr, 1, out) {
		t.Fatalf("alice after the flood: allowed %+v, want refused", out)
	}
	clock.micros.Store(banEnd + banLimit.Rate.Interval)
	if !lb.Take(alice, tr, 1, out) {
		t.Fatalf("after the ban and a token's refill: %+v, want allowed", out)
	}
}

// TestEvictionLiftsABanOnlyWhenItsShardHoldsNothingElseLive runs random
// traces of takes over a pool of clients on a store of a small max_keys:
// single takes, runs of takes that start bans, steps of the clock. After
// every step no ban started has been lifted (its state dropped, so that the
// client is admitted) before it ends, unless the step's eviction left no
// live state of its shard that was not banned, and the store holds at most
// max_keys states. The old eviction order, which picked live states
// regardless of bans, is caught.
func TestEvictionLiftsABanOnlyWhenItsShardHoldsNothingElseLive(t *testing.T) {
	t.Parallel()
	lifted := 0
	for seed := range uint64(20) {
		n, err := banTrace(seed, bannedBit, 1)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		lifted += n
	}
	t.Logf("20 traces held, seeds 0 to 19; %d bans dropped from shards with nothing else live", lifted)
	if lifted == 0 {
		t.Errorf("no trace filled a shard with bans: the bound's last resort went untried")
	}
	caught := 0
	for seed := range uint64(20) {
		if _, err := banTrace(seed, 0, 1); err != nil {
			caught++
			if caught == 1 {
				t.Logf("the old eviction order, seed %d: %v", seed, err)
			}
		}
	}
	t.Logf("the old eviction order is caught in %d of 20 traces", caught)
	if caught == 0 {
		t.Errorf("the old eviction order (no state spared) passed every trace")
	}
}

// banTrace runs the trace of seed on a store that spares from eviction the
// live states whose slack has a bit of spare set, on a tier of one limit
// or of two (limits), and returns the first broken promise, or how many
// bans it saw dropped from a shard with nothing else live.
func banTrace(seed uint64, spare uint32, limits int) (int, error) {
	rng := rand.New(rand.NewPCG(seed, 41))
	clock := new(fakeClock)
	clock.micros.Store(1)
	maxKeys := 16 + rng.IntN(48)
	s := newStore(maxKeys, clock.now)
	s.spare = spare
	l := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 20_000_000}, Ban: 60_000_000}
	tr := lone(l)
	if limits == 2 {
		// A first limit full long before the second, so that a take
		// finds the first's state dropped and the second's full.
		tr = bucket.Tier{Limits: []bucket.Limit{{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}, Ban: l.Ban}, l}}
	}
	// Ids from the trace's seed, not the process's hasher, so that the
	// trace is the same every run.
	pool := make([]uint64, 4*maxKeys)
	for i := range pool {
		pool[i] = rng.Uint64()
	}
	banEnds := make(map[uint64]int64) // ban started, by client: when it ends
	// Some traces ban at most takes, so that whole shards are banned.
	banOdds := []int{1, 2, 6}[seed%3]
	lifted := 0
	out := make([]bucket.Result, limits)
	for step := range 4000 {
		if rng.IntN(8) == 0 {
			clock.micros.Add(rng.Int64N(10_000_000))
			continue
		}
		id := pool[rng.IntN(len(pool))]
		takes := 1
		if rng.IntN(banOdds) == 0 {
			takes = int(tr.Limits[0].Capacity) + 1
		}
		for range takes {
			sh := s.shard(id)
			now := clock.now()
			// The shard's other live states that no ban wrote, before the
			// take.
			var others, bans []uint64
			for i, key := range sh.states.keys {
				st := sh.states.at(i)
				if key == 0 || key == tableKey(id) || key == tableKey(limitID(id, 1)) || st.FullAt <= now {
					continue
				}
				if st.Banned {
					bans = append(bans, key)
				} else {
					others = append(others, key)
				}
			}
			if s.Take(id, tr, 1, out); out[0].Banned {
				banEnds[id] = now + l.Ban
			}
			if n := s.Len(); n > maxKeys || n != held(s) {
				return 0, fmt.Errorf("step %d: %d states counted, %d held, want as many, at most max_keys %d", step, n, held(s), maxKeys)
			}
			if limits > 1 {
				// Each limit's banned state, live before the take, is
				// dropped only when no live state no ban wrote is left.
				for _, key := range bans {
					if _, ok := sh.states.get(key); ok {
						continue
					}
					for _, other := range others {
						if _, ok := sh.states.get(other); ok {
							return 0, fmt.Errorf("step %d: a limit's banned state was dropped while the shard kept a live state no ban wrote (max_keys %d)", step, maxKeys)
						}
					}
					lifted++
				}
				continue
			}
			for b, end := range banEnds {
				if end <= now {
					delete(banEnds, b)
					continue
				}
				if s.shard(b) != sh {
					continue
				}
				if st, ok := sh.states.get(b); ok && st.Banned {
					s.Peek(b, tr, out)
					if out[0].Allowed {
						return 0, fmt.Errorf("step %d: a banned state admits: %+v", step, out[0])
					}
					continue
				}
				for _, key := range others {
					if _, ok := sh.states.get(key); ok {
						return 0, fmt.Errorf("step %d: a ban %v from its end was dropped while the shard kept a live state no ban wrote (max_keys %d)", step, time.Duration(end-now)*time.Microsecond, maxKeys)
					}
				}
				delete(banEnds, b) // lifted with nothing else live to drop
				lifted++
			}
		}
	}
	return lifted, nil
}

// held counts the states the store's tables hold, whatever its count says.
func held(s *Store) int {
	n := 0
	for i := range s.shards {
		n += s.shards[i].states.n
	}
	return n
}

// A take on a tier of several limits whose first limit's state is gone
// and whose second's is full makes room for the first; that sweep drops
// the second's full state, which the take then writes back: a new state,
// counted as one.
// Regression test: such takes were not counted, and the store outgrew
// max_keys by one each.
func TestAMultiLimitTakeThatEvictsItsOwnFullStateStaysWithinMaxKeys(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	const maxKeys = 64
	s := newStore(maxKeys, clock.now)
	second := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	hour := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	tr := bucket.Tier{Limits: []bucket.Limit{second, hour}}
	out := make([]bucket.Result, 2)
	next := 0
	fill := func() { // new lone buckets of an hour, until a take must make room
		for s.Len() < maxKeys {
			take(s, idFor("fill-"+strconv.Itoa(next)), hour, 1)
			next++
		}
	}
	for round := range 20 {
		alice := idFor("alice-" + strconv.Itoa(round))
		fill()
		s.Take(alice, tr, 1, out)
		// Her first limit is full in a second, and the sweep of the next
		// take that makes room drops it; her second stays live an hour.
		clock.advance(2 * time.Second)
		fill()
		take(s, idFor("fill-"+strconv.Itoa(next)), hour, 1)
		next++
		if _, ok := s.shard(alice).states.get(alice); ok {
			t.Fatalf("round %d: her first limit's full state outlived a sweep", round)
		}
		// An hour on, her second limit's state is full, and still held.
		clock.advance(time.Hour)
		fill()
		if _, ok := s.shard(alice).states.get(limitID(alice, 1)); !ok {
			t.Fatalf("round %d: her second limit's state is gone before her take", round)
		}
		if !s.Take(alice, tr, 1, out) {
			t.Fatalf("round %d: alice refused %+v, want allowed", round, out)
		}
		fill()
		if got := held(s); got != s.Len() || got > maxKeys {
			t.Fatalf("round %d: the tables hold %d states, the store counts %d, max_keys %d", round, got, s.Len(), maxKeys)
		}
	}
}

// A flood in which every client gets itself banned, on a table full of
// bans, sweeps the table (a few passes over its slots, Store.makeRoom) at
// most once per a 64th of max_keys new clients: each sweep still frees a
// 32nd of the shard, bans included, so a client's cost stays flat however
// large the table (BenchmarkFloodOfBannedKeys).
func TestAFloodOfBannedKeysSweepsOnceInManyInserts(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	const maxKeys = 500 // one shard
	s := newStore(maxKeys, clock.now)
	if len(s.shards) != 1 {
		t.Fatalf("%d shards, want 1", len(s.shards))
	}
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}, Ban: 3_600_000_000}
	rng := rand.New(rand.NewPCG(7, 41))
	ban := func() {
		id := rng.Uint64()
		take(s, id, l, 1)
		if res := take(s, id, l, 1); !res.Banned {
			t.Fatalf("the second take: %+v, want a ban started", res)
		}
	}
	for range maxKeys {
		ban()
	}
	const clients = 20 * maxKeys
	sweeps := 0
	for range clients {
		before := s.Len()
		ban()
		if s.Len() <= before {
			sweeps++ // the insert made room
		}
		if s.Len() > maxKeys {
			t.Fatalf("%d states held, want at most %d", s.Len(), maxKeys)
		}
	}
	if most := clients / (maxKeys / 64); sweeps > most {
		t.Fatalf("%d new banned clients swept the table %d times, want at most %d: a sweep per %d clients", clients, sweeps, most, maxKeys/64)
	}
	t.Logf("%d new banned clients, %d sweeps", clients, sweeps)
}

// TestEvictionLiftsABanOfATierOfTwoLimitsOnlyWhenItsShardHoldsNothingElseLive
// is TestEvictionLiftsABanOnlyWhenItsShardHoldsNothingElseLive on a tier
// of two limits, a fast one first, whose takes often find the first
// limit's state dropped and the second's full: the states held stay
// counted exactly, within max_keys, and no ban is dropped while its shard
// keeps a live state no ban wrote. The old eviction order is caught.
func TestEvictionLiftsABanOfATierOfTwoLimitsOnlyWhenItsShardHoldsNothingElseLive(t *testing.T) {
	t.Parallel()
	lifted, caught := 0, 0
	for seed := range uint64(20) {
		n, err := banTrace(seed, bannedBit, 2)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		lifted += n
		if _, err := banTrace(seed, 0, 2); err != nil {
			caught++
		}
	}
	t.Logf("20 traces held, seeds 0 to 19; %d bans dropped from shards with nothing else live; the old eviction order caught in %d", lifted, caught)
	if lifted == 0 || caught == 0 {
		t.Errorf("%d bans dropped as a last resort, the old eviction order caught in %d traces: want some of each", lifted, caught)
	}
}

// A reload that lowers max_keys far below the states held (SetMaxKeys)
// shrinks the table to the new bound as new clients arrive, by one a
// client at least, though each shard holds too few states for a 32nd of
// them to be more than one: within the bound, but for a shard with
// nothing to drop, which holds the one state a new client there adds.
// Regression test: each new client dropped one state, and the table kept
// ten times its new bound for good.
func TestLoweringMaxKeysShrinksTheTableToTheNewBound(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	clock.micros.Store(1)
	s := newStore(100_000, clock.now)
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	rng := rand.New(rand.NewPCG(5, 41))
	for range 2000 {
		take(s, rng.Uint64(), l, 1)
	}
	const lowered = 200
	s.SetMaxKeys(lowered)
	most := lowered + len(s.shards)
	// The excess, 1800, goes at one a client at least.
	for i := range 4000 {
		take(s, rng.Uint64(), l, 1)
		if i >= 2000 && (s.Len() > most || held(s) != s.Len()) {
			t.Fatalf("%d clients after max_keys was lowered to %d: %d states counted, %d held, want at most %d (one a shard over)", i+1, lowered, s.Len(), held(s), most)
		}
	}
}
