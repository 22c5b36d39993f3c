package ratelimit

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Adversarial review of issue 25. Tests named ...Defect... FAIL on the
// code under review.

// review25bServe runs one request of the client at ip through h, with next
// as the rest of the route, and returns its status and RateLimit header.
func review25bServe(t *testing.T, h *Handler, ip string, next caddyhttp.Handler) (int, string) {
	t.Helper()
	rec := httptest.NewRecorder()
	err := h.ServeHTTP(rec, benchRequest(ip), next)
	if he, ok := err.(caddyhttp.HandlerError); ok {
		return he.StatusCode, rec.Header().Get("RateLimit")
	}
	if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	return rec.Code, rec.Header().Get("RateLimit")
}

// FAILS. End to end (Redis strict mode) of the redisbucket test
// TestReview25bDefectRedisGiveBackNamingFewerQuotasKeepsTheOthersCount.
// Breaks DESIGN section 13 (a quota starts over only at its boundary; "a
// reload that changes n keeps the count") and claim 3 (count_status works
// with quotas in Redis strict mode) across a reload.
//
// Mechanism: a reload adds `1000/month` to a tier that had `50/day` while
// a request is at the origin. Its count_status give-back runs under the
// old handler: settle.go giveBackTaken (settle.go:156-161) checks only
// sameLimitsRun (settle.go:189-202, limits compared, quotas not) and
// passes the OLD tier's quotas; the script (script.go:129-135) keeps
// only the counts of the quotas a call names, so the month's count, kept
// by the new config since the reload, is dropped: the month starts over.
//
// Fix: in the script, keep count segments of quotas the call does not
// name until their period ends (as extra keeps limits'); in settle.go,
// give back with the running tier's quotas (or nothing when they differ).
func TestReview25bDefectReloadAddingAQuotaKeepsItsCountAcrossAnOldGiveBack(t *testing.T) {
	srv := startRedis(t)
	store := `"store":{"store":"redis","addresses":["` + srv.url() + `"],"timeout":"2s"}`
	oldCfg := `{"name":"review25b-addquota","count_status":["401"],"headers":"ietf",` + store + `,"tiers":[{"name":"default","capacity":100,"refill":"100/1s","quotas":["50/day"]}]}`
	newCfg := `{"name":"review25b-addquota","count_status":["401"],"headers":"ietf",` + store + `,"tiers":[{"name":"default","capacity":100,"refill":"100/1s","quotas":["50/day","1000/month"]}]}`
	old, doneOld := provisionedHandler(t, oldCfg)
	defer doneOld()
	var running *Handler
	var doneNew func()
	unauthorized := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(http.StatusUnauthorized) // counts
		return nil
	})
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		// The reload, while this request is at the origin; the new config
		// admits 5 requests that count.
		running, doneNew = provisionedHandler(t, newCfg)
		_ = old.Cleanup()
		for range 5 {
			if code, _ := review25bServe(t, running, "127.0.0.9", unauthorized); code != 401 {
				t.Errorf("a request under the new config: %d", code)
			}
		}
		w.WriteHeader(http.StatusOK) // does not count: given back
		return nil
	})
	if code, _ := review25bServe(t, old, "127.0.0.9", next); code != 200 {
		t.Fatalf("the request across the reload: %d", code)
	}
	defer doneNew()
	_, header := review25bServe(t, running, "127.0.0.9", unauthorized)
	// 6 counted this month since the month quota was added.
	if !strings.Contains(header, `"default-month";r=994`) {
		t.Errorf("RateLimit after an old request's give-back: %q; want the month's r=994 (6 counted): the give-back dropped the month's count", header)
	}
}
