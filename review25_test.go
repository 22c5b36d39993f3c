package ratelimit

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// review25Serve runs one request through h, with next as the rest of the
// route, for the client at ip.
func review25Serve(t *testing.T, h *Handler, ip string, next caddyhttp.Handler) int {
	t.Helper()
	rec := httptest.NewRecorder()
	err := h.ServeHTTP(rec, benchRequest(ip), next)
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode
	}
	if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	return rec.Code
}

// review25Remaining sends one more request of the client through h and
// returns its X-RateLimit-Remaining (the binding limit's, after it).
func review25Remaining(t *testing.T, h *Handler, ip string) string {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := h.ServeHTTP(rec, benchRequest(ip), nopHandler); err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	return rec.Header().Get("X-RateLimit-Remaining")
}

// reloadMidRequest serves one request from ip through a handler of cfg
// whose origin reloads the same config (the new handler provisioned, the
// old cleaned up, as Caddy does), sets the response's headers with
// answer, and answers 200. It returns the handler that runs after.
func reloadMidRequest(t *testing.T, cfg, ip string, answer func(http.ResponseWriter)) *Handler {
	t.Helper()
	old, doneOld := provisionedHandler(t, cfg)
	t.Cleanup(doneOld)
	var running *Handler
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		var doneNew func()
		running, doneNew = provisionedHandler(t, cfg)
		t.Cleanup(doneNew)
		_ = old.Cleanup()
		answer(w)
		w.WriteHeader(http.StatusOK)
		return nil
	})
	if code := review25Serve(t, old, ip, next); code != 200 {
		t.Fatalf("the request: %d", code)
	}
	return running
}

// Defect: settle.go giveBackTaken (settle.go:162-166) and
// chargeFromResponse (settle.go:129-131) do nothing for a tier of several
// limits once the handler that took is no longer live (takerLive,
// settle.go:164 and 129, defined at settle.go:186), whatever the reload changed: a reload of the very same
// config, or one that only touched another site, while a request is at
// the origin drops its count_status give-back. The one-limit path looks
// the tier up in the running config (liveLimit) and gives back. Breaks
// DESIGN §14 / README "a response that does not count gives its tokens
// back to every limit" (count_status: "yes, several limits too").
func TestReview25GiveBackOfSeveralLimitsSurvivesAReloadThatChangesNothing(t *testing.T) {
	for _, tt := range []struct{ name, tier string }{
		{"one limit", `"capacity":3,"refill":"1/h"`},
		{"several limits", `"limits":[{"capacity":3,"refill":"1/h"},{"capacity":20,"refill":"24/24h"}]`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := `{"name":"review25-reload-` + strings.ReplaceAll(tt.name, " ", "-") + `","count_status":["401"],"tiers":[{"name":"default",` + tt.tier + `}]}`
			// The origin answers 200 (does not count).
			running := reloadMidRequest(t, cfg, "127.0.0.7", func(http.ResponseWriter) {})
			// The next request (a 200 too, but counted here as taken) leaves 2.
			if got := review25Remaining(t, running, "127.0.0.7"); got != "2" {
				t.Errorf("after a 200 (uncounted) across a reload of the same config, the next request sees %s of 3 left, want 2: the give-back was dropped", got)
			}
		})
	}
}

// Defect: the same for cost_from_response: a reload of the same config
// while the request is at the origin makes the origin's reported cost
// free for a tier of several limits (settle.go:129-131), while a tier of
// one limit is charged. Breaks "a cost reported by the origin is taken
// from every limit" (README: cost_from_response "yes, several limits
// too").
func TestReview25ChargeOfSeveralLimitsSurvivesAReloadThatChangesNothing(t *testing.T) {
	for _, tt := range []struct{ name, tier string }{
		{"one limit", `"capacity":100,"refill":"1/h"`},
		{"several limits", `"limits":[{"capacity":100,"refill":"1/h"},{"capacity":1000,"refill":"24/24h"}]`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := `{"name":"review25-charge-` + strings.ReplaceAll(tt.name, " ", "-") + `","tiers":[{"name":"default","cost_from_response":"X-Used",` + tt.tier + `}]}`
			running := reloadMidRequest(t, cfg, "127.0.0.8", func(w http.ResponseWriter) { w.Header().Set("X-Used", "40") })
			// The next request: 100-1-40-1 left.
			if got := review25Remaining(t, running, "127.0.0.8"); got != "58" {
				t.Errorf("after a reported cost of 40 across a reload of the same config, the next request sees %s of 100 left, want 58: the charge was dropped", got)
			}
		})
	}
}

// Defect: the admin API reads a tier of several limits by a take of cost
// 0 (admin.go:261, readBucket: "without changing them"), and with ban and
// max_wait that take is refused for a client in debt (cost_from_response)
// beyond max_wait, and the refusal starts a ban (internal/bucket
// takeAll's short + ban, internal/bucket/bucket.go:242 and 290; the
// Lua take's short + ban_one, internal/redisbucket/script.go:454 and 280).
// So an operator's GET /rate_limit/buckets bans a client who would have
// been let in once the debt was paid: here, a client that waits out its
// 3.4 s debt is let in, while the same client read by the admin API first
// is refused for the 1 h ban. Breaks "the admin API shows every limit ...
// of a bucket" as a read (DESIGN §14), and "ban ... several limits too"
// (a ban starts at a refused request).
func TestReview25AdminReadOfSeveralLimitsStartsNoBan(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			policy := fmt.Sprintf("review25_adminban_%d", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		key header X-Key
		tier api {
			limit 5 5/s
			limit 1000 1/h
			cost_from_response X-Used
		}
		max_wait 1s
		ban 1h
		%s
	}
	header X-Used 20
	respond ok`, policy, mode.store))
			for _, k := range []string{"read", "control"} {
				if r := s.get("/", "X-Key: "+k); r.status != 200 {
					t.Fatalf("first request of %s: %d", k, r.status)
				}
			}
			// Charged 20: limit 1 lacks 21 of 5 tokens at 5/s, 3.4 s of debt
			// beyond the one token the next request takes, 2.4 s past max_wait.
			resp, err := http.Get(admin + "/rate_limit/buckets?policy=" + policy + "&tier=api&keyer=header&value=read")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("admin GET: %d", resp.StatusCode)
			}
			time.Sleep(3600 * time.Millisecond)
			if r := s.get("/", "X-Key: control"); r.status != 200 {
				t.Fatalf("control, unread, after its debt: %d (Retry-After %s), want 200", r.status, r.header.Get("Retry-After"))
			}
			if r := s.get("/", "X-Key: read"); r.status != 200 {
				t.Errorf("the client the admin API read, after its debt: %d, Retry-After %s; want 200 as the unread client got: the admin read started a ban", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}
