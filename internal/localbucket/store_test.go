package localbucket

import (
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
func TestLocalTakeDoesNotAllocate(t *testing.T) {
	lb := newStore(1000, monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1, Interval: 1}}
	b := idFor("127.0.0.1")
	take(lb, b, l, 1)
	if allocs := testing.AllocsPerRun(1000, func() { take(lb, b, l, 1) }); allocs != 0 {
		t.Errorf("take on an existing bucket: %v allocations, want 0", allocs)
	}
}
