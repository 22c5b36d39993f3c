package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
)

// concurrency: a tier's in-flight limit.

// holdingOrigin holds each request for hold and notes how many it holds.
type holdingOrigin struct {
	srv        *httptest.Server
	held, most atomic.Int64
}

func newHoldingOrigin(t *testing.T, hold time.Duration) *holdingOrigin {
	t.Helper()
	o := &holdingOrigin{}
	o.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := o.held.Add(1)
		for m := o.most.Load(); n > m && !o.most.CompareAndSwap(m, n); m = o.most.Load() {
		}
		select {
		case <-time.After(hold):
		case <-r.Context().Done():
		}
		o.held.Add(-1)
		w.Write([]byte("ok"))
	}))
	t.Cleanup(o.srv.Close)
	return o
}

// inFlightNow is the in_flight gauge of a policy's tier.
func inFlightNow(t *testing.T, policy, tier string) float64 {
	t.Helper()
	var m dto.Metric
	if err := inFlightGauge.WithLabelValues(policy, tier).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetGauge().GetValue()
}

// `concurrency 10`, 200 requests of one client at once, an origin that
// holds each 500 ms: it never holds more than 10, and does hold 10; the
// rest are refused with Retry-After: 1; afterwards nothing is in flight.
// In every store mode.
func TestConcurrencyHoldsTheOriginToN(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			origin := newHoldingOrigin(t, 500*time.Millisecond)
			policy := fmt.Sprint("inflight_", i)
			s := serve(t, fmt.Sprintf(`rate_limit {
		name %s
		key header X-Key
		tier all {
			concurrency 10
		}
		%s
	}
	reverse_proxy %s`, policy, mode.store, origin.srv.Listener.Addr()))
			s.client.Transport.(*http.Transport).MaxIdleConnsPerHost = 256
			out := make([]waitOutcome, 200)
			var wg sync.WaitGroup
			start := make(chan struct{})
			for k := range out {
				wg.Go(func() {
					<-start
					out[k] = s.send(context.Background(), "one")
				})
			}
			close(start)
			wg.Wait()
			served, refused := 0, 0
			for _, o := range out {
				switch {
				case o.err != nil:
					t.Fatal(o.err)
				case o.status == 200:
					served++
				case o.status == 429 && o.retry == "1":
					refused++
				default:
					t.Fatalf("status %d, Retry-After %q", o.status, o.retry)
				}
			}
			if most := origin.most.Load(); most != 10 {
				t.Fatalf("the origin held %d at most; want 10, never more", most)
			}
			if served < 10 || served+refused != 200 {
				t.Fatalf("%d served, %d refused", served, refused)
			}
			if g := inFlightNow(t, policy, "all"); g != 0 {
				t.Errorf("in_flight gauge %v after every request ended", g)
			}
			if mode.store != "" && !eventuallyTrue(2*time.Second, func() bool { return len(srv.do("KEYS", "*:c").([]any)) == 0 }) {
				t.Errorf("Redis still holds slot keys: %v", srv.do("KEYS", "*:c"))
			}
			t.Logf("%d served, %d refused, the origin held %d at most", served, refused, origin.most.Load())
		})
	}
}

