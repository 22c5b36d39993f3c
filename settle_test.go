package ratelimit

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A count_status give-back across a reload that changed the tier's rate
// limits and kept its quotas returns the request's tokens to the quotas,
// which count what was admitted; to the limits, only what the reload lets
// them take back: a limit whose refill grew takes back the token, one
// whose refill shrank, or one the reload added, nothing (never more than
// a response that counts leaves).
// Regression test for issue 30 item 4.
func TestAGiveBackAfterAReloadThatChangesTheLimitsReturnsToTheQuotas(t *testing.T) {
	srv := startRedis(t)
	redis := `"store":{"store":"redis","addresses":["` + srv.url() + `"],"timeout":"2s"`
	for _, mode := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "," + redis + "}"},
		{"redis lease 50%", "," + redis + `,"lease":"50%"}`},
	} {
		t.Run(mode.name, func(t *testing.T) { giveBackAcrossAReload(t, srv, mode.store) })
	}
}

// giveBackAcrossAReload checks, with the store store (JSON; srv's when
// Redis), a give-back across reloads that change the tier's limits in
// several ways.
func giveBackAcrossAReload(t *testing.T, srv *redisServer, store string) {
	for _, tt := range []struct {
		name, before, after string
		limitBack           int // tokens the binding limit takes back
	}{
		{"one limit, refill doubled", `"capacity":3,"refill":"1/h"`, `"capacity":3,"refill":"2/h"`, 1},
		{"one limit, refill halved", `"capacity":3,"refill":"2/h"`, `"capacity":3,"refill":"1/h"`, 0},
		{"several limits, one refill doubled", `"limits":[{"capacity":3,"refill":"1/h"},{"capacity":20,"refill":"1/h"}]`, `"limits":[{"capacity":3,"refill":"2/h"},{"capacity":20,"refill":"1/h"}]`, 1},
		{"several limits, one added", `"limits":[{"capacity":3,"refill":"1/h"},{"capacity":20,"refill":"1/h"}]`, `"limits":[{"capacity":3,"refill":"1/h"},{"capacity":20,"refill":"1/h"},{"capacity":50,"refill":"1/h"}]`, 0},
	} {
		for _, q := range []struct{ name, quotas string }{{", a day quota", `,"quotas":["5/day"]`}, {"", ""}} {
			quotas := q.quotas
			t.Run(tt.name+q.name, func(t *testing.T) {
				quota, limit := giveBackOnce(t, srv, store+`,"tiers":[{"name":"default",`, tt.before+quotas+"}]}", tt.after+quotas+"}]}")
				if quotas != "" && (quota[0] != 4 || quota[1] != 3) {
					t.Errorf("the next request leaves %d of 5/day after a 200 (uncounted), %d after a 401; want 4 and 3: the quota keeps counting a request that did not count", quota[0], quota[1])
				}
				if limit[0] != limit[1]+tt.limitBack {
					t.Errorf("the next request leaves %d of the binding limit after a 200, %d after a 401; want %d more after the 200", limit[0], limit[1], tt.limitBack)
				}
			})
		}
	}
}

// giveBackOnce serves the same request through a handler of the config
// prefix+before whose origin reloads prefix+after, answered 200 (does not
// count: given back) and 401 (counts), each in a policy of its own, and
// returns, for each, what the next request leaves of the day quota (-1
// for none) and of the binding limit.
func giveBackOnce(t *testing.T, srv *redisServer, prefix, before, after string) (quota, limit [2]int) {
	// Frozen, so that no limit refills; at the real time, which a
	// give-back names its quota period by (the request's start).
	useFakeClock(t).micros.Store(time.Now().UnixMicro())
	srv.do("FLUSHALL")
	for i, status := range []int{http.StatusOK, http.StatusUnauthorized} {
		cfg := func(tier string) string {
			return `{"name":"settle-reload-` + strconv.Itoa(i) + `","count_status":["401"],"headers":"both"` + prefix + tier
		}
		old, doneOld := provisionedHandler(t, cfg(before))
		t.Cleanup(doneOld)
		var running *Handler
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			var doneNew func()
			running, doneNew = provisionedHandler(t, cfg(after))
			t.Cleanup(doneNew)
			_ = old.Cleanup()
			w.WriteHeader(status)
			return nil
		})
		if code := review25Serve(t, old, "127.0.0.3", next); code != status {
			t.Fatalf("the request across the reload: %d", code)
		}
		quota[i], limit[i] = nextRequestLeft(t, running, "127.0.0.3")
	}
	return quota, limit
}

// nextRequestLeft sends one more request of the client at ip through h,
// and returns what its day quota (-1 for none) and its binding limit have
// left after it.
func nextRequestLeft(t *testing.T, h *Handler, ip string) (quota, limit int) {
	t.Helper()
	rec := httptest.NewRecorder()
	if err := h.ServeHTTP(rec, benchRequest(ip), nopHandler); err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	quota = -1
	if m := regexp.MustCompile(`"default-day";r=(\d+);`).FindStringSubmatch(rec.Header().Get("RateLimit")); m != nil {
		quota, _ = strconv.Atoi(m[1])
	}
	limit, err := strconv.Atoi(rec.Header().Get("X-RateLimit-Remaining"))
	if err != nil {
		t.Fatalf("X-RateLimit-Remaining %q", rec.Header().Get("X-RateLimit-Remaining"))
	}
	return quota, limit
}
