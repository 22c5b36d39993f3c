package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Review of issue 23 (concurrency): tests that fail on the code as landed.

// Defect: the slots left are kept as int32 (decision.slotLeft, set at
// concurrency.go:103 as int32(n-inUse)), and validation accepts any
// concurrency, so `concurrency 4294967296` reports -1 slots left in the X-
// fields and the RateLimit item. Breaks: "RateLimit ... r=<slots left>"
// and the X- fields of a concurrency-only tier reporting its slots.
func TestReview23HugeConcurrencyReportsNegativeSlotsLeft(t *testing.T) {
	h := new(Handler)
	if err := json.Unmarshal([]byte(`{"name":"review23_huge","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"all","concurrency":4294967296}]}`), h); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		// Refusing the value, naming it, would be a fix too.
		if !strings.Contains(err.Error(), "4294967296") {
			t.Fatalf("refused without naming the value: %v", err)
		}
		return
	}
	defer h.Cleanup()
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	if got := w.Header().Get("X-Ratelimit-Remaining"); got != "4294967295" {
		t.Errorf("X-RateLimit-Remaining %q with one of 4294967296 slots in use; want 4294967295", got)
	}
	if got, want := w.Header().Get("RateLimit"), `"all-concurrency";r=4294967295`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
}

// Defect: a request refused by the tier's rate limit never asks for a
// slot, and its RateLimit field reports the concurrency item with r=0
// (slotLeft's zero value, decision.go appendIETF -> appendConcurrencyItem)
// although no request of the client is in flight and every slot is free.
// Breaks: `"<tier>-concurrency";r=<slots left>`.
func TestReview23RateRefusedRequestReportsNoSlotsLeft(t *testing.T) {
	useFakeClock(t)
	h, done := provisionedHandler(t, `{"name":"review23_rate_refused","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"default","capacity":1,"refill":"1/m","concurrency":5}]}`)
	defer done()
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	if g := inFlightNow(t, "review23_rate_refused", "default"); g != 0 {
		t.Fatalf("in_flight %v after the first request ended", g)
	}
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err == nil {
		t.Fatal("the second request was not refused by the rate limit")
	}
	got := w.Header().Get("RateLimit")
	if strings.Contains(got, `"default-concurrency";r=0`) {
		t.Errorf("RateLimit %q: the concurrency item says no slot is left, while all 5 are free (nothing in flight)", got)
	}
}

// Defect: the slots of requests still running through an unloaded config
// are renewed through that config's Redis connection, which the last
// config to let go of it closes (store_redis.go Cleanup -> redisPool.Delete
// -> Conn.Close) when a reload changes any connection setting (here only
// timeout). Renewals then fail, the running request's slot expires after
// slot_ttl, and the client gets more than n requests in flight. Breaks: "a
// reload keeps slots of running requests" and "at most n in flight".
func TestReview23ReloadChangingRedisTimeoutDropsSlotsOfRunningRequests(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	cfg := func(timeout string) string {
		return fmt.Sprintf(`{"name":"review23_reload_conn","keys":[{"keyer":"header","field":"X-Key"}],"store":{"store":"redis","addresses":[%q],"timeout":%s,"slot_ttl":300000000},"tiers":[{"name":"all","concurrency":1}]}`, srv.addr(), timeout)
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
