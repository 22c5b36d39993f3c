package bucket_test

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

func mustZone(t *testing.T, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

func micros(t time.Time) int64 { return t.UnixMicro() }

// The periods' boundaries, exact on the calendar's edges: the 2026 New
// York DST days (23 and 25 hours), February in a leap and a common year,
// the turn of the year, and ISO weeks from Monday.
func TestQuotaBoundsOnTheCalendarsEdges(t *testing.T) {
	t.Parallel()
	ny := mustZone(t, "America/New_York")
	berlin := mustZone(t, "Europe/Berlin")
	for _, tt := range []struct {
		name   string
		q      bucket.Quota
		at     time.Time
		length time.Duration
		start  time.Time
	}{
		{"NY spring forward: 23 hours", bucket.Quota{1, bucket.Day, ny}, time.Date(2026, 3, 8, 12, 0, 0, 0, ny), 23 * time.Hour, time.Date(2026, 3, 8, 0, 0, 0, 0, ny)},
		{"NY fall back: 25 hours", bucket.Quota{1, bucket.Day, ny}, time.Date(2026, 11, 1, 23, 59, 0, 0, ny), 25 * time.Hour, time.Date(2026, 11, 1, 0, 0, 0, 0, ny)},
		{"an ordinary NY day", bucket.Quota{1, bucket.Day, ny}, time.Date(2026, 3, 9, 0, 0, 0, 0, ny), 24 * time.Hour, time.Date(2026, 3, 9, 0, 0, 0, 0, ny)},
		{"February 2028: 29 days", bucket.Quota{1, bucket.Month, time.UTC}, time.Date(2028, 2, 29, 23, 59, 59, 0, time.UTC), 29 * 24 * time.Hour, time.Date(2028, 2, 1, 0, 0, 0, 0, time.UTC)},
		{"February 2027: 28 days", bucket.Quota{1, bucket.Month, time.UTC}, time.Date(2027, 2, 14, 0, 0, 0, 0, time.UTC), 28 * 24 * time.Hour, time.Date(2027, 2, 1, 0, 0, 0, 0, time.UTC)},
		{"31 December, last microsecond", bucket.Quota{1, bucket.Year, berlin}, time.Date(2026, 12, 31, 23, 59, 59, 999999000, berlin), 365 * 24 * time.Hour, time.Date(2026, 1, 1, 0, 0, 0, 0, berlin)},
		{"1 January, first moment", bucket.Quota{1, bucket.Year, berlin}, time.Date(2027, 1, 1, 0, 0, 0, 0, berlin), 365 * 24 * time.Hour, time.Date(2027, 1, 1, 0, 0, 0, 0, berlin)},
		{"a leap year", bucket.Quota{1, bucket.Year, time.UTC}, time.Date(2028, 7, 1, 0, 0, 0, 0, time.UTC), 366 * 24 * time.Hour, time.Date(2028, 1, 1, 0, 0, 0, 0, time.UTC)},
		{"a week from Monday, on Sunday night", bucket.Quota{1, bucket.Week, berlin}, time.Date(2026, 12, 6, 23, 0, 0, 0, berlin), 7 * 24 * time.Hour, time.Date(2026, 11, 30, 0, 0, 0, 0, berlin)},
		{"a week from Monday, on Monday", bucket.Quota{1, bucket.Week, berlin}, time.Date(2026, 12, 7, 0, 0, 0, 0, berlin), 7 * 24 * time.Hour, time.Date(2026, 12, 7, 0, 0, 0, 0, berlin)},
		{"a week over the NY fall-back", bucket.Quota{1, bucket.Week, ny}, time.Date(2026, 11, 1, 12, 0, 0, 0, ny), 7*24*time.Hour + time.Hour, time.Date(2026, 10, 26, 0, 0, 0, 0, ny)},
		{"a month in Berlin, over the spring change", bucket.Quota{1, bucket.Month, berlin}, time.Date(2026, 3, 31, 23, 0, 0, 0, berlin), 31*24*time.Hour - time.Hour, time.Date(2026, 3, 1, 0, 0, 0, 0, berlin)},
	} {
		start, end := tt.q.Bounds(micros(tt.at))
		if start != micros(tt.start) || time.Duration(end-start)*time.Microsecond != tt.length {
			t.Errorf("%s: %s to %s (%v); want from %s, %v long", tt.name, time.UnixMicro(start).In(tt.q.Loc), time.UnixMicro(end).In(tt.q.Loc), time.Duration(end-start)*time.Microsecond, tt.start, tt.length)
		}
	}
}

// A quota admits exactly N a period, refuses with Retry-After to the
// boundary, and starts over there; a refusal takes nothing.
func TestQuotaAdmitsNAPeriodAndStartsOverAtTheBoundary(t *testing.T) {
	t.Parallel()
	ny := mustZone(t, "America/New_York")
	q := bucket.Quota{N: 3, Period: bucket.Day, Loc: ny}
	// The 23-hour day: from 05:00 UTC on 8 March to 04:00 UTC on 9 March.
	now := micros(time.Date(2026, 3, 8, 22, 0, 0, 0, ny))
	boundary := micros(time.Date(2026, 3, 9, 0, 0, 0, 0, ny))
	var s bucket.QuotaState
	for i := range 3 {
		var res bucket.Result
		if s, res = bucket.TakeQuota(s, now, q, 1); !res.Allowed || res.Remaining != int64(2-i) || res.ResetAfter != boundary-now {
			t.Fatalf("take %d: %+v", i, res)
		}
	}
	before := s
	s, res := bucket.TakeQuota(s, now, q, 1)
	if res.Allowed || res.RetryAfter != boundary-now || s != before {
		t.Fatalf("the 4th: %+v, state %+v; want refused until midnight (%d µs), nothing taken", res, s, boundary-now)
	}
	if res.RetryAfter != 2*3600*1e6 {
		t.Fatalf("Retry-After %d µs, want exactly 2 h", res.RetryAfter)
	}
	// One microsecond before midnight: still refused; at midnight: a new
	// day, N again.
	if _, res = bucket.TakeQuota(s, boundary-1, q, 1); res.Allowed || res.RetryAfter != 1 {
		t.Fatalf("just before midnight: %+v", res)
	}
	if s, res = bucket.TakeQuota(s, boundary, q, 3); !res.Allowed || res.Remaining != 0 {
		t.Fatalf("at midnight, all 3 at once: %+v", res)
	}
	// A give-back returns to this period's count; one of the last period
	// is gone with it.
	if got := bucket.GiveBackQuota(s, boundary+1, boundary, q, 2); got.Used != 1 {
		t.Fatalf("give-back: %+v", got)
	}
	if got := bucket.GiveBackQuota(before, boundary+1, now, q, 2); got != before {
		t.Fatalf("a give-back of the last period changed %+v to %+v", before, got)
	}
	// A charge counts up to N, no further.
	if got := bucket.ChargeQuota(bucket.QuotaState{}, now, q, 10); got.Used != 3 {
		t.Fatalf("charge: %+v", got)
	}
}

func TestParseQuota(t *testing.T) {
	t.Parallel()
	for _, s := range []string{"0/day", "5/fortnight", "x/day", "5", "-1/month", "3000000000/day"} {
		if _, err := bucket.ParseQuota(s, nil); err == nil {
			t.Errorf("%q: want an error", s)
		}
	}
	q, err := bucket.ParseQuota("10000/month", nil)
	if err != nil || q.N != 10000 || q.Period != bucket.Month || q.Loc != time.UTC || q.String() != "10000/month" {
		t.Fatalf("10000/month: %+v, %v", q, err)
	}
}

// A request takes from every limit and every quota, or from none: a
// refusal by the rate limit takes nothing from the quota, and a refusal
// by the quota takes nothing from the limit and starts no ban.
func TestQuotasAndLimitsTakeAllOrNothing(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}, Ban: 60_000_000}
	q := bucket.Quota{N: 3, Period: bucket.Day, Loc: time.UTC}
	ls, qs := []bucket.Limit{l}, []bucket.Quota{q}
	now := micros(time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC))
	sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	for i := range 2 {
		if !sh.TakeWithQuotas(now, ls, qs, 1, out, qout) {
			t.Fatalf("request %d refused: %+v %+v", i, out, qout)
		}
	}
	// The limit is empty: refused, and the quota keeps its 1 left. No
	// ban here: the ban setting is the limit's, and this refusal bans.
	l.Ban = 0
	ls[0] = l
	if sh.TakeWithQuotas(now, ls, qs, 1, out, qout) || qout[0].Remaining != 1 || sh.Quotas[0].Used != 2 {
		t.Fatalf("refused by the limit: %+v %+v, quota %+v; want the quota untouched", out, qout, sh.Quotas[0])
	}
	// A second later the limit has a token: the quota's last one goes.
	now += 1_000_000
	if !sh.TakeWithQuotas(now, ls, qs, 1, out, qout) || qout[0].Remaining != 0 {
		t.Fatalf("the third: %+v %+v", out, qout)
	}
	// Then the quota refuses, though the limit has a token again: nothing
	// taken from the limit, and no ban although the limit has one.
	now += 1_000_000
	ls[0].Ban = 60_000_000
	before := sh.Levels[0]
	if sh.TakeWithQuotas(now, ls, qs, 1, out, qout) || qout[0].Allowed || out[0].Banned || sh.Levels[0] != before {
		t.Fatalf("refused by the quota: %+v %+v; the limit %+v, was %+v", out, qout, sh.Levels[0], before)
	}
	if want := micros(time.Date(2026, 12, 6, 0, 0, 0, 0, time.UTC)) - now; qout[0].RetryAfter != want {
		t.Fatalf("Retry-After %d µs, want %d (to midnight)", qout[0].RetryAfter, want)
	}
}

