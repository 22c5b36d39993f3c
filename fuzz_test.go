package ratelimit

import (
	"strings"
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

// FuzzParseRate: any string either fails to parse or gives a rate that
// makes a valid bucket and prints back to the same rate.
func FuzzParseRate(f *testing.F) {
	for _, s := range append(buckettest.TraceRates, "fast", "1/0s", "1e9/s", "0.0000001/s", "1/1ns", "5/1m30s", "1/d", "/", "") {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		r, err := bucket.ParseRate(s)
		if err != nil {
			return
		}
		if r.Tokens < 1 || r.Interval < 1 {
			t.Fatalf("ParseRate(%q) = %+v: not above 0", s, r)
		}
		back, err := bucket.ParseRate(r.String())
		if err != nil || back != r {
			t.Fatalf("ParseRate(%q) = %+v, prints %q, which parses to %+v, %v", s, r, r.String(), back, err)
		}
		if err := (bucket.Limit{Capacity: 1, Rate: r}).Validate(1); err != nil {
			t.Fatalf("ParseRate(%q) = %+v: a capacity-1 bucket is invalid: %v", s, r, err)
		}
	})
}

// FuzzCaddyfile: any rate_limit block adapts or fails with an error; it
// never panics, and what adapts provisions.
func FuzzCaddyfile(f *testing.F) {
	for _, s := range []string{
		"rate_limit 10 1/s",
		"rate_limit 10 1/s {\n\tkey header X-Key\n\ttier a 1 1/m {\n\t\tkeyer header\n\t}\n}",
		"rate_limit {\n\ttier a 1 1/s {\n\t\tmatch {\n\t\t\tpath /x\n\t\t}\n\t}\n}",
		"rate_limit 0 fast",
		"rate_limit 10 1/s {\n\theaders ietf\n\tstatus 503\n\tdry_run\n\tupstream_headers\n}",
		"rate_limit 10 1/s {\n\tstore local {\n\t\tmax_keys 5\n\t}\n}",
		"rate_limit 10 1/s {\n\tkey ip /24 /48\n\tkey cookie s\n\tkey placeholder {http.request.uri}\n}",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, block string) {
		if strings.ContainsAny(block, "{}") && strings.Count(block, "{") != strings.Count(block, "}") {
			return // the Caddyfile lexer's own business
		}
		cfg, err := adaptSite(block)
		if err != nil {
			return
		}
		for _, h := range findHandlers(t, cfg) {
			if err := h.Validate(); err != nil {
				t.Fatalf("adapted, but the config is invalid: %v\n%s", err, block)
			}
		}
	})
}
