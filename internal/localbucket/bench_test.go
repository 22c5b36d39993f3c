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

func BenchmarkLocalTake(b *testing.B) {
	s := newStore(defaultMaxKeys, monotonicMicros)
	tr := lone(bucket.Limit{Capacity: 1 << 40, Rate: bucket.Rate{Tokens: 1, Interval: 1}})
	value := []byte("127.0.0.1")
	var out [1]bucket.Result
	b.ReportAllocs()
	for b.Loop() {
		s.Take(bucketID(value), tr, 1, out[:])
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
			s.Take(bucketID(values[i&1023]), tr, 1, out[:])
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
