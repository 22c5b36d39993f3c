package bucket_test

import (
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// A tier's refill time is its slowest limit's, whichever comes first. A
// lease answer adds it for the tokens a request lacks beside the last
// call's cost, which may be fewer: n below 0 then shortens the wait, and
// is not read as none.
func TestTierRefillIsTheSlowestLimits(t *testing.T) {
	fast := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 10, Interval: 1_000_000}} // 100 ms a token
	slow := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}  // 1 s a token
	for _, tt := range []struct {
		name  string
		tier  bucket.Tier
		n     int64
		want  int64
		lone  bool
		parts int
	}{
		{"lone", bucket.Tier{Limits: []bucket.Limit{fast}}, 3, 300_000, true, 1},
		{"slow last", bucket.Tier{Limits: []bucket.Limit{fast, slow}}, 3, 3_000_000, false, 2},
		{"slow first", bucket.Tier{Limits: []bucket.Limit{slow, fast}}, 3, 3_000_000, false, 2},
		{"with a quota", bucket.Tier{Limits: []bucket.Limit{fast}, Quotas: []bucket.Quota{{N: 5, Period: bucket.Day}}}, 1, 100_000, false, 2},
	} {
		tr := tt.tier
		if got := tr.Refill(tt.n); got != tt.want {
			t.Errorf("%s: Refill(%d) = %d µs, want %d", tt.name, tt.n, got, tt.want)
		}
		if tr.Lone() != tt.lone || tr.Parts() != tt.parts || tr.First() != tr.Limits[0] {
			t.Errorf("%s: Lone %v, Parts %d; want %v, %d", tt.name, tr.Lone(), tr.Parts(), tt.lone, tt.parts)
		}
		if got := tr.Refill(-tt.n); got >= 0 {
			t.Errorf("%s: Refill(%d) = %d µs, want below 0", tt.name, -tt.n, got)
		}
	}
}

// The binding result is, allowed, the one with the least remaining and,
// refused, the one that makes the client wait longest: the first of
// equals either way.
func TestBindingIsTheLeastRemainingOrTheLongestWait(t *testing.T) {
	all := []bucket.Result{
		{Remaining: 5, RetryAfter: 10},
		{Remaining: 2, RetryAfter: 30},
		{Remaining: 2, RetryAfter: 30},
		{Remaining: 9, RetryAfter: 20},
	}
	if got := bucket.Binding(all, true); got != 1 {
		t.Errorf("allowed: %d, want 1, the first of the least remaining", got)
	}
	if got := bucket.Binding(all, false); got != 1 {
		t.Errorf("refused: %d, want 1, the first of the longest wait", got)
	}
	if got := bucket.Binding(all[3:], false); got != 0 {
		t.Errorf("one result: %d, want 0", got)
	}
}
