package ratelimit

import (
	"strconv"
	"testing"
	"time"
)

func TestBurstGetsThreeThenRetryAfter(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 3 1/10s
	respond "ok"`)

	before := time.Now().Unix()
	for i, want := range []string{"2", "1", "0"} {
		r := s.get("/")
		if r.status != 200 {
			t.Fatalf("request %d: status %d, want 200", i+1, r.status)
		}
		if got := r.header.Get("X-RateLimit-Remaining"); got != want {
			t.Errorf("request %d: X-RateLimit-Remaining %q, want %q", i+1, got, want)
		}
		if got := r.header.Get("X-RateLimit-Limit"); got != "3" {
			t.Errorf("request %d: X-RateLimit-Limit %q, want 3", i+1, got)
		}
	}
	r := s.get("/")
	after := time.Now().Unix()
	if r.status != 429 {
		t.Fatalf("4th request: status %d, want 429", r.status)
	}
	if got := r.header.Get("Retry-After"); got != "10" {
		t.Errorf("Retry-After %q, want 10", got)
	}
	// Three tokens are missing, at one per 10 s: full again 30 s from now.
	reset, err := strconv.ParseInt(r.header.Get("X-RateLimit-Reset"), 10, 64)
	if err != nil || reset < before+30 || reset > after+31 {
		t.Errorf("X-RateLimit-Reset %q, want the epoch second 30 s ahead, in [%d, %d]", r.header.Get("X-RateLimit-Reset"), before+30, after+31)
	}
}
