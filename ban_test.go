package ratelimit

import (
	"testing"
)

// A denial under a ban empties the bucket for the ban from that moment;
// denials during the ban do not extend it; Retry-After is the ban left;
// when it ends, the bucket refills from empty.
func TestBanHoldsTheBucketEmptyThenRefillsFromEmpty(t *testing.T) {
	sec := int64(1_000_000)
	l := Limit{Capacity: 3, Rate: Rate{Tokens: 1, Interval: sec}, Ban: 60 * sec}
	var st State
	now := 10 * sec
	for range 3 {
		st, _ = Take(st, now, l, 1)
	}
	st, res := Take(st, now, l, 1) // the denial that bans
	if res.Allowed || res.RetryAfter != 61*sec {
		t.Fatalf("the banning denial: %+v, want denied with 61 s to wait (the ban, then one token)", res)
	}
	// Denials during the ban say the ban left, and do not extend it.
	for _, at := range []int64{1, 30, 59} {
		var r Result
		st, r = Take(st, now+at*sec, l, 1)
		if r.Allowed || r.RetryAfter != (61-at)*sec {
			t.Fatalf("%d s into the ban: %+v, want denied with %d s to wait", at, r, 61-at)
		}
	}
	if _, r := Take(st, now+60*sec+sec/2, l, 1); r.Allowed {
		t.Fatalf("half a second after the ban: allowed; the bucket should refill from empty")
	}
	st, r := Take(st, now+61*sec, l, 1)
	if !r.Allowed || r.Remaining != 0 {
		t.Fatalf("a second after the ban: %+v, want the one token refilled since", r)
	}
	if _, r := Take(st, now+61*sec, l, 1); r.Allowed {
		t.Fatal("a second request at the same moment was allowed")
	}
}