// eventuallyTrue polls cond for up to d.
func eventuallyTrue(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// A request refused a slot gives back the rate tokens it took: all or
// nothing. A panic in a later handler frees the slot.
func TestConcurrencyRefusalTakesNothingAndAPanicFreesTheSlot(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"slots","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"default","capacity":5,"refill":"1/m","concurrency":1}]}`)
	defer done()
	release := make(chan struct{})
	holding := make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		close(holding)
		<-release
		return nil
	})
	first := make(chan http.Header, 1)
	go func() {
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), slow); err != nil {
			t.Error(err)
		}
		first <- w.Header()
	}()
	<-holding
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err == nil || !strings.Contains(err.Error(), "in flight") || w.Header().Get("Retry-After") != "1" {
		t.Fatalf("a second request in flight: %v, Retry-After %q; want refused, Retry-After 1", err, w.Header().Get("Retry-After"))
	}
	// Its headers say what the bucket holds once its token went back.
	if got := w.Header().Get("X-Ratelimit-Remaining"); got != "4" {
		t.Errorf("the refused request's X-RateLimit-Remaining %q, want 4 (its token went back)", got)
	}
	if g := inFlightNow(t, "slots", "default"); g != 1 {
		t.Errorf("in_flight %v while one request is in flight", g)
	}
	close(release)
	hdr := <-first
	if got := hdr.Get("RateLimit-Policy"); got != `"default";q=5;w=300, "default-concurrency";q=1;qu="concurrent-requests"` {
		t.Errorf("RateLimit-Policy %q", got)
	}
	if got := hdr.Get("RateLimit"); got != `"default";r=4;t=60, "default-concurrency";r=0` {
		t.Errorf("RateLimit %q", got)
	}
	// The refused request took nothing: 4 tokens left after the first.
	w = httptest.NewRecorder()
	if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil || w.Header().Get("X-Ratelimit-Remaining") != "3" {
		t.Fatalf("the next request: %v, remaining %q; want allowed with 3 left (the refused one gave its token back)", err, w.Header().Get("X-Ratelimit-Remaining"))
	}

	// A later handler panics: the slot is freed as the panic goes on.
	boom := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic("boom") })
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the panic did not go on")
			}
		}()
		_ = h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), boom)
	}()
	if g := inFlightNow(t, "slots", "default"); g != 0 {
		t.Errorf("in_flight %v after the panic", g)
	}
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatalf("after the panic, a request: %v; want its slot free", err)
	}
}

// A dry run lets a request over the limit through, counts and names it a
// dry run, and keeps the tokens it took: it reached the origin.
func TestConcurrencyDryRun(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"slots_dry","dry_run":true,"keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"default","capacity":5,"refill":"1/m","concurrency":1}]}`)
	defer done()
	release, holding := make(chan struct{}), make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		close(holding)
		<-release
		return nil
	})
	finished := make(chan struct{})
	go func() {
		defer close(finished)
		_ = h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), slow)
	}()
	<-holding
	before := counterValue(t, requestsTotal.WithLabelValues("slots_dry", "default", "dry_run"))
	reached := false
	r := keyed(benchRequest("127.0.0.1"))
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		reached = true
		return nil
	}))
	close(release)
	<-finished
	if err != nil || !reached {
		t.Fatalf("dry run, over the limit: %v, reached the origin %v; want let through", err, reached)
	}
	if n := counterValue(t, requestsTotal.WithLabelValues("slots_dry", "default", "dry_run")) - before; n != 1 {
		t.Errorf("dry_run decisions counted %v, want 1", n)
	}
	if got := w.Header().Get("X-Ratelimit-Remaining"); got != "3" {
		t.Errorf("X-RateLimit-Remaining %q, want 3: it kept its token", got)
	}
}

// counterValue reads a Prometheus counter.
func counterValue(t *testing.T, c interface{ Write(*dto.Metric) error }) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

