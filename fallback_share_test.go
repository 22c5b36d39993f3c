package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The share of on_store_error local: its syntax, and what a node cut off
// from its shared store enforces with it.

func TestOnStoreErrorLocalTakesAShareAndReconcile(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args, share string
		reconcile   bool
	}{
		{"local 1/4", "1/4", false},
		{"local 0.25", "0.25", false},
		{"local 1", "1", false},
		{"local 1/6 reconcile", "1/6", true},
		{"local reconcile", "", true},
		{"local .5", ".5", false},
	} {
		cfg, err := adaptSite(`rate_limit 10 1/s {
			store redis
			on_store_error ` + c.args + `
		}`)
		if err != nil {
			t.Errorf("on_store_error %s: %v", c.args, err)
			continue
		}
		h := handlerJSON(t, cfg)
		share, _ := h["on_store_error_share"].(string)
		reconcile, _ := h["on_store_error_reconcile"].(bool)
		if h["on_store_error"] != "local" || share != c.share || reconcile != c.reconcile {
			t.Errorf("on_store_error %s adapted to on_store_error %v, share %q, reconcile %v; want local, %q, %v",
				c.args, h["on_store_error"], share, reconcile, c.share, c.reconcile)
		}
	}
}

func TestOnStoreErrorRefusesABadShareNamingIt(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, body string
		want       []string
	}{
		{"zero", "store redis\non_store_error local 0", []string{`"0"`, "share"}},
		{"above one", "store redis\non_store_error local 5/4", []string{`"5/4"`, "at most 1"}},
		{"negative", "store redis\non_store_error local -1/4", []string{`"-1/4"`}},
		{"no denominator", "store redis\non_store_error local 1/0", []string{`"1/0"`}},
		{"a word", "store redis\non_store_error local half", []string{`"half"`}},
		{"seven places", "store redis\non_store_error local 0.1234567", []string{`"0.1234567"`}},
		{"an exponent", "store redis\non_store_error local 1e-1", []string{`"1e-1"`}},
		{"a percent", "store redis\non_store_error local 25%", []string{`"25%"`}},
		{"after reconcile", "store redis\non_store_error local reconcile 1/4", []string{`"1/4"`}},
		{"share with allow", "store redis\non_store_error allow 1/4", []string{"allow", "1/4", "local only"}},
		{"reconcile with deny", "store redis\non_store_error deny reconcile", []string{"deny", "reconcile", "local only"}},
		{"share beside the local store", "on_store_error local 1/4", []string{"1/4", "shared store"}},
		{"reconcile beside the local store", "store local\non_store_error local reconcile", []string{"reconcile", "shared store"}},
	} {
		_, err := adaptSite("rate_limit 10 1/s {\n" + c.body + "\n}")
		if err == nil {
			t.Errorf("%s: adapted; want an error", c.name)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %v; want it to name %s", c.name, err, w)
			}
		}
	}
}

// TestOnStoreErrorShareIsCheckedInJSONToo: a config written in JSON meets
// the same checks at provision as a Caddyfile at adapt.
func TestOnStoreErrorShareIsCheckedInJSONToo(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ json, want string }{
		{`"store":{"store":"redis"},"on_store_error_share":"2"`, `"2"`},
		{`"store":{"store":"redis"},"on_store_error":"deny","on_store_error_share":"1/2"`, "local only"},
		{`"on_store_error_reconcile":true`, "shared store"},
	} {
		h := new(Handler)
		cfg := `{"tiers":[{"name":"t","capacity":10,"refill":"1/s"}],` + c.json + `}`
		if err := json.Unmarshal([]byte(cfg), h); err != nil {
			t.Fatal(err)
		}
		if err := h.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: Validate said %v; want an error naming %s", c.json, err, c.want)
		}
	}
}

// deadRedisHandler provisions a handler of the tiers on a Redis store that
// nothing answers, with on_store_error as given, reading clock.
func deadRedisHandler(t *testing.T, clock *fakeClock, name, onStoreError, tiers string) *Handler {
	t.Helper()
	h, done := provisionedHandlerOn(t, clock.clocks(), fmt.Sprintf(`{
		"name": %q,
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms"},
		%s,
		"tiers": %s
	}`, name, freePort(t), onStoreError, tiers))
	t.Cleanup(done)
	return h
}

