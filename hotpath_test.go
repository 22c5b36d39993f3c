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

// nameAndChoose names r's client and picks its tier, as ServeHTTP does.
func nameAndChoose(h *Handler, r *http.Request, d *decision) error {
	keyer, place := h.nameClient(r, d)
	return h.chooseTier(r, d, keyer, place)
}

// A request's bucket carries the prefix its handler hashed for the tier
// and keyer that named it (Tier.prefixes), and has the id of the same
// bucket named afresh, as the admin endpoint and a renamed copy name it:
// for each keyer, the fallback IP keyer and each tier, and every one
// apart from the others.
func TestARequestsBucketHasTheIDOfItsNameHashedAfresh(t *testing.T) {
	h, done := provisionedHandler(t, `{"name":"hot-prefix","keys":[{"keyer":"header","field":"X-Key"},{"keyer":"header","field":"X-Other"}],
		"tiers":[{"name":"gold","capacity":10,"refill":"1/s","match":[{"header":{"X-Plan":["gold"]}}]},{"name":"default","capacity":10,"refill":"1/s"}]}`)
	defer done()
	seen := map[uint64]string{}
	for _, header := range []string{"X-Key", "X-Other", ""} {
		for _, plan := range []string{"gold", ""} {
			r := benchRequest("127.0.0.1")
			if header != "" {
				r.Header.Set(header, "client")
			}
			if plan != "" {
				r.Header.Set("X-Plan", plan)
			}
			d := &decision{handler: h}
			if err := nameAndChoose(h, r, d); err != nil {
				t.Fatal(err)
			}
			b := d.bucket
			name := b.Tier + " " + b.Keyer
			if b.prefix == 0 {
				t.Errorf("%s: the request's bucket has no prefix", name)
			}
			fresh := Bucket{Policy: b.Policy, Tier: b.Tier, Keyer: b.Keyer, Value: b.Value}
			if got, want := localID(&b), localID(&fresh); got != want {
				t.Errorf("%s: id %x from the handler's prefix, %x hashed afresh", name, got, want)
			}
			if other, ok := seen[localID(&b)]; ok {
				t.Errorf("%s and %s share a bucket", name, other)
			}
			seen[localID(&b)] = name
		}
	}
	if len(seen) != 6 {
		t.Errorf("%d buckets; want 6 (3 keyers, 2 tiers)", len(seen))
	}
}