func TestConcurrencyCaddyfile(t *testing.T) {
	t.Parallel()
	site := func(block string) string {
		return fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit {\n\t\t%s\n\t}\n\trespond ok\n}\n", freePort(t), block)
	}
	cfg, err := adaptCaddyfile(site("tier slow 10 1/s {\n\t\t\tconcurrency 3\n\t\t\tmatch path /slow\n\t\t}\n\t\ttier all {\n\t\t\tconcurrency 50\n\t\t}"))
	if err != nil {
		t.Fatal(err)
	}
	if hs := findHandlers(t, cfg); len(hs) != 1 || hs[0].Tiers[0].Concurrency != 3 || hs[0].Tiers[1].Concurrency != 50 {
		t.Fatalf("adapted: %s", cfg)
	}
	for _, tt := range []struct{ block, want string }{
		{"tier all {\n\t\t\tconcurrency 0\n\t\t}", "concurrency 0: must be at least 1"},
		{"tier all {\n\t\t\tconcurrency -2\n\t\t}", "concurrency -2: must be at least 1"},
		{"tier all {\n\t\t\tconcurrency many\n\t\t}", `concurrency "many"`},
		{"tier all {\n\t\t\tconcurrency 5\n\t\t\tcost 2\n\t\t}", "a tier with concurrency and no rate limit takes no cost"},
		{"tier all {\n\t\t\tunlimited\n\t\t\tconcurrency 5\n\t\t}", "takes no capacity, refill, cost, quota or concurrency"},
		{"tier all {\n\t\t\tconcurrency 5\n\t\t}\n\t\tstore redis {\n\t\t\taddress redis://127.0.0.1:6379\n\t\t\tslot_ttl 10ms\n\t\t}", "slot_ttl 10ms: must be at least 300ms"},
	} {
		if _, err := adaptCaddyfile(site(tt.block)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: %v, want an error containing %q", tt.block, err, tt.want)
		}
	}
}

// A concurrency-only tier reports its slots in the X- fields.
func TestConcurrencyOnlyTierHeaders(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandler(t, `{"name":"only_slots","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"all","concurrency":4}]}`)
	defer done()
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	if got := w.Header().Get("X-Ratelimit-Limit") + " " + w.Header().Get("X-Ratelimit-Remaining"); got != "4 3" {
		t.Errorf("X- fields: limit and remaining %q, want 4 3", got)
	}
	if v := viewOf(h); v.Tiers[0].Concurrency != 4 || len(v.Tiers[0].Limits) != 0 {
		t.Errorf("listing: %+v", v.Tiers[0])
	}
}

// BenchmarkServeHTTPConcurrency is the local allowed path with a slot
// taken and freed, beside the same tier without concurrency: run both in
// one run to compare.
func BenchmarkServeHTTPConcurrency(b *testing.B) {
	for _, tt := range []struct{ name, extra string }{{"without", ""}, {"concurrency", `,"concurrency":1000`}} {
		b.Run(tt.name, func(b *testing.B) {
			h, done := provisionedHandler(b, `{"name":"bench-slots-`+tt.name+`","tiers":[{"name":"default","capacity":1000000000,"refill":"1000000/s"`+tt.extra+`}]}`)
			defer done()
			benchServe(b, h)
		})
	}
}

