package bucket_test

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Defect: Quota.Bounds on a day whose midnight does not exist (DST starts
// at 00:00: America/Santiago, America/Havana) returns a period that does
// not hold t. time.Date normalizes the missing "Sunday 00:00" to Saturday
// 23:00 (the old offset), so for t in Saturday's last hour Bounds answers
// [Saturday 00:00, Saturday 23:00): end < t. The comment in quota.go
// ("the period still holds t") is false, and the claim "a count starts
// over at the period's boundary ... days of 23/25 hours (DST) exact" is
// broken: Saturday is cut to 23 hours (it has 24), and TakeQuota reports a
// negative ResetAfter/RetryAfter (Retry-After = seconds until the boundary).
func TestReview24BoundsHoldTWhenMidnightIsSkipped(t *testing.T) {
	for _, tt := range []struct {
		zone    string
		y, m, d int // the Sunday whose 00:00 does not exist
	}{
		{"America/Santiago", 2026, 9, 6},
		{"America/Havana", 2026, 3, 8},
	} {
		loc, err := time.LoadLocation(tt.zone)
		if err != nil {
			t.Fatal(err)
		}
		q := bucket.Quota{N: 10, Period: bucket.Day, Loc: loc}
		// Saturday 23:30 local: an ordinary Saturday moment, 30 minutes
		// before the clocks jump from 24:00 to 01:00.
		at := time.Date(tt.y, time.Month(tt.m), tt.d-1, 23, 30, 0, 0, loc)
		t0 := at.UnixMicro()
		start, end := q.Bounds(t0)
		if !(start <= t0 && t0 < end) {
			t.Errorf("%s: Bounds(%s) = [%s, %s): the period does not hold t", tt.zone, at, time.UnixMicro(start).In(loc), time.UnixMicro(end).In(loc))
		}
		// Sunday begins at 01:00 (its first moment): Saturday is 24 h.
		firstOfSunday := at.Add(30 * time.Minute).UnixMicro()
		if end != firstOfSunday {
			t.Errorf("%s: Saturday ends at %s, want %s (the first moment of Sunday)", tt.zone, time.UnixMicro(end).In(loc), time.UnixMicro(firstOfSunday).In(loc))
		}
		_, res := bucket.TakeQuota(bucket.QuotaState{Start: start, Used: 10}, t0, q, 1)
		if res.Allowed || res.RetryAfter <= 0 || res.ResetAfter <= 0 {
			t.Errorf("%s: refused at Saturday 23:30 with RetryAfter %d µs, ResetAfter %d µs; want both positive (to the boundary, 30 min)", tt.zone, res.RetryAfter, res.ResetAfter)
		}
	}
}

// Defect: a count_status give-back that arrives after the boundary is
// returned to the NEW period's count (GiveBackQuota compares the stored
// Start with the period of the give-back's time, not the take's). A
// request taken at 23:59:59.9 and given back at 00:00:00.1 erases a
// token another request took in the new period: the new day admits n+1.
// Breaks "a quota is a count that starts over at the period's boundary"
// (n a period) and "count_status give-backs return to quotas" (to the
// quota the tokens were taken from). The same logic is in the Lua
// script's giveback (q.used - count in the current period).
func TestReview24GiveBackAfterTheBoundaryDoesNotRefundTheNewPeriod(t *testing.T) {
	q := bucket.Quota{N: 2, Period: bucket.Day, Loc: time.UTC}
	before := time.Date(2026, 5, 4, 23, 59, 59, 900_000_000, time.UTC).UnixMicro()
	after := time.Date(2026, 5, 5, 0, 0, 0, 100_000_000, time.UTC).UnixMicro()
	var s bucket.QuotaState
	s, _ = bucket.TakeQuota(s, before, q, 1) // request A, yesterday; its response is slow
	admitted := 0
	for range 2 {
		var res bucket.Result
		if s, res = bucket.TakeQuota(s, after, q, 1); res.Allowed {
			admitted++
		}
	}
	s = bucket.GiveBackQuota(s, after, before, q, 1) // A's response does not count: give back
	if _, res := bucket.TakeQuota(s, after, q, 1); res.Allowed {
		admitted++
	}
	if admitted != 2 {
		t.Errorf("the new day admitted %d requests; quota %s admits 2 (A's give-back belongs to yesterday)", admitted, q)
	}
}

// Defect: after a reload that lowers n below the period's count (the
// claim: "a reload that changes n keeps the count"), TakeQuota reports a
// negative Remaining, which the handler writes as X-RateLimit-Remaining
// and as the IETF item's r (a non-negative integer), and the admin API as
// "left".
func TestReview24RemainingNeverNegativeAfterNIsLowered(t *testing.T) {
	q := bucket.Quota{N: 3, Period: bucket.Day, Loc: time.UTC}
	now := time.Date(2026, 5, 4, 12, 0, 0, 0, time.UTC).UnixMicro()
	start, _ := q.Bounds(now)
	s := bucket.QuotaState{Start: start, Used: 5} // counted under quota 10/day
	if _, res := bucket.TakeQuota(s, now, q, 1); res.Remaining < 0 {
		t.Errorf("TakeQuota: Remaining %d, want 0", res.Remaining)
	}
	if res := bucket.PeekQuota(s, now, q); res.Remaining < 0 {
		t.Errorf("PeekQuota: Remaining %d, want 0", res.Remaining)
	}
}
