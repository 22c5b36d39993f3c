package ratelimit

import (
	"context"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func bucketFor(value string) *Bucket {
	return &Bucket{Policy: "p", Tier: "default", Keyer: "ip/32/64", Value: []byte(value)}
}

func TestConcurrentBurstAdmitsCapacityPlusRefillExactly(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	lb := newLocalBuckets(1000, clock.now)
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}} // 10/s
	b := bucketFor("127.0.0.1")

	burst := func() int64 {
		var allowed atomic.Int64
		var wg sync.WaitGroup
		for range 64 {
			wg.Go(func() {
				for range 10 {
					if lb.take(b, l, 1).Allowed {
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
	lb := newLocalBuckets(100, clock.now)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range 100 {
		tr := buckettest.RandomTrace(rng)
		ref := buckettest.NewReference(tr.Limit)
		b := bucketFor("client-" + strconv.Itoa(i))
		for j := range tr.Gaps {
			clock.micros.Add(tr.Gaps[j])
			want := ref.Take(clock.now(), tr.Costs[j])
			if got := lb.take(b, tr.Limit, tr.Costs[j]); got != want {
				t.Fatalf("trace %d step %d: got %+v, want %+v", i, j, got, want)
			}
		}
	}
}

func TestMaxKeysBoundsMemoryUnderAFloodOfKeys(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1)
	lb := newLocalBuckets(1000, clock.now)
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	for i := range 50_000 {
		lb.take(bucketFor(strconv.Itoa(i)), l, 1)
		if n := lb.len(); n > 1000 {
			t.Fatalf("after %d distinct keys: %d buckets held, want at most max_keys 1000", i+1, n)
		}
	}
	if lb.evictions.Load() < 49_000 {
		t.Errorf("evictions %d, want at least the 49000 keys over the bound", lb.evictions.Load())
	}
}

func TestFullBucketsAreDroppedBeforeLiveOnes(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1)
	lb := newLocalBuckets(100, clock.now)
	slow := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}} // 1/h
	fast := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000}}         // full again within 10 ms
	// Ten live clients that have spent their whole bucket.
	for i := range 10 {
		b := bucketFor("live-" + strconv.Itoa(i))
		for range 10 {
			lb.take(b, slow, 1)
		}
	}
	// Ninety that will have refilled.
	for i := range 90 {
		lb.take(bucketFor("idle-"+strconv.Itoa(i)), fast, 1)
	}
	clock.advance(time.Second)
	for i := range 50 {
		lb.take(bucketFor("new-"+strconv.Itoa(i)), fast, 1)
	}
	if got := lb.evictions.Load(); got != 0 {
		t.Errorf("evictions %d, want 0: full buckets were there to drop", got)
	}
	if got := lb.fullDrops.Load(); got == 0 {
		t.Errorf("full drops 0, want some")
	}
	for i := range 10 {
		if res := lb.take(bucketFor("live-"+strconv.Itoa(i)), slow, 1); res.Allowed {
			t.Fatalf("live client %d was allowed: its empty bucket was dropped", i)
		}
	}
}

func TestLocalTakeDoesNotAllocate(t *testing.T) {
	lb := newLocalBuckets(1000, monotonicMicros)
	l := bucket.Limit{Capacity: 1 << 30, Rate: bucket.Rate{Tokens: 1, Interval: 1}}
	b := bucketFor("127.0.0.1")
	lb.take(b, l, 1)
	if allocs := testing.AllocsPerRun(1000, func() { lb.take(b, l, 1) }); allocs != 0 {
		t.Errorf("take on an existing bucket: %v allocations, want 0", allocs)
	}
}

func TestResetRefillsABucket(t *testing.T) {
	s := new(LocalStore)
	s.buckets = newLocalBuckets(10, monotonicMicros)
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	b := bucketFor("127.0.0.1")
	ctx := context.Background()
	if res, _ := s.Take(ctx, b, l, 1); !res.Allowed {
		t.Fatal("first request denied")
	}
	if res, _ := s.Peek(ctx, b, l); res.Allowed || res.Remaining != 0 {
		t.Fatalf("peek after the only token: %+v, want 0 remaining", res)
	}
	if err := s.Reset(ctx, b); err != nil {
		t.Fatal(err)
	}
	if res, _ := s.Take(ctx, b, l, 1); !res.Allowed {
		t.Fatal("request after reset denied")
	}
}

func TestBucketsOfDifferentTiersAndKeyersAreApart(t *testing.T) {
	lb := newLocalBuckets(100, monotonicMicros)
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	for _, b := range []*Bucket{
		{Policy: "p", Tier: "a", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "b", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "a", Keyer: "header/X-Key", Value: []byte("x")},
		{Policy: "q", Tier: "a", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "a", Keyer: "ip/32/64", Value: []byte("y")},
	} {
		if !lb.take(b, l, 1).Allowed {
			t.Errorf("bucket %+v shares a bucket with an earlier one", b)
		}
	}
}
