package ratelimit

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// The X-RateLimit-* and RateLimit fields a handler writes (headers.go).

// A concurrency of 4294967296 reports 4294967295 slots left, in the X-
// fields and the RateLimit item alike, once one is in use; refusing the
// value, naming it, would do too.
// Regression test for 4566696.
func TestAHugeConcurrencyReportsItsSlotsLeft(t *testing.T) {
	t.Parallel()
	h := new(Handler)
	if err := json.Unmarshal([]byte(`{"name":"headers_huge_concurrency","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"all","concurrency":4294967296}]}`), h); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		if !strings.Contains(err.Error(), "4294967296") {
			t.Fatalf("refused without naming the value: %v", err)
		}
		return
	}
	defer h.Cleanup()
	w, err := serveOne(h, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err != nil {
		t.Fatal(err)
	}
	if got := w.Header().Get("X-Ratelimit-Remaining"); got != "4294967295" {
		t.Errorf("X-RateLimit-Remaining %q with one of 4294967296 slots in use; want 4294967295", got)
	}
	if got, want := w.Header().Get("RateLimit"), `"all-concurrency";r=4294967295`; got != want {
		t.Errorf("RateLimit %q, want %q", got, want)
	}
}

// A request the tier's rate limit refuses never asks for a slot, and its
// RateLimit field does not say that no slot is left while every slot is
// free (nothing of the client in flight).
// Regression test for 4566696.
func TestARateRefusedRequestDoesNotReportTheFreeSlotsAsTaken(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"headers_rate_refused","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"default","capacity":1,"refill":"1/m","concurrency":5}]}`)
	defer done()
	if _, err := serveOne(h, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	if g := inFlightNow(t, "headers_rate_refused", "default"); g != 0 {
		t.Fatalf("in_flight %v after the first request ended", g)
	}
	w, err := serveOne(h, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err == nil {
		t.Fatal("the second request was not refused by the rate limit")
	}
	if got := w.Header().Get("RateLimit"); strings.Contains(got, `"default-concurrency";r=0`) {
		t.Errorf("RateLimit %q: the concurrency item says no slot is left, while all 5 are free (nothing in flight)", got)
	}
}
