package ratelimit

import (
	"testing"
)

// The {http.rate_limit.*} placeholders (placeholders.go).

// With three rate_limit handlers stacked on a route, the placeholders
// answer the last one the request went through: the third when all allow,
// the one that refused when one does (the handlers after it never run);
// a route with one handler answers its own.
// Regression test for 3cb8e39.
func TestPlaceholdersAnswerTheLastOfThreeStackedHandlers(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	route /three {
		rate_limit 10 1/h {
			name first
		}
		rate_limit 5 1/h {
			name second
		}
		rate_limit 2 1/h {
			name third
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining} {http.rate_limit.decision}"
	}
	route /one {
		rate_limit 7 1/h {
			name alone
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining}"
	}
	handle_errors 429 {
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.decision} {http.rate_limit.retry_after}" 429
	}`)
	for i, want := range []string{"third 2 1 allowed", "third 2 0 allowed"} {
		if r := s.get("/three"); r.status != 200 || r.body != want {
			t.Fatalf("request %d: %d %q, want 200 %q", i+1, r.status, r.body, want)
		}
	}
	if r := s.get("/three"); r.status != 429 || r.body != "third 2 denied 3600" {
		t.Errorf("refused by the third: %d %q, want 429 %q", r.status, r.body, "third 2 denied 3600")
	}
	if r := s.get("/one"); r.status != 200 || r.body != "alone 7 6" {
		t.Errorf("a lone handler: %d %q, want 200 %q", r.status, r.body, "alone 7 6")
	}
}
