package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"
)

// `credit <k>` in `store redis` (issue 35): it needs lease, and refuses a
// tier with a quota, each at adapt with the reason.
func TestCreditCaddyfile(t *testing.T) {
	t.Parallel()
	cfg, err := adaptSite(`rate_limit 200 50/s {
		store redis {
			address redis://127.0.0.1:6379
			lease 10%
			credit 2
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	store := handlerJSON(t, cfg)["store"].(map[string]any)
	if store["credit"] != float64(2) {
		t.Errorf("store JSON %v, want credit 2", store)
	}
	for _, tt := range []struct{ site, want string }{
		{"rate_limit 10 1/s {\n store redis {\n credit 2\n }\n }", "credit 2 needs lease"},
		{"rate_limit 10 1/s {\n store redis {\n lease 1\n credit 2\n }\n }", "credit 2 needs lease"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit -1\n }\n }", "credit -1: want 0 to"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit\n }\n }", "credit: want exactly one number"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit 1\n credit 2\n }\n }", "credit: given twice"},
		{"rate_limit 10 1/s {\n quota 1000/day\n store redis {\n lease 5\n credit 1\n }\n }", "a quota is never in debt"},
	} {
		_, err := adaptSite(tt.site)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.site, err, tt.want)
		}
	}
}

// Through the handler, on a redis-server 50 ms away each way: a client's
// first request with `credit 1` answers at once, reading a full bucket
// less its cost, and the charge reaches Redis; the second waits on a lease
// call, as without credit.
func TestACreditedRequestAnswersWithoutWaitingOnRedis(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), 50*time.Millisecond)
	h, done := provisionedHandler(t, fmt.Sprintf(`{"name":"credited","store":{"store":"redis","addresses":[%q],"timeout":"2s","lease":"10%%","credit":1},"tiers":[{"name":"default","capacity":100,"refill":"1/h"}]}`, "redis://"+proxy.addr()))
	defer done()
	began := time.Now()
	w, err := serveOne(h, benchRequest("192.0.2.7"), nopHandler)
	took := time.Since(began)
	if err != nil || w.Code != http.StatusOK || took >= 25*time.Millisecond {
		t.Fatalf("the first request: %d %v after %v; want 200 well within the 100 ms round trip", w.Code, err, took)
	}
	if got := w.Header().Get("X-RateLimit-Remaining"); got != "99" {
		t.Errorf("the credited request reports %q left; want 99, a full bucket less its cost", got)
	}
	waitFor(t, 5*time.Second, "the charge to reach Redis", func() bool {
		keys, _ := srv.client().Keys(context.Background(), "rl:*").Result()
		return len(keys) == 1
	})
	began = time.Now()
	w, err = serveOne(h, benchRequest("192.0.2.7"), nopHandler)
	if took := time.Since(began); err != nil || w.Code != http.StatusOK || took < 100*time.Millisecond {
		t.Fatalf("the second request: %d %v after %v; want 200 after a lease call", w.Code, err, took)
	}
	if got := w.Header().Get("X-RateLimit-Remaining"); got != "98" {
		t.Errorf("the second request reports %q left; want 98", got)
	}
}
