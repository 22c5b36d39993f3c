package ratelimit

import (
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// A request refused before its take (no_key deny, a cost that is not
// one) still has a moment: its {http.rate_limit.reset} is the coming
// second, not a time before 1970.
func TestARequestRefusedBeforeItsTakeResetsNow(t *testing.T) {
	for _, tt := range []struct{ name, cfg string }{
		{"no_key deny", `{"name":"hot-nokey","no_key":"deny","keys":[{"keyer":"header","field":"X-Key"}],"tiers":[{"name":"default","capacity":10,"refill":"1/s"}]}`},
		{"bad cost", `{"name":"hot-cost","tiers":[{"name":"default","capacity":10,"refill":"1/s","cost_placeholder":"{http.request.header.X-Cost}"}]}`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, done := provisionedHandler(t, tt.cfg)
			defer done()
			r := benchRequest("127.0.0.1")
			r.Header.Set("X-Cost", "many")
			before := time.Now().Unix()
			if err := h.ServeHTTP(&headerSink{h: make(http.Header)}, r, nopHandler); err == nil {
				t.Fatal("let through; want refused")
			}
			after := time.Now().Unix() + 1
			repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			v, _ := repl.Get("http.rate_limit.reset")
			if reset, ok := v.(int64); !ok || reset < before || reset > after {
				t.Errorf("reset %v, want a second from %d to %d", v, before, after)
			}
		})
	}
}

// The moment a handler hands its local buckets (LocalStore.takeAt) is on
// their monotonic clock, monotonicMicros, read from the monotonic reading
// of the handler's time.Now: not the wall clock, which may jump.
func TestTheRequestsMomentIsOnTheMonotonicClock(t *testing.T) {
	for range 1000 {
		before := monotonicMicros()
		at := time.Now()
		after := monotonicMicros()
		if m := monotonicAt(at); m < before || m > after {
			t.Fatalf("monotonicAt %d, want from %d to %d", m, before, after)
		}
		// The same wall time without its monotonic reading would be read
		// from the wall clock: the moment must carry one.
		if !strings.Contains(at.String(), " m=") {
			t.Fatalf("the moment %s carries no monotonic reading", at)
		}
	}
}
