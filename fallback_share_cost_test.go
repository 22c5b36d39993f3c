package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// A tier whose cost comes from a placeholder accepts any cost up to its
// smallest capacity; a node cut off from its store, enforcing its share,
// must still be able to admit each of them, or its Retry-After would
// never come true.

// TestACutOffNodeAdmitsEveryCostTheTierAcceptsOnceItsRetryAfterPasses
// sends, with the store down and a share of 1/4, one request of the
// largest cost the tier accepts, and again each time its Retry-After has
// passed: it must be admitted within a few tries.
func TestACutOffNodeAdmitsEveryCostTheTierAcceptsOnceItsRetryAfterPasses(t *testing.T) {
	t.Parallel()
	for i, c := range []struct {
		what, tier string
		cost       int
	}{
		{"a limit", `{"name": "t", "capacity": 10, "refill": "1/s", "cost_placeholder": "{test.cost}"}`, 10},
		{"a limit and a quota", `{"name": "t", "capacity": 10, "refill": "10/s", "quotas": ["12/day"], "cost_placeholder": "{test.cost}"}`, 10},
		{"a quota alone", `{"name": "t", "quotas": ["12/day"], "cost_placeholder": "{test.cost}"}`, 12},
	} {
		clock := newFakeClock()
		h := deadRedisHandler(t, clock, fmt.Sprintf("share-cost-%d", i), `"headers": "both", "on_store_error": "local", "on_store_error_share": "1/4"`, "["+c.tier+"]")
		admitted := false
		var last string
		for try := 0; try < 3 && !admitted; try++ {
			r := benchRequest("192.0.2.30")
			r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).Set("test.cost", strconv.Itoa(c.cost))
			w, _ := serveOne(h, r, nopHandler)
			if w.Code == http.StatusOK {
				admitted = true
				break
			}
			last = fmt.Sprintf("%d, Retry-After %q, RateLimit-Policy %q", w.Code, w.Header().Get("Retry-After"), w.Header().Get("RateLimit-Policy"))
			secs, err := strconv.Atoi(w.Header().Get("Retry-After"))
			if w.Code != http.StatusTooManyRequests || err != nil {
				break
			}
			clock.advance(time.Duration(secs) * time.Second)
		}
		if !admitted {
			t.Errorf("%s, cut off with share 1/4: a request of cost %d, which the tier accepts, was never admitted, its Retry-After waited out each time; last answer %s",
				c.what, c.cost, last)
		}
	}
}