// A charge of any size, up to the largest figure an origin can report,
// leaves the quota used up until its period ends: the count never wraps
// around to a negative one, which would give the client the period back.
// Regression test for issue 30 item 1.
func TestAChargeNear2To63KeepsTheQuotaUsedUp(t *testing.T) {
	t.Parallel()
	q := bucket.Quota{N: 5, Period: bucket.Month, Loc: time.UTC}
	now := micros(time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC))
	if bad := chargeLeavesNoRoom(q, now, bucket.ChargeQuota); bad != "" {
		t.Fatal(bad)
	}
	// The mutation the check must catch: the sum bounded after it wraps.
	wrapping := func(s bucket.QuotaState, now int64, q bucket.Quota, n int64) bucket.QuotaState {
		start, _ := q.Bounds(now)
		return bucket.QuotaState{Start: start, Used: min(q.N, s.UsedIn(start)+max(0, n))}
	}
	if chargeLeavesNoRoom(q, now, wrapping) == "" {
		t.Fatal("a charge whose sum wraps passed the check")
	}
}

// chargeLeavesNoRoom charges q, in several states, by figures up to
// 2^63-1 with charge, and describes the first that leaves the quota room
// for one more token ("" for none).
func chargeLeavesNoRoom(q bucket.Quota, now int64, charge func(bucket.QuotaState, int64, bucket.Quota, int64) bucket.QuotaState) string {
	start, end := q.Bounds(now)
	for _, used := range []int64{0, 1, q.N - 1, q.N} {
		for _, n := range []int64{q.N - used, 1 << 62, math.MaxInt64 - q.N, math.MaxInt64 - used, math.MaxInt64 - max(used-1, 0), math.MaxInt64} {
			s := charge(bucket.QuotaState{Start: start, Used: used}, now, q, n)
			if s != (bucket.QuotaState{Start: start, Used: q.N}) {
				return fmt.Sprintf("%d used, charged %d: %+v; want the quota used up (%d)", used, n, s, q.N)
			}
			if _, r := bucket.TakeQuota(s, now, q, 1); r.Allowed || r.RetryAfter != end-now {
				return fmt.Sprintf("%d used, charged %d: the next take %+v; want refused until the period ends", used, n, r)
			}
		}
	}
	return ""
}

