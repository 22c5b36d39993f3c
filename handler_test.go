package ratelimit

import (
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
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
	t.Parallel()
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
	clock := newFakeClock()
	clock.micros.Store(time.Now().UnixMicro())
	srv.do("FLUSHALL")
	for i, status := range []int{http.StatusOK, http.StatusUnauthorized} {
		cfg := func(tier string) string {
			return `{"name":"settle-reload-` + strconv.Itoa(i) + `","count_status":["401"],"headers":"both"` + prefix + tier
		}
		w, running := reloadMidRequest(t, clock.clocks(), cfg(before), cfg(after), "127.0.0.3", func(w http.ResponseWriter, _ *Handler) {
			w.WriteHeader(status)
		})
		if w.Code != status {
			t.Fatalf("the request across the reload: %d", w.Code)
		}
		quota[i], limit[i] = nextRequestLeft(t, running, "127.0.0.3")
	}
	return quota, limit
}

// reloadMidRequest serves one request of the client at ip through a
// handler of the config before, on the clocks c, whose origin reloads the
// config after (the new handler provisioned, the old cleaned up, as Caddy
// does) and then answers with answer, which the new handler is handed to.
// It returns the response and the handler that runs after.
func reloadMidRequest(t *testing.T, c clocks, before, after, ip string, answer func(w http.ResponseWriter, running *Handler)) (*httptest.ResponseRecorder, *Handler) {
	t.Helper()
	old, doneOld := provisionedHandlerOn(t, c, before)
	t.Cleanup(doneOld)
	var running *Handler
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		var doneNew func()
		running, doneNew = provisionedHandlerOn(t, c, after)
		t.Cleanup(doneNew)
		_ = old.Cleanup()
		answer(w, running)
		return nil
	})
	w, err := serveOne(old, benchRequest(ip), next)
	if w.Code == http.StatusInternalServerError {
		t.Fatalf("the request across the reload: %v", err)
	}
	return w, running
}

// nextRequestLeft sends one more request of the client at ip through h,
// and returns what its day quota (-1 for none) and its binding limit have
// left after it.
func nextRequestLeft(t *testing.T, h *Handler, ip string) (quota, limit int) {
	t.Helper()
	rec, err := serveOne(h, benchRequest(ip), nopHandler)
	if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	quota = -1
	if m := regexp.MustCompile(`"default-day";r=(\d+);`).FindStringSubmatch(rec.Header().Get("RateLimit")); m != nil {
		quota, _ = strconv.Atoi(m[1])
	}
	limit, err = strconv.Atoi(rec.Header().Get("X-RateLimit-Remaining"))
	if err != nil {
		t.Fatalf("X-RateLimit-Remaining %q", rec.Header().Get("X-RateLimit-Remaining"))
	}
	return quota, limit
}

// A count_status give-back (the origin answers 200, which does not count)
// and a cost_from_response charge (the origin reports 40) of a request
// caught by a reload of the very same config count in the running config,
// for a tier of one limit and of several alike.
// Regression test for 1b00d1d.
func TestAGiveBackOrAChargeAcrossAReloadThatChangesNothingCounts(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, settle, tier string
		answer             func(http.ResponseWriter, *Handler)
		want, what         string
	}{
		{"give-back, one limit", `"count_status":["401"]`, `"capacity":3,"refill":"1/h"`,
			func(http.ResponseWriter, *Handler) {}, "2", "after a 200 (uncounted) across a reload of the same config, the next request sees %s of 3 left, want %s: the give-back was dropped"},
		{"give-back, several limits", `"count_status":["401"]`, `"limits":[{"capacity":3,"refill":"1/h"},{"capacity":20,"refill":"24/24h"}]`,
			func(http.ResponseWriter, *Handler) {}, "2", "after a 200 (uncounted) across a reload of the same config, the next request sees %s of 3 left, want %s: the give-back was dropped"},
		// The next request: 100-1-40-1 left.
		{"charge, one limit", `"headers":"x"`, `"cost_from_response":"X-Used","capacity":100,"refill":"1/h"`,
			func(w http.ResponseWriter, _ *Handler) { w.Header().Set("X-Used", "40") }, "58", "after a reported cost of 40 across a reload of the same config, the next request sees %s of 100 left, want %s: the charge was dropped"},
		{"charge, several limits", `"headers":"x"`, `"cost_from_response":"X-Used","limits":[{"capacity":100,"refill":"1/h"},{"capacity":1000,"refill":"24/24h"}]`,
			func(w http.ResponseWriter, _ *Handler) { w.Header().Set("X-Used", "40") }, "58", "after a reported cost of 40 across a reload of the same config, the next request sees %s of 100 left, want %s: the charge was dropped"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := `{"name":"reload-settle-` + strings.ReplaceAll(tt.name, " ", "-") + `",` + tt.settle + `,"tiers":[{"name":"default",` + tt.tier + `}]}`
			w, running := reloadMidRequest(t, clocks{}, cfg, cfg, "127.0.0.7", func(w http.ResponseWriter, h *Handler) {
				tt.answer(w, h)
				w.WriteHeader(http.StatusOK)
			})
			if w.Code != http.StatusOK {
				t.Fatalf("the request across the reload: %d", w.Code)
			}
			w, err := serveOne(running, benchRequest("127.0.0.7"), nopHandler)
			if err != nil {
				t.Fatalf("ServeHTTP: %v", err)
			}
			if got := w.Header().Get("X-RateLimit-Remaining"); got != tt.want {
				t.Errorf(tt.what, got, tt.want)
			}
		})
	}
}

