package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Benchmarks of the hot path. Results and the commands that produced them
// are in bench/README.md.

// provisionedHandler sets up a handler from JSON outside a server, as Caddy
// would, on the system's clocks.
func provisionedHandler(b testing.TB, cfg string) (*Handler, func()) {
	return provisionedHandlerOn(b, clocks{}, cfg)
}

// provisionedHandlerOn is provisionedHandler with the clocks c handed to
// the handler (the zero value: the system's). Its local buckets are its
// policy's: tests that run in parallel give each handler a policy name of
// its own.
func provisionedHandlerOn(b testing.TB, c clocks, cfg string) (*Handler, func()) {
	return provisionedHandlerWith(b, cfg, func(h *Handler) { h.clocks = c })
}

// provisionedHandlerWith is provisionedHandler with set applied to the
// handler between its JSON and Provision: what a test hands it that no
// config can (clocks, a JWT config's count of verifications).
func provisionedHandlerWith(b testing.TB, cfg string, set func(*Handler)) (*Handler, func()) {
	h := new(Handler)
	if err := json.Unmarshal([]byte(cfg), h); err != nil {
		b.Fatal(err)
	}
	set(h)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := h.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	return h, func() { _ = h.Cleanup(); cancel() }
}

// benchRequest is a request as Caddy's server hands it to handlers: with a
// replacer and the client_ip variable.
// It is built directly, not parsed from text as httptest.NewRequest does,
// so that the garbage of making it, collected while the timer runs, is
// small beside what it measures.
func benchRequest(ip string) *http.Request {
	ctx := context.WithValue(context.Background(), caddy.ReplacerCtxKey, caddy.NewReplacer())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: ip})
	r, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1/", nil)
	if err != nil {
		panic(err)
	}
	r.RemoteAddr = net.JoinHostPort(ip, "1234")
	r.RequestURI = "/"
	return r
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
	benchServe(b, h)
}

// BenchmarkServeHTTPMaxWait is the allowed path with max_wait set, never
// waiting (the bucket always holds the tokens), beside the same without:
// run both in one run to compare.
func BenchmarkServeHTTPMaxWait(b *testing.B) {
	for _, tt := range []struct{ name, maxWait string }{{"without", ""}, {"max_wait", `,"max_wait":1000000000`}} {
		b.Run(tt.name, func(b *testing.B) {
			h, done := provisionedHandler(b, `{"name":"bench-wait-`+tt.name+`"`+tt.maxWait+`,"tiers":[{"name":"default","capacity":1000000000,"refill":"1000000/s"}]}`)
			defer done()
			benchServe(b, h)
		})
	}
}

// benchServe runs b.N requests of one client through h, with a next
// handler that counts the requests let through: all of them must be, so
// that a refusal or a store failure is never measured as an admission.
func benchServe(b *testing.B, h *Handler) { benchServeKeys(b, h, nil, 0) }

// benchServeKeys is benchServe with the clients keys in turn (header
// X-Key; none when keys is nil), after warm passes over them untimed.
func benchServeKeys(b *testing.B, h *Handler, keys []string, warm int) {
	passed := 0
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { passed++; return nil })
	w := &headerSink{h: make(http.Header)}
	request := func(i int) *http.Request {
		r := benchRequest("127.0.0.1")
		if keys != nil {
			r.Header["X-Key"] = []string{keys[i%len(keys)]}
		}
		return r
	}
	for i := range warm * len(keys) {
		if err := h.ServeHTTP(w, request(i), next); err != nil {
			b.Fatal(err)
		}
	}
	passed = 0
	// Each request has its own replacer, as in Caddy; making them is Caddy's
	// cost, not the handler's, so they are made with the timer stopped, a
	// batch at a time.
	var batch [1024]*http.Request
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if i%len(batch) == 0 {
			b.StopTimer()
			for j := range batch {
				batch[j] = request(i + j)
			}
			b.StartTimer()
		}
		if err := h.ServeHTTP(w, batch[i%len(batch)], next); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	if passed != b.N {
		b.Fatalf("%d of %d requests let through; want all (refused, or the store failed)", passed, b.N)
	}
}

// BenchmarkMakeRequest is what BenchmarkServeHTTPParallel spends making
// its requests, to subtract from it.
func BenchmarkMakeRequest(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		benchRequest("127.0.0.1")
	}
}

func BenchmarkServeHTTPParallel(b *testing.B) {
	h, done := provisionedHandler(b, `{"name":"bench-parallel","tiers":[{"name":"default","capacity":1000000000,"refill":"1000000/s"}]}`)
	defer done()
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		// A replacer per request, as in Caddy, from a ring of prepared ones:
		// the handler adds a provider to each, and this keeps them few.
		var ring [64]*http.Request
		w := &headerSink{h: make(http.Header)}
		for i := 0; pb.Next(); i++ {
			if i%len(ring) == 0 {
				for j := range ring {
					ring[j] = benchRequest("127.0.0.1")
				}
			}
			r := ring[i%len(ring)]
			if err := h.ServeHTTP(w, r, nopHandler); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkServeHTTPLimits is ServeHTTP on a tier of one limit beside one
// of three, in one run: the three take from all in one step.
func BenchmarkServeHTTPLimits(b *testing.B) {
	for _, tt := range []struct{ name, tier string }{
		{"1-limit", `{"name":"default","capacity":1000000000,"refill":"1000000/s"}`},
		{"3-limits", `{"name":"default","limits":[{"capacity":1000000000,"refill":"1000000/s"},{"capacity":1000000000,"refill":"1000000/m"},{"capacity":1000000000,"refill":"1000000/h"}]}`},
	} {
		b.Run(tt.name, func(b *testing.B) {
			h, done := provisionedHandler(b, `{"name":"bench-`+tt.name+`","tiers":[`+tt.tier+`]}`)
			defer done()
			benchServe(b, h)
		})
	}
}

// BenchmarkServeHTTPStores is ServeHTTP on the local store beside the
// Redis store with leases of 1,000 tokens (decided from the tokens this
// node holds), for one client and for 1,000 clients in turn,
// in one run: what a decision from leased tokens costs beyond a local one
// (bench/README.md, "Leases at local speed").
func BenchmarkServeHTTPStores(b *testing.B) {
	srv := startRedis(b)
	for _, tt := range []struct{ name, store string }{
		{"local", `{"store":"local"}`},
		{"lease", `{"store":"redis","addresses":["` + srv.url() + `"],"lease":"1000","timeout":"5s"}`},
	} {
		for _, clients := range []int{1, 1000} {
			b.Run(fmt.Sprintf("%s/%d-clients", tt.name, clients), func(b *testing.B) {
				h, done := provisionedHandler(b, `{"name":"bench-stores-`+tt.name+`","on_store_error":"deny","keys":[{"keyer":"header","field":"X-Key"}],
					"store":`+tt.store+`,"tiers":[{"name":"default","capacity":1000000000,"refill":"1000/s"}]}`)
				defer done()
				keys := make([]string, clients)
				for i := range keys {
					keys[i] = "client-" + strconv.Itoa(i)
				}
				// The warm passes take each client's leases to their size
				// (doubling from one token) before the timer starts.
				benchServeKeys(b, h, keys, 64)
			})
		}
	}
}
