package ratelimit

import (
	"fmt"
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// TestReconcileKeepsNoClientValueAsItCountsAFloodOfLongKeys: cut off, a
// flood of distinct keys, each a long header value, is admitted by the
// fallback and counted for reconcile. What a bucket's count keeps must not
// grow with the key the client sent: the fallback's own table keeps a
// hash, and the count is charged by the bucket's digest (Bucket.Digest).
func TestReconcileKeepsNoClientValueAsItCountsAFloodOfLongKeys(t *testing.T) {
	const keys, keyLen = 400, 64 << 10
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-long-keys",
		"keys": [{"keyer": "header", "field": "X-Key"}],
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms", "breaker_failures": 1, "breaker_cooldown": "1h"},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, freePort(t)))
	defer done()
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	// One request first: the breaker opens, and the tables take their shape.
	serveOne(h, benchRequest("192.0.2.90"), nopHandler)
	before := heap()
	for i := range keys {
		r := benchRequest("192.0.2.90")
		r.Header.Set("X-Key", fmt.Sprintf("%08d", i)+strings.Repeat("k", keyLen-8))
		if w, _ := serveOne(h, r, nopHandler); w.Code != http.StatusOK {
			t.Fatalf("key %d, cut off: %d; want 200 from the fallback", i, w.Code)
		}
	}
	grew := int64(heap()) - int64(before)
	if n := len(h.owed.owed); n != keys+1 {
		t.Fatalf("%d buckets counted for reconcile; want %d, the first client's and the flood's", n, keys+1)
	}
	// A bucket's count is a few hundred bytes; its key is 64 KiB.
	if limit := int64(keys * 4096); grew > limit {
		t.Fatalf("%d buckets of %d KiB keys counted for reconcile grew the heap by %d KiB; want under %d KiB: the counts keep the clients' keys", keys, keyLen>>10, grew>>10, limit>>10)
	}
	runtime.KeepAlive(h)
}
