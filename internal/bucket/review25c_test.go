package bucket_test

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Adversarial review of the fixes of issue 25's review (3cb8e39). Tests
// named ...Defect... FAIL on the code under review; the others probe and
// pass.

// FAILS (by its deadline: the call never returns). Breaks fix 2's claim
// "correct for day/week/month/year periods in every IANA zone" (DESIGN
// section 13: "Days of 23 and 25 hours (DST) ... are exact"), which
// CountedAt and every give-back's Bounds rest on.
//
// Mechanism: dayStart (quota.go:101-113) steps a minute at a time from
// time.Date(y, m, d, 0, 0, 0, 0, loc) until the moment's date is the
// wanted one. A zone that skipped a whole calendar day never shows that
// date: Pacific/Apia and Pacific/Fakaofo jumped from 29 to 31 December
// 2011, Pacific/Kwajalein skipped 21 August 1993, Pacific/Kanton and
// Pacific/Kiritimati 31 December 1994. Bounds of a day quota on the day
// before (dayStart(y, m, d+1)) loops for ever; in the local store it does
// so under the shard's lock (every client of the shard hangs), in the
// Redis store in argsWithQuotas.
//
// Fix: stop at the first moment whose date is not before the wanted one
// (compare y, m, d in order): the skipped day then has no length, and the
// day before it ends when the next one starts.
func TestReview25cDefectBoundsOfADayBeforeASkippedDayReturns(t *testing.T) {
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

// Probe (passes): CountedAt names a moment in the store's period for
// every period, over DST days (23 and 25 hours), month and year ends, in
// zones with DST at 00:00 (Havana, Santiago), with the node's clock off
// by less than an hour either way and a decision up to 2 s after the
// request's start.
func TestReview25cCountedAtIsInTheStoresPeriod(t *testing.T) {
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
			for _, skew := range skews {
				for _, lag := range []int64{0, 2_000_000} {
					start := storeNow - lag + skew.Microseconds() // node's wall at the request's start
					var qout [4]bucket.Result
					for i, q := range qs {
						_, end := q.Bounds(storeNow)
						qout[i] = bucket.Result{ResetAfter: end - storeNow}
					}
					at := bucket.CountedAt(start, qout[:])
					for _, q := range qs {
						want, _ := q.Bounds(storeNow)
						if got, _ := q.Bounds(at); got != want {
							t.Fatalf("%s %v skew %v: CountedAt names the period starting %v, the store counted in %v's",
								z, time.UnixMicro(storeNow).In(loc), skew, time.UnixMicro(got).In(loc), time.UnixMicro(want).In(loc))
						}
					}
				}
			}
		}
	}
}