// A reload may lower a quota's n below what its period has used (TakeQuota
// keeps that count and refuses): a charge after it (cost_from_response)
// adds to the count, and never brings it down to the new n, which would
// hand the client back what it used once n is raised again. (A charge
// takes at most what is left: here nothing.)
func TestAChargeNeverLowersACountAReloadLeftAboveN(t *testing.T) {
	t.Parallel()
	ten := bucket.Quota{N: 10, Period: bucket.Day, Loc: time.UTC}
	five := bucket.Quota{N: 5, Period: bucket.Day, Loc: time.UTC}
	now := micros(time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC))
	var s bucket.QuotaState
	for range 8 {
		s, _ = bucket.TakeQuota(s, now, ten, 1)
	}
	// The reload to 5: a response of the running config reports 1 more.
	s = bucket.ChargeQuota(s, now, five, 1)
	if s.Used < 8 {
		t.Errorf("8 used, n lowered to 5, then charged 1: %d used; want at least the 8 (a charge never lowers the count)", s.Used)
	}
	// n back to 10: the day has 2 left at most, whatever the reloads did.
	admitted := 0
	for range 10 {
		var r bucket.Result
		if s, r = bucket.TakeQuota(s, now, ten, 1); r.Allowed {
			admitted++
		}
	}
	if admitted > 2 {
		t.Errorf("n back to 10 after 8 taken and 1 charged: %d more admitted; the 8 alone leave room for 2", admitted)
	}
}