// A request that waits for its tokens (max_wait) across a reload takes
// its slot from the config that runs when it goes on, not from the
// unloaded one, whose slots closed: it is served (on_store_error deny
// would answer 503), no store error is counted, and its slot is freed
// afterwards, in Redis and in the gauge. When the running config no
// longer limits the tier's requests in flight, it goes on without a slot.
// Regression test for issue 30 item 2.
func TestConcurrencySlotOfARequestCaughtByAReloadComesFromTheRunningConfig(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, tt := range []struct{ name, after string }{
		{"the running config counts slots", "concurrency 1"},
		{"the running config counts none", "max_wait 5s"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			port := freePort(t)
			policy := fmt.Sprint("slot_across_reload_", i)
			site := func(tier string) string {
				return fmt.Sprintf(`{
	admin off
	skip_install_trust
}
http://127.0.0.1:%d {
	rate_limit {
		name %s
		key header X-Key
		tier all 1 1/2s {
			%s
		}
		max_wait 5s
		on_store_error deny
		store redis {
			address %s
			timeout 2s
		}
	}
	respond ok
}
`, port, policy, tier, srv.url())
			}
			s := serveCaddyfile(t, port, site("concurrency 1"))
			if r := s.get("/", "X-Key: one"); r.status != 200 {
				t.Fatalf("the first request: %d", r.status)
			}
			errorsBefore := counterValue(t, storeErrorsTotal.WithLabelValues("redis"))
			waited := make(chan waitOutcome, 1)
			go func() { waited <- s.send(context.Background(), "one") }()
			waitFor(t, 5*time.Second, "the second request to wait for its token", func() bool { return waitersFor(policy).Load() == 1 })
			cfg, err := adaptCaddyfile(site(tt.after))
			if err != nil {
				t.Fatal(err)
			}
			if err := caddy.Load(cfg, true); err != nil {
				t.Fatal(err)
			}
			if waitersFor(policy).Load() != 1 {
				t.Fatal("the request stopped waiting before the reload ended: the test proves nothing")
			}
			if o := <-waited; o.err != nil || o.status != 200 {
				t.Fatalf("the request that waited across the reload: status %d, error %v; want 200", o.status, o.err)
			}
			if n := counterValue(t, storeErrorsTotal.WithLabelValues("redis")) - errorsBefore; n != 0 {
				t.Errorf("%v store errors counted with Redis up", n)
			}
			if g := inFlightNow(t, policy, "all"); g != 0 {
				t.Errorf("in_flight gauge %v after the request ended", g)
			}
			if !eventuallyTrue(2*time.Second, func() bool { return len(srv.do("KEYS", "*:c").([]any)) == 0 }) {
				t.Errorf("Redis still holds slots: %v", srv.do("KEYS", "*:c"))
			}
			runningSlotOwners.Range(func(any, any) bool {
				t.Error("the request ended, but its slot's owner is still remembered")
				return false
			})
		})
	}
}

// `concurrency` in the rate_limit block limits the catch-all tier's
// requests in flight: a second is refused while the first is held.
// Regression test for issue 30 item 1.
func TestConcurrencyInTheRateLimitBlockRefusesASecondInFlight(t *testing.T) {
	holding, release := make(chan struct{}, 1), make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		holding <- struct{}{}
		<-release
		w.Write([]byte("ok"))
	}))
	defer origin.Close()
	s := serve(t, fmt.Sprintf(`rate_limit {
		key header X-Key
		concurrency 1
	}
	reverse_proxy %s`, origin.Listener.Addr()))
	first := make(chan response, 1)
	go func() { first <- s.get("/", "X-Key: ann") }()
	<-holding
	r := s.get("/", "X-Key: ann")
	close(release)
	if r.status != 429 || r.header.Get("Retry-After") != "1" {
		t.Errorf("a second request in flight: %d, Retry-After %q; want 429, Retry-After 1", r.status, r.header.Get("Retry-After"))
	}
	if r := <-first; r.status != 200 {
		t.Errorf("the first request: %d, want 200", r.status)
	}
	if r := s.get("/", "X-Key: ann"); r.status != 200 {
		t.Errorf("after the first ended: %d, want 200", r.status)
	}
}

// A request's slot is freed when it ends. When that free cannot reach
// Redis (a blip, a failover under way), the slot must not stay taken for
// the rest of slot_ttl once Redis is back: the client, with nothing in
// flight, would be refused "too many in flight" for up to 30 s.
func TestARedisSlotWhoseFreeWasLostDoesNotHoldTheClientOffAfterRedisIsBack(t *testing.T) {
	skipUnderShort(t, "fault injection")
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), 0)
	holding, release := make(chan struct{}, 1), make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		holding <- struct{}{}
		<-release
		w.Write([]byte("ok"))
	}))
	defer origin.Close()
	s := serve(t, fmt.Sprintf(`rate_limit {
		name slot_free_lost
		key header X-Key
		concurrency 1
		store redis {
			address redis://%s
			timeout 200ms
		}
		on_store_error deny
	}
	reverse_proxy %s`, proxy.addr(), origin.Listener.Addr()))
	first := make(chan response, 1)
	go func() { first <- s.get("/", "X-Key: ann") }()
	<-holding
	proxy.cut()
	close(release)
	if r := <-first; r.status != 200 {
		t.Fatalf("the request that held the slot: %d, want 200", r.status)
	}
	// The free is sent at once, and fails on the cut link.
	time.Sleep(500 * time.Millisecond)
	proxy.restore()
	var r response
	passed := eventuallyTrue(5*time.Second, func() bool {
		r = s.get("/", "X-Key: ann")
		return r.status == 200
	})
	if !passed {
		t.Errorf("5 s after Redis came back, with nothing in flight: %d, Retry-After %q; want 200 (the slot set holds %v)",
			r.status, r.header.Get("Retry-After"), srv.do("KEYS", "*"))
	}
}

