package ratelimit

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Benchmarks of the hot path. Results and the commands that produced them
// are in bench/README.md.

func BenchmarkLocalTake(b *testing.B) {
	lb := newLocalBuckets(defaultMaxKeys, monotonicMicros)
	l := Limit{Capacity: 1 << 40, Rate: Rate{Tokens: 1, Interval: 1}}
	bucket := bucketFor("127.0.0.1")
	b.ReportAllocs()
	for b.Loop() {
		lb.take(bucket, l, 1)
	}
}

func BenchmarkLocalTakeParallel(b *testing.B) {
	lb := newLocalBuckets(defaultMaxKeys, monotonicMicros)
	l := Limit{Capacity: 1 << 40, Rate: Rate{Tokens: 1, Interval: 1}}
	var goroutines atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		// Each goroutine is its own set of clients, as real traffic is.
		g := strconv.FormatInt(goroutines.Add(1), 10)
		buckets := make([]*Bucket, 1024)
		for i := range buckets {
			buckets[i] = bucketFor(g + "/" + strconv.Itoa(i))
		}
		i := 0
		for pb.Next() {
			lb.take(buckets[i&1023], l, 1)
			i++
		}
	})
}

// provisionedHandler sets up a handler from JSON outside a server, as Caddy
// would.
func provisionedHandler(b *testing.B, cfg string) (*Handler, func()) {
	h := new(Handler)
	if err := json.Unmarshal([]byte(cfg), h); err != nil {
		b.Fatal(err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	return h, func() { _ = h.Cleanup(); cancel() }
}

// benchRequest is a request as Caddy's server hands it to handlers: with a
// replacer and the client_ip variable.
func benchRequest(ip string) *http.Request {
	r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: ip})
	return r.WithContext(ctx)
}

var nopHandler = caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })

// headerSink is a ResponseWriter that keeps nothing but a reused header map.
type headerSink struct{ h http.Header }

func (s *headerSink) Header() http.Header         { return s.h }
func (s *headerSink) Write(p []byte) (int, error) { return len(p), nil }
func (s *headerSink) WriteHeader(int)             {}

func BenchmarkServeHTTP(b *testing.B) {
	h, done := provisionedHandler(b, `{"name":"bench","tiers":[{"name":"default","capacity":1000000000,"refill":"1000000/s"}]}`)
	defer done()
	r := benchRequest("127.0.0.1")
	w := &headerSink{h: make(http.Header)}
	b.ReportAllocs()
	for b.Loop() {
		if err := h.ServeHTTP(w, r, nopHandler); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkServeHTTPParallel(b *testing.B) {
	h, done := provisionedHandler(b, `{"name":"bench-parallel","tiers":[{"name":"default","capacity":1000000000,"refill":"1000000/s"}]}`)
	defer done()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		r := benchRequest("127.0.0.1")
		w := &headerSink{h: make(http.Header)}
		for pb.Next() {
			if err := h.ServeHTTP(w, r, nopHandler); err != nil {
				b.Fatal(err)
			}
		}
	})
}