// On a day whose midnight does not exist (DST starts at 00:00:
// America/Santiago, America/Havana), the day before still has its 24 hours
// and holds its last hour: time.Date normalizes the missing Sunday 00:00 to
// Saturday 23:00, which must not end Saturday early. A refusal in that hour
// is told a positive wait, to the boundary.
func TestQuotaBoundsHoldTheMomentWhenMidnightIsSkipped(t *testing.T) {
	t.Parallel()
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

// A count_status give-back that arrives after the boundary belongs to the
// period the request was taken in: it must not erase a token another
// request took in the new period, which would admit n+1 there.
func TestAGiveBackAfterTheBoundaryDoesNotRefundTheNewPeriod(t *testing.T) {
	t.Parallel()
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

// After a reload lowers n below the period's count (which the reload
// keeps), Remaining is 0, never negative: it is written as
// X-RateLimit-Remaining, the RateLimit header's r and the admin API's left.
func TestQuotaRemainingIsNeverNegativeAfterNIsLowered(t *testing.T) {
	t.Parallel()
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

// Zones that skipped a whole calendar day (Pacific/Apia and Pacific/Fakaofo
// went from 29 to 31 December 2011, Pacific/Kwajalein skipped 21 August 1993,
// Pacific/Kanton 31 December 1994) never show that date: the day before
// ends when the next one starts, and Bounds returns (it once looked for the
// skipped day for ever, under a shard's lock in the local store).
func TestQuotaBoundsOfTheDayBeforeASkippedDayReturn(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		zone string
		y    int
		m    time.Month
		d    int
	}{
		{"Pacific/Apia", 2011, 12, 29},
		{"Pacific/Kwajalein", 1993, 8, 20},
		{"Pacific/Kanton", 1994, 12, 30},
	} {
		loc, err := time.LoadLocation(tc.zone)
		if err != nil {
			t.Fatal(err)
		}
		q := bucket.Quota{N: 10, Period: bucket.Day, Loc: loc}
		at := time.Date(tc.y, tc.m, tc.d, 12, 0, 0, 0, loc).UnixMicro()
		type bounds struct{ start, end int64 }
		got := make(chan bounds, 1)
		go func() {
			s, e := q.Bounds(at)
			got <- bounds{s, e}
		}()
		select {
		case b := <-got:
			if b.start > at || b.end <= at {
				t.Errorf("%s %d-%02d-%02d: Bounds [%d, %d) does not hold the moment", tc.zone, tc.y, tc.m, tc.d, b.start, b.end)
			}
		case <-time.After(5 * time.Second):
			// The goroutine spins on: the test binary ends it.
			t.Errorf("%s: Bounds of a day quota on %d-%02d-%02d did not return within 5s (dayStart looks for the skipped next day for ever)", tc.zone, tc.y, tc.m, tc.d)
			return
		}
	}
}

// CountedAt names a moment in the store's period for every period, over DST
// days (23 and 25 hours), month and year ends, in zones with DST at 00:00
// (Havana, Santiago), with the node's clock off by less than an hour either
// way and a decision up to 2 s after the request's start.
func TestCountedAtIsInTheStoresPeriod(t *testing.T) {
	t.Parallel()
	zones := []string{"UTC", "America/New_York", "Europe/Berlin", "America/Havana", "America/Santiago", "Australia/Lord_Howe", "Asia/Kathmandu", "Pacific/Chatham"}
	skews := []time.Duration{-59 * time.Minute, -time.Minute, 0, time.Minute, 59 * time.Minute}
	for _, z := range zones {
		loc, err := time.LoadLocation(z)
		if err != nil {
			t.Fatal(err)
		}
		qs := []bucket.Quota{{N: 1, Period: bucket.Day, Loc: loc}, {N: 1, Period: bucket.Week, Loc: loc}, {N: 1, Period: bucket.Month, Loc: loc}, {N: 1, Period: bucket.Year, Loc: loc}}
		from := time.Date(2026, 1, 1, 0, 0, 0, 0, loc).UnixMicro()
		to := time.Date(2027, 1, 3, 0, 0, 0, 0, loc).UnixMicro()
		// Every 193 minutes over the year, and the moments next to each
		// boundary.
		var moments []int64
		for m := from; m < to; m += (193 * time.Minute).Microseconds() {
			moments = append(moments, m)
		}
		for d := time.Date(2026, 1, 1, 12, 0, 0, 0, loc); d.Year() == 2026; d = d.AddDate(0, 0, 1) {
			_, end := qs[0].Bounds(d.UnixMicro())
			moments = append(moments, end-1, end-1_000_000, end-3_599_000_000)
		}
		for _, storeNow := range moments {
			// What the store answers, and the periods it counted in.
			var qout [4]bucket.Result
			var want [4]int64
			for i, q := range qs {
				var end int64
				want[i], end = q.Bounds(storeNow)
				qout[i] = bucket.Result{ResetAfter: end - storeNow}
			}
			for _, skew := range skews {
				for _, lag := range []int64{0, 2_000_000} {
					start := storeNow - lag + skew.Microseconds() // node's wall at the request's start
					at := bucket.CountedAt(start, qout[:])
					for i, q := range qs {
						if got, _ := q.Bounds(at); got != want[i] {
							t.Fatalf("%s %v skew %v: CountedAt names the period starting %v, the store counted in %v's",
								z, time.UnixMicro(storeNow).In(loc), skew, time.UnixMicro(got).In(loc), time.UnixMicro(want[i]).In(loc))
						}
					}
				}
			}
		}
	}
}

// A quota's refusal reports each limit by Peek: a banned limit's reset and
// Retry-After there agree with what a take says of it.
func TestAQuotaRefusalReportsABannedLimitAsATakeDoes(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 2, Rate: bucket.Rate{Tokens: 1, Interval: 60 * second}, Ban: 3600 * second}
	now := 100 * second
	s := bucket.State{}
	for range 3 {
		s, _ = bucket.Take(s, now, l, 1)
	}
	_, tr := bucket.Take(s, now, l, 1)
	out := make([]bucket.Result, 1)
	bucket.PeekRefused([]bucket.State{s}, now, []bucket.Limit{l}, 1, out)
	if out[0].ResetAfter != tr.ResetAfter || out[0].RetryAfter != tr.RetryAfter {
		t.Errorf("quota refusal reports %+v, a take %+v", out[0], tr)
	}
}
