package localbucket

import (
	"encoding/binary"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Benchmarks of the engine on the hot path. Each request hashes its
// bucket's name into an id first, as the root's LocalStore does, so that
// the figures are one request's whole cost in the store. Results and the
// commands that produced them are in bench/README.md.

// benchID is the id of the bucket of value, as the root's LocalStore
// hashes it (ID).
func benchID(value []byte) uint64 { return ID(idSeed, "p", "default", "ip/32/64", value) }

// BenchmarkLocalTake is a take that reads the store's clock, as Take
// does: the hash, the clock read and the take.
func BenchmarkLocalTake(b *testing.B) {
	s := newStore(defaultMaxKeys, monotonicMicros)
	tr := lone(bucket.Limit{Capacity: 1 << 40, Rate: bucket.Rate{Tokens: 1, Interval: 1}})
	value := []byte("127.0.0.1")
	var out [1]bucket.Result
	b.ReportAllocs()
	for b.Loop() {
		s.Take(benchID(value), tr, 1, out[:])
	}
}

// BenchmarkLocalTakeAt is the take of a request whose handler read the
// clock already (TakeAt, as LocalStore.takeAt): the hash and the take.
// The moment is read once a thousand takes, so that it moves.
func BenchmarkLocalTakeAt(b *testing.B) {
	s := New(Options{MaxKeys: defaultMaxKeys, Now: monotonicMicros, Wall: wallMicros, CallersClocks: true})
	tr := lone(bucket.Limit{Capacity: 1 << 40, Rate: bucket.Rate{Tokens: 1, Interval: 1}})
	value := []byte("127.0.0.1")
	var out [1]bucket.Result
	var now, wall int64
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if i&1023 == 0 {
			now, wall = monotonicMicros(), wallMicros()
		}
		i++
		s.TakeAt(benchID(value), tr, 1, out[:], now, wall)
	}
}

// BenchmarkBucketID is the hash of a bucket's name alone, which every
// request's take pays: ID, beside the piecewise maphash.Hash it replaced.
func BenchmarkBucketID(b *testing.B) {
	value := []byte("127.0.0.1")
	var sink uint64
	b.Run("ID", func(b *testing.B) {
		for b.Loop() {
			sink += benchID(value)
		}
	})
	b.Run("piecewise", func(b *testing.B) {
		for b.Loop() {
			sink += bucketID(value)
		}
	})
	if benchID(value) != bucketID(value) {
		b.Fatal("ID and the piecewise hash differ")
	}
}

func BenchmarkLocalTakeParallel(b *testing.B) {
	s := newStore(defaultMaxKeys, monotonicMicros)
	tr := lone(bucket.Limit{Capacity: 1 << 40, Rate: bucket.Rate{Tokens: 1, Interval: 1}})
	var goroutines atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		// Each goroutine is its own set of clients, as real traffic is.
		g := strconv.FormatInt(goroutines.Add(1), 10)
		values := make([][]byte, 1024)
		for i := range values {
			values[i] = []byte(g + "/" + strconv.Itoa(i))
		}
		var out [1]bucket.Result
		i := 0
		for pb.Next() {
			s.Take(benchID(values[i&1023]), tr, 1, out[:])
			i++
		}
	})
}

// defaultMaxKeys is the root's default max_keys.
const defaultMaxKeys = 1000000

// BenchmarkLocalStoreMemoryPerKey fills a store with distinct clients
// and reports the heap it holds per bucket.
func BenchmarkLocalStoreMemoryPerKey(b *testing.B) {
	for _, n := range []int{1_000_000, 10_000_000} {
		b.Run(strconv.Itoa(n/1_000_000)+"M", func(b *testing.B) {
			l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				lb := newStore(n, monotonicMicros)
				var buf [8]byte
				for i := range n {
					binary.LittleEndian.PutUint64(buf[:], uint64(i))
					take(lb, bucketID(buf[:]), l, 1)
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				if held := lb.Len(); held != n {
					b.Fatalf("held %d buckets, want %d", held, n)
				}
				b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(n), "bytes/key")
				runtime.KeepAlive(lb)
			}
		})
	}
}