// A request caught by a reload that adds 1000/month to its tier's 50/day
// (Redis strict mode) gives back under the old handler; the month's count,
// which the new config keeps from the reload on, stays: the old give-back
// names fewer quotas, and must not start the month over.
// Regression test for 3cb8e39.
func TestAnOldGiveBackAfterAReloadThatAddsAQuotaKeepsItsCount(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	store := `"store":{"store":"redis","addresses":["` + srv.url() + `"],"timeout":"2s"}`
	oldCfg := `{"name":"give-back-adds-quota","count_status":["401"],"headers":"ietf",` + store + `,"tiers":[{"name":"default","capacity":100,"refill":"100/1s","quotas":["50/day"]}]}`
	newCfg := `{"name":"give-back-adds-quota","count_status":["401"],"headers":"ietf",` + store + `,"tiers":[{"name":"default","capacity":100,"refill":"100/1s","quotas":["50/day","1000/month"]}]}`
	unauthorized := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(http.StatusUnauthorized) // counts
		return nil
	})
	w, running := reloadMidRequest(t, clocks{}, oldCfg, newCfg, "127.0.0.9", func(w http.ResponseWriter, running *Handler) {
		// The new config admits 5 requests that count while this one is at
		// the origin.
		for range 5 {
			if w, _ := serveOne(running, benchRequest("127.0.0.9"), unauthorized); w.Code != 401 {
				t.Errorf("a request under the new config: %d", w.Code)
			}
		}
		w.WriteHeader(http.StatusOK) // does not count: given back
	})
	if w.Code != 200 {
		t.Fatalf("the request across the reload: %d", w.Code)
	}
	after, _ := serveOne(running, benchRequest("127.0.0.9"), unauthorized)
	// 6 counted this month since the month quota was added.
	if header := after.Header().Get("RateLimit"); !strings.Contains(header, `"default-month";r=994`) {
		t.Errorf("RateLimit after an old request's give-back: %q; want the month's r=994 (6 counted): the give-back dropped the month's count", header)
	}
}

// Handlers of one name share buckets across routes, and a give-back counts
// in the tier of the handler that took the tokens, not of the last route
// of the policy loaded: a login route of policy `site` with a tier `login`
// (3 an hour, count_status 401) and the site's catch-all route of the same
// policy without that tier (the control: under another policy name). Every
// right password is given back, so ten pass.
// Regression test for 5097eca.
func TestAGiveBackCountsInTheTakersTierWhenAnotherRouteOfThePolicyLacksIt(t *testing.T) {
	for _, other := range []string{"other", "site"} {
		t.Run("catch-all policy "+other, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, `
	handle /login {
		rate_limit 100 10/s {
			name site
			key header X-User
			count_status 401
			tier login 3 1/h {
				match {
					path /login
				}
			}
		}
		@wrong header X-Password wrong
		respond @wrong "wrong password" 401
		respond "welcome"
	}
	handle {
		rate_limit 100 10/s {
			name `+other+`
			key header X-User
		}
		respond "ok"
	}`)
			for i := range 10 {
				if r := s.get("/login", "X-User: ann", "X-Password: right"); r.status != 200 {
					t.Fatalf("right password %d at /login: %d, want 200: successes are given back (count_status 401)", i+1, r.status)
				}
			}
		})
	}
}