// A reload that changes only the Redis timeout keeps the slots of the
// requests still running through the old config: the new config's
// connection renews them, so the client never has more than its
// concurrency in flight after slot_ttl.
// Regression test for 4566696.
func TestAReloadThatChangesTheRedisTimeoutKeepsTheSlotsOfRunningRequests(t *testing.T) {
	// Serial: its slots live 300 ms, renewed within a 100 ms timeout.
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	cfg := func(timeout string) string {
		return fmt.Sprintf(`{"name":"concurrency_reload_timeout","keys":[{"keyer":"header","field":"X-Key"}],"store":{"store":"redis","addresses":[%q],"timeout":%s,"slot_ttl":300000000},"tiers":[{"name":"all","concurrency":1}]}`, srv.addr(), timeout)
	}
	old, doneOld := provisionedHandler(t, cfg("100000000"))
	release, holding := make(chan struct{}), make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		close(holding)
		<-release
		return nil
	})
	finished := make(chan error, 1)
	go func() { finished <- old.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), slow) }()
	<-holding
	defer func() { close(release); <-finished }()

	// A reload: the new config, with another timeout, then the old one's
	// cleanup. The old request runs on.
	cur, doneCur := provisionedHandler(t, cfg("90000000"))
	defer doneCur()
	doneOld()

	time.Sleep(time.Second) // more than slot_ttl, 300ms
	w := httptest.NewRecorder()
	err := cur.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err == nil {
		t.Errorf("a second request of the client was let through while its first is still in flight (concurrency 1): Redis holds %v", srv.do("KEYS", "*:c"))
	}
}

// The in-flight slot a request holds is in the bucket the admin endpoint
// names: GET shows it while the origin holds the request, for a client
// named by a keyer after the first, and none once it is answered.
func TestTheAdminEndpointSeesTheSlotARequestHolds(t *testing.T) {
	useFakeClock(t)
	arrived, release := make(chan struct{}), make(chan struct{})
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		w.Write([]byte("ok"))
	}))
	t.Cleanup(origin.Close)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name admin_inflight
		key header X-First
		key header X-Key
		tier all {
			concurrency 2
		}
	}
	reverse_proxy %s`, origin.Listener.Addr()))
	inFlight := func() int64 {
		t.Helper()
		var got bucketState
		url := admin + "/rate_limit/buckets?policy=admin_inflight&keyer=header/X-Key&value=kay"
		if status := getJSON(t, url, &got); status != 200 || got.InFlight == nil {
			t.Fatalf("GET: %d, in_flight %v; want 200 and in_flight", status, got.InFlight)
		}
		return *got.InFlight
	}
	done := make(chan response)
	go func() { done <- s.get("/", "X-Key: kay") }()
	select {
	case <-arrived:
	case r := <-done:
		t.Fatalf("the request: %d %q before it reached the origin", r.status, r.body)
	}
	if got := inFlight(); got != 1 {
		t.Errorf("while the origin holds the request: in_flight %d, want 1", got)
	}
	close(release)
	if r := <-done; r.status != 200 {
		t.Fatalf("the request: %d %q", r.status, r.body)
	}
	if got := inFlight(); got != 0 {
		t.Errorf("after the answer: in_flight %d, want 0", got)
	}
}
