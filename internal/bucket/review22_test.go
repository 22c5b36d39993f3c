package bucket_test

import (
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Defect: under a ban with max_wait, a refusal's RetryAfter is the time
// until the bucket holds the cost (ban() -> untilLevel), but the request
// already fits within max_wait when the ban ends (the level is 0 and its
// wait, cost/rate, is within max_wait): Retry-After overstates it by a
// whole cost's refill. Breaks: "Retry-After = whole seconds until it would
// fit within max_wait".
func TestReview22RetryAfterUnderABanIgnoresMaxWait(t *testing.T) {
	// capacity 1, one token every 10 s, ban 60 s, max_wait 30 s.
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 10_000_000}, Ban: 60_000_000, MaxWait: 30_000_000}
	now := int64(1_000_000_000)
	var s bucket.State
	// Take the token, then 3 wait (10, 20, 30 s); the 5th would wait 40 s:
	// refused, and the ban starts.
	for i := range 4 {
		var res bucket.Result
		if s, res = bucket.Take(s, now, l, 1); !res.Allowed {
			t.Fatalf("request %d: %+v, want allowed", i, res)
		}
	}
	s, res := bucket.Take(s, now, l, 1)
	if res.Allowed || !res.Banned {
		t.Fatalf("5th request: %+v, want refused, starting a ban", res)
	}
	// The earliest moment a request fits within max_wait.
	fits := int64(-1)
	for at := now; at <= now+res.RetryAfter; at += 100_000 {
		if _, r := bucket.Take(s, at, l, 1); r.Allowed {
			fits = at - now
			break
		}
	}
	if fits < 0 {
		t.Fatalf("no request fits within RetryAfter %d µs", res.RetryAfter)
	}
	if res.RetryAfter > fits {
		t.Fatalf("the refusal that started the ban says retry after %d µs, but a request fits (waiting within max_wait) after %d µs", res.RetryAfter, fits)
	}
}
