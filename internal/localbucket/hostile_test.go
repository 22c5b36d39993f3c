package localbucket

import (
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Hostile input: what an attacker controls is the number of keys. It may
// not exhaust memory.

// floodKeys is how many distinct keys TestFloodOfDistinctKeysStaysWithinMaxKeys
// sends. The race detector makes each take about ten times slower, so
// under -race the flood is 1M keys; hostile_norace_test.go raises it to 5M.
var floodKeys = 1_000_000

// TestFloodOfDistinctKeysStaysWithinMaxKeys drives the store directly (HTTP
// would only add time) with a flood of distinct keys, each taking one
// token of a 1/h bucket, so that none is ever full again and every drop is
// an eviction. The table never holds more than max_keys buckets, and the
// heap after the flood, after a GC, is within a bound proportional to
// max_keys, not to the flood. Serial: it measures the whole heap.
func TestFloodOfDistinctKeysStaysWithinMaxKeys(t *testing.T) {
	if testing.Short() {
		t.Skip("heavy load test: skipped under -short")
	}
	const maxKeys = 100_000
	clock := new(fakeClock)
	clock.micros.Store(1)

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	lb := newStore(maxKeys, clock.now)
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	buf := make([]byte, 0, 32)
	start := time.Now()
	peak := 0
	for i := range floodKeys {
		buf = strconv.AppendInt(append(buf[:0], "key-"...), int64(i), 10)
		if res := take(lb, bucketID(buf), l, 1); !res.Allowed {
			t.Fatalf("key %d: a new key was denied", i)
		}
		if i%1024 == 0 {
			clock.advance(time.Millisecond)
			peak = max(peak, lb.Len())
		}
	}
	elapsed := time.Since(start)
	peak = max(peak, lb.Len())
	if peak > maxKeys {
		t.Fatalf("%d buckets held during the flood, max_keys %d", peak, maxKeys)
	}
	if ev := lb.Evictions(); ev < uint64(floodKeys-maxKeys) {
		t.Fatalf("%d evictions, want at least the %d keys over the bound", ev, floodKeys-maxKeys)
	}
	// Every bucket the table still holds is counted.
	held := 0
	for i := range lb.shards {
		held += lb.shards[i].states.n
	}
	if held != lb.Len() {
		t.Fatalf("the shards hold %d buckets, the count says %d", held, lb.Len())
	}

	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(lb)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	// The table takes 23 to 46 bytes a bucket (stateTable); allow 64, and
	// 4 MiB for the rest of the test binary's heap moving about.
	bound := int64(64*maxKeys + 4<<20)
	t.Logf("%d distinct keys in %s: peak %d buckets held, %d evictions, heap grew %d KiB (bound %d KiB)",
		floodKeys, elapsed, peak, lb.Evictions(), grown>>10, bound>>10)
	if grown > bound {
		t.Fatalf("heap grew by %d bytes for max_keys %d, bound %d", grown, maxKeys, bound)
	}
}
