package ratelimit

import (
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Hostile input: what an attacker controls is the number of keys and the
// size and shape of everything in a request. None of it may exhaust memory,
// hang a request, cause a 5xx, or get a request past its limit.

// floodKeys is how many distinct keys TestFloodOfDistinctKeysStaysWithinMaxKeys
// sends. The race detector makes each take about ten times slower, so
// under -race the flood is 1M keys; hostile_norace_test.go raises it to 5M.
var floodKeys = 1_000_000

// TestFloodOfDistinctKeysStaysWithinMaxKeys drives the local store directly
// (HTTP would only add time) with a flood of distinct keys, each taking one
// token of a 1/h bucket, so that none is ever full again and every drop is
// an eviction. The table never holds more than max_keys buckets, and the
// heap after the flood, after a GC, is within a bound proportional to
// max_keys, not to the flood.
func TestFloodOfDistinctKeysStaysWithinMaxKeys(t *testing.T) {
	skipUnderShort(t, "heavy load")
	const maxKeys = 100_000
	clock := new(fakeClock)
	clock.micros.Store(1)

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	lb := newLocalBuckets(maxKeys, clock.now)
	l := bucket.Limit{Capacity: 5, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	b := &Bucket{Policy: "flood", Tier: "default", Keyer: "header/X-Api-Key"}
	buf := make([]byte, 0, 32)
	start := time.Now()
	peak := 0
	for i := range floodKeys {
		buf = strconv.AppendInt(append(buf[:0], "key-"...), int64(i), 10)
		b.Value = buf
		if res := lb.take(b, l, 1); !res.Allowed {
			t.Fatalf("key %d: a new key was denied", i)
		}
		if i%1024 == 0 {
			clock.advance(time.Millisecond)
			peak = max(peak, lb.len())
		}
	}
	elapsed := time.Since(start)
	peak = max(peak, lb.len())
	if peak > maxKeys {
		t.Fatalf("%d buckets held during the flood, max_keys %d", peak, maxKeys)
	}
	if ev := lb.evictions.Load(); ev < uint64(floodKeys-maxKeys) {
		t.Fatalf("%d evictions, want at least the %d keys over the bound", ev, floodKeys-maxKeys)
	}
	// Every bucket the table still holds is counted.
	held := 0
	for i := range lb.shards {
		held += lb.shards[i].states.n
	}
	if held != lb.len() {
		t.Fatalf("the shards hold %d buckets, the count says %d", held, lb.len())
	}

	runtime.GC()
	var after runtime.MemStats
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(lb)
	grown := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	// The table takes 23 to 46 bytes a bucket (table.go); allow 64, and
	// 4 MiB for the rest of the test binary's heap moving about.
	bound := int64(64*maxKeys + 4<<20)
	t.Logf("%d distinct keys in %s: peak %d buckets held, %d evictions, heap grew %d KiB (bound %d KiB)",
		floodKeys, elapsed, peak, lb.evictions.Load(), grown>>10, bound>>10)
	if grown > bound {
		t.Fatalf("heap grew by %d bytes for max_keys %d, bound %d", grown, maxKeys, bound)
	}
}

// hostileSite serves a policy of capacity 3, 1/h, that names the client by
// a verified JWT, a header, a cookie, a JSON or form field, then the IP, on
// a server that accepts headers up to 2 MB (Caddy's default is 16 KiB).
func hostileSite(t *testing.T) *testServer {
	t.Helper()
	port := freePort(t)
	s := serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
		max_header_size 2MB
	}
}
http://127.0.0.1:%d {
	rate_limit 3 1/h {
		key jwt sub
		key header X-API-Key
		key cookie session
		key json user.name
		key form username
		jwt {
			secret "a secret the attacker does not know"
		}
	}
	respond "ok"
}
`, port))
	s.client.Timeout = 20 * time.Second
	return s
}

// TestHostileRequestsAreAnsweredAndLimitedExactly sends, for each kind of
// hostile request, five in a row from one client: each is answered within
// the client's timeout, never with a 5xx, and exactly three pass.
func TestHostileRequestsAreAnsweredAndLimitedExactly(t *testing.T) {
	s := hostileSite(t)
	mb := strings.Repeat("k", 1<<20)
	huge := strings.Repeat("x", 8<<20)
	forged := "eyJhbGciOiJIUzI1NiJ9." + strings.Repeat("A", 1<<20) + ".sig"
	none := "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJ2aWN0aW0ifQ."
	for i, c := range []struct {
		name    string
		method  string
		body    string
		headers []string
	}{
		{"1 MB API key", "GET", "", []string{"X-API-Key: " + mb}},
		{"1 MB cookie", "GET", "", []string{"Cookie: session=" + mb}},
		{"a thousand cookies", "GET", "", []string{"Cookie: " + strings.Repeat("c=1; ", 1000) + "session=last"}},
		{"1 MB forged JWT", "GET", "", []string{"Authorization: Bearer " + forged}},
		{"unsigned JWT", "GET", "", []string{"Authorization: Bearer " + none}},
		{"many headers", "GET", "", manyHeaders(2000)},
		{"8 MB JSON body", "POST", `{"user":{"name":"` + huge + `"}}`, []string{"Content-Type: application/json"}},
		{"malformed JSON", "POST", `{"user":{"name":`, []string{"Content-Type: application/json"}},
		{"deep JSON", "POST", strings.Repeat(`{"user":`, 10000), []string{"Content-Type: application/json"}},
		{"8 MB form", "POST", "username=" + huge, []string{"Content-Type: application/x-www-form-urlencoded"}},
		{"malformed multipart", "POST", "--b\r\nContent-Disposition: form-data; name=\"username\"\r\n\r\nalice", []string{"Content-Type: multipart/form-data; boundary=b"}},
		{"multipart without boundary", "POST", "x", []string{"Content-Type: multipart/form-data"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Each case is its own client, so that those keyed by IP
			// get their own bucket.
			ip := "127.0.3." + strconv.Itoa(i+1)
			allowed := 0
			for n := range 5 {
				start := time.Now()
				r := s.do(c.method, "/", c.body, append(c.headers, "X-Forwarded-For: "+ip)...)
				if r.status >= 500 {
					t.Fatalf("request %d: status %d %q", n+1, r.status, r.body)
				}
				if d := time.Since(start); d > 10*time.Second {
					t.Fatalf("request %d took %s", n+1, d)
				}
				switch r.status {
				case 200:
					allowed++
				case 429:
				default:
					t.Fatalf("request %d: status %d %q, want 200 or 429", n+1, r.status, r.body)
				}
			}
			if allowed != 3 {
				t.Fatalf("%d of 5 allowed, want exactly the capacity 3", allowed)
			}
		})
	}
}

// TestHeadersOverTheServersLimitGet431 shows that what the server refuses
// to read is refused before the limiter, with a 4xx: never a 5xx, never a
// hang.
func TestHeadersOverTheServersLimitGet431(t *testing.T) {
	s := hostileSite(t)
	for _, h := range []string{"X-API-Key: " + strings.Repeat("k", 3<<20), "Cookie: session=" + strings.Repeat("c", 3<<20)} {
		r := s.do("GET", "/", "", h)
		if r.status != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("a 3 MB header: status %d, want 431", r.status)
		}
	}
}

func manyHeaders(n int) []string {
	h := make([]string, n)
	for i := range h {
		h[i] = fmt.Sprintf("X-Junk-%d: %s", i, strings.Repeat("j", 100))
	}
	return h
}
