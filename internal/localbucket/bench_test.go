package localbucket

import (
	"encoding/binary"
	"hash/maphash"
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
// hashes a request's: the value, beside its handler's prefix.
func benchID(value []byte) uint64 { return ids.ID(benchPrefix, value) }

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
// request's take pays: ID, the value's hash beside its handler's prefix;
// beside it, the whole name hashed afresh (Prefix and ID, as an admin
// call does), and the whole name hashed in one piece from the stack, as
// ID did before prefixes (wholeNameID).
func BenchmarkBucketID(b *testing.B) {
	value := []byte("127.0.0.1")
	var sink uint64
	b.Run("ID", func(b *testing.B) {
		for b.Loop() {
			sink += benchID(value)
		}
	})
	b.Run("prefix-and-ID", func(b *testing.B) {
		for b.Loop() {
			sink += ids.ID(ids.Prefix("p", "default", "ip/32/64"), value)
		}
	})
	b.Run("whole-name", func(b *testing.B) {
		for b.Loop() {
			sink += wholeNameID(value)
		}
	})
	if benchID(value) != ids.ID(ids.Prefix("p", "default", "ip/32/64"), value) {
		b.Fatal("the cached prefix and a fresh one give different ids")
	}
}

// wholeNameID is how ID hashed a bucket's name before prefixes: the
// policy, tier and keyer, each followed by a 0, and the value, copied
// into a stack buffer and hashed in one call.
func wholeNameID(value []byte) uint64 {
	var buf [128]byte
	i := copy(buf[:], "p\x00default\x00ip/32/64\x00")
	n := i + copy(buf[i:], value)
	return maphash.Bytes(wholeSeed, buf[:n])
}

var wholeSeed = maphash.MakeSeed()

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

// BenchmarkFloodOfBannedKeys is one new client of a flood in which each
// client gets itself banned (two takes on a limit of 1 with a ban), on a
// table of max_keys full of bans: every eviction finds no live state that
// is not banned before it drops bans, the eviction's worst case. The cost
// of a client stays flat as max_keys grows: each sweep of the table frees
// a 32nd of its shard (Store.makeRoom).
func BenchmarkFloodOfBannedKeys(b *testing.B) {
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}, Ban: 3_600_000_000}
	tr := lone(l)
	for _, maxKeys := range []int{1 << 10, 1 << 14, 1 << 18} {
		b.Run("max_keys="+strconv.Itoa(maxKeys), func(b *testing.B) {
			var clock atomic.Int64
			clock.Store(1)
			s := newStore(maxKeys, clock.Load)
			var out [1]bucket.Result
			var key [8]byte
			next := uint64(0)
			ban := func() {
				next++
				binary.LittleEndian.PutUint64(key[:], next)
				id := benchID(key[:])
				s.Take(id, tr, 1, out[:])
				s.Take(id, tr, 1, out[:])
			}
			for range maxKeys {
				ban()
			}
			b.ReportAllocs()
			for b.Loop() {
				ban()
			}
			b.StopTimer()
			if out[0].Allowed || !out[0].Banned || s.Len() > maxKeys {
				b.Fatalf("last take %+v, %d states held: want a ban started, at most %d", out[0], s.Len(), maxKeys)
			}
		})
	}
}