// TestACutOffNodeWithAQuarterShareAdmitsItsPart: with `local 1/4`, a node
// that cannot reach Redis admits floor(C/4) at once and floor(r/4 x T)
// over T, and its headers report the limit it enforces.
func TestACutOffNodeWithAQuarterShareAdmitsItsPart(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	const capacity, perSecond = 22, 10 // floor(22/4) = 5; 10/4 = 2.5/s
	h := deadRedisHandler(t, clock, "share-quarter", `"headers": "both", "on_store_error": "local", "on_store_error_share": "1/4"`,
		fmt.Sprintf(`[{"name": "t", "capacity": %d, "refill": "%d/s"}]`, capacity, perSecond))
	admitted := func() (n int, limit, policy string) {
		for {
			w, _ := serveOne(h, benchRequest("192.0.2.7"), nopHandler)
			if w.Code != http.StatusOK {
				return n, limit, policy
			}
			n++
			limit, policy = w.Header().Get("X-RateLimit-Limit"), w.Header().Get("RateLimit-Policy")
		}
	}
	n, limit, policy := admitted()
	if want := capacity / 4; n != want || limit != fmt.Sprint(want) || !strings.Contains(policy, fmt.Sprintf(";q=%d;", want)) {
		t.Fatalf("cut off, at once: %d admitted with X-RateLimit-Limit %q and RateLimit-Policy %q; want %d and q=%d (floor(C/4))", n, limit, policy, want, want)
	}
	const seconds = 2 // within the time the scaled bucket takes to refill whole
	clock.advance(seconds * time.Second)
	if n, _, _ := admitted(); n != perSecond*seconds/4 {
		t.Fatalf("cut off, %d s later: %d admitted; want %d (floor(r/4 x T))", seconds, n, perSecond*seconds/4)
	}
}

// TestTheShareScalesQuotasAndConcurrency: a cut-off node enforces its
// share of each quota's n and of concurrency, rounded down.
func TestTheShareScalesQuotasAndConcurrency(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	h := deadRedisHandler(t, clock, "share-quota", `"on_store_error": "local", "on_store_error_share": "0.5"`,
		`[{"name": "t", "quotas": ["9/day"]}]`)
	n := 0
	for ; n < 20; n++ {
		if w, _ := serveOne(h, benchRequest("192.0.2.8"), nopHandler); w.Code != http.StatusOK {
			break
		}
	}
	if n != 4 {
		t.Errorf("a quota of 9/day with share 0.5, cut off: %d admitted; want 4", n)
	}

	h = deadRedisHandler(t, clock, "share-concurrency", `"on_store_error": "local", "on_store_error_share": "1/3"`,
		`[{"name": "t", "concurrency": 7}]`)
	release := make(chan struct{})
	held := make(chan struct{}, 10)
	blocking := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		held <- struct{}{}
		<-release
		return nil
	})
	var wg sync.WaitGroup
	codes := make(chan int, 10)
	for range 2 { // floor(7/3) = 2 may be in flight
		wg.Add(1)
		go func() {
			defer wg.Done()
			w, _ := serveOne(h, benchRequest("192.0.2.9"), blocking)
			codes <- w.Code
		}()
		<-held
	}
	w, _ := serveOne(h, benchRequest("192.0.2.9"), nopHandler)
	close(release)
	wg.Wait()
	if w.Code != http.StatusTooManyRequests || w.Header().Get("X-RateLimit-Limit") != "2" {
		t.Errorf("a third request in flight with concurrency 7 and share 1/3, cut off: %d with X-RateLimit-Limit %q; want 429 and 2",
			w.Code, w.Header().Get("X-RateLimit-Limit"))
	}
	close(codes)
	for c := range codes {
		if c != http.StatusOK {
			t.Errorf("a request within the share's concurrency: %d, want 200", c)
		}
	}
}
