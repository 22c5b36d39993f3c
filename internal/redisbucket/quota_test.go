package redisbucket

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A charge of up to 2^63-1 (an origin's cost_from_response figure) leaves
// each quota used up in the script as in the model: the script's doubles
// sum without wrapping, and the count it stores is N exactly.
// Regression test for issue 30 item 1.
func TestScriptChargeNear2To63KeepsTheQuotaUsedUp(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	ls := []bucket.Limit{slowLimit(100)}
	qs := []bucket.Quota{{N: 5, Period: bucket.Day, Loc: time.UTC}, {N: 50, Period: bucket.Month, Loc: time.UTC}}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 2)
	for i, n := range []int64{math.MaxInt64, math.MaxInt64 - 1, 1 << 62} {
		key := bucketFor(fmt.Sprint("charge-", i))
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); !ok || err != nil {
			t.Fatalf("the first take: %v %v %+v", ok, err, qout)
		}
		if err := s.Charge(bg, key, bucket.Tier{Limits: ls, Quotas: qs}, n); err != nil {
			t.Fatal(err)
		}
		now := time.Now().UnixMicro()
		sh := &buckettest.Shared{Levels: make([]bucket.State, 1), Quotas: []bucket.QuotaState{{Used: 1}, {Used: 1}}}
		for j, q := range qs {
			sh.Quotas[j].Start, _ = q.Bounds(now)
		}
		sh.ChargeQuotas(now, qs, n)
		stored, _ := srv.Do("GET", string(key)).(string)
		for j, q := range qs {
			if sh.Quotas[j].Used != q.N {
				t.Fatalf("the model, charged %d: %+v; want %d used", n, sh.Quotas[j], q.N)
			}
			if want := fmt.Sprintf("q%d:%d:%d:", q.Period, sh.Quotas[j].Start, q.N); !strings.Contains(stored, want) {
				t.Fatalf("charged %d: the key holds %q; want %q, the quota used up", n, stored, want)
			}
		}
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); ok || err != nil || qout[0].Remaining != 0 || qout[1].Remaining != 0 {
			t.Fatalf("after a charge of %d: allowed %v (%v), %+v; want refused, both quotas used up", n, ok, err, qout)
		}
	}
}

// In the hour a zone's clock repeats over midnight (Amman's DST ended at
// 01:00 to 00:00 on the last Friday of October), the node's boundaries
// hold Redis's now, and the script counts the request in the day that
// began at the first midnight.
// Regression test for issue 30 item 3.
func TestAQuotaRequestInARepeatedFirstHourIsCounted(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	amman, err := time.LoadLocation("Asia/Amman")
	if err != nil {
		t.Fatal(err)
	}
	first := time.Date(2015, 10, 29, 21, 0, 0, 0, time.UTC) // 00:00 EEST on Friday the 30th
	s.clockOffset = first.Add(30*time.Minute).UnixMicro() - time.Now().UnixMicro()
	ls := []bucket.Limit{slowLimit(100)}
	qs := []bucket.Quota{{N: 3, Period: bucket.Day, Loc: amman}}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	ok, err := s.takeQuotas(bg, bucketFor("amman"), ls, qs, 1, out, qout)
	// The day ends at the next midnight, 25 hours after the first.
	if want := (25*time.Hour - 30*time.Minute).Microseconds(); !ok || err != nil || qout[0].Remaining != 2 || qout[0].ResetAfter < want-5*second || qout[0].ResetAfter > want {
		t.Fatalf("00:30 EEST on the 30th: allowed %v (%v), %+v; want 2 left of the 25-hour day", ok, err, qout[0])
	}
}

// A give-back returns its tokens to the quotas and, to the limits, only
// the tokens the caller says they take back (none here: after a reload
// that slowed their refill), in strict mode and from a node that holds a
// lease, which then takes none of them.
// Regression test for issue 30 item 4.
func TestAGiveBackReturnsToTheQuotasWhatTheLimitsDoNotTakeBack(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	for _, lease := range []string{"", "50%"} {
		t.Run("lease "+lease, func(t *testing.T) {
			s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: lease})
			ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 60 * second}}}
			qs := []bucket.Quota{{N: 50, Period: bucket.Day, Loc: time.UTC}}
			key := bucketFor("giveback-" + lease)
			out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
			// With leases, takes until the node holds one (the first is
			// spent at once).
			for held := false; !held; {
				if ok, err := s.takeQuotas(bg, key, ls, qs, 2, out, qout); !ok || err != nil {
					t.Fatalf("a take: %v %v (%+v)", ok, err, qout)
				}
				stored, _ := srv.Do("GET", string(key)).(string)
				held = lease == "" || strings.Contains(stored, ";l:")
			}
			peek := func() (limit, quota int64) {
				if err := s.peekQuotas(bg, key, ls, qs, out, qout); err != nil {
					t.Fatal(err)
				}
				return out[0].Remaining, qout[0].Remaining
			}
			limit, quota := peek()
			if err := s.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: qs}, 0, 2, time.Now().UnixMicro()); err != nil {
				t.Fatal(err)
			}
			// At 100 a minute, the limit may refill a token meanwhile.
			if l, q := peek(); q != quota+2 || l-limit > 1 {
				t.Fatalf("the give-back took the quota from %d to %d left, the limit from %d to %d; want 2 more to the quota, none to the limit (%q)", quota, q, limit, l, srv.Do("GET", string(key)))
			}
		})
	}
}

// The script's charge, as the model's (bucket.ChargeQuota): after a
// reload lowered a quota's n below what the period used, a charge does
// not bring the count down to the new n, so raising n again gives the
// client back nothing it used.
func TestScriptChargeNeverLowersACountAReloadLeftAboveN(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	ls := []bucket.Limit{slowLimit(100)}
	ten := []bucket.Quota{{N: 10, Period: bucket.Day, Loc: time.UTC}}
	five := []bucket.Quota{{N: 5, Period: bucket.Day, Loc: time.UTC}}
	key := bucketFor("charge-lowered-n")
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	for i := range 8 {
		if ok, err := s.takeQuotas(bg, key, ls, ten, 1, out, qout); !ok || err != nil {
			t.Fatalf("take %d: %v %v %+v", i, ok, err, qout)
		}
	}
	if err := s.Charge(bg, key, bucket.Tier{Limits: ls, Quotas: five}, 1); err != nil {
		t.Fatal(err)
	}
	admitted := 0
	for range 10 {
		ok, err := s.takeQuotas(bg, key, ls, ten, 1, out, qout)
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			admitted++
		}
	}
	if admitted > 2 {
		t.Errorf("8 taken under n 10, 1 charged under n 5, n back to 10: %d more admitted; the 8 alone leave room for 2 (%q)", admitted, srv.Do("GET", string(key)))
	}
}

// A reload that moves the quotas to another time zone, with requests of the
// old config still at the origin: their give-backs (count_status) and
// charges (cost_from_response) name the day as the old zone has it. They
// may not erase the count the running config keeps for the day as the new
// zone has it (the script keeps a count no call names until its period
// ends), or every client whose request straddled the reload gets its day
// back.
func TestAnOldZonesGiveBackKeepsTheNewZonesCount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	berlin, err := time.LoadLocation("Europe/Berlin")
	if err != nil {
		t.Fatal(err)
	}
	// Noon UTC: the day began at 23:00 UTC in Berlin, 00:00 in UTC.
	noon := time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC)
	s.clockOffset = noon.UnixMicro() - time.Now().UnixMicro()
	ls := []bucket.Limit{slowLimit(100)}
	old := []bucket.Quota{{N: 10, Period: bucket.Day, Loc: time.UTC}}
	running := []bucket.Quota{{N: 10, Period: bucket.Day, Loc: berlin}}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	for _, op := range []string{"giveback", "charge"} {
		t.Run(op, func(t *testing.T) {
			key := bucketFor("zone-" + op)
			// A request of the old config, at the origin across the reload.
			if ok, err := s.takeQuotas(bg, key, ls, old, 1, out, qout); !ok || err != nil {
				t.Fatalf("the old config's take: %v %v", ok, err)
			}
			// The running config counts 6 today.
			for i := range 6 {
				if ok, err := s.takeQuotas(bg, key, ls, running, 1, out, qout); !ok || err != nil {
					t.Fatalf("take %d: %v %v", i, ok, err)
				}
			}
			// The old request ends.
			if op == "giveback" {
				err = s.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: old}, 1, 1, noon.UnixMicro())
			} else {
				err = s.Charge(bg, key, bucket.Tier{Limits: ls, Quotas: old}, 1)
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := s.peekQuotas(bg, key, ls, running, out, qout); err != nil {
				t.Fatal(err)
			}
			if qout[0].Remaining > 4 {
				t.Errorf("after the old config's %s: the running config's day has %d left; want 4 at most, 6 taken of 10 (%q)", op, qout[0].Remaining, srv.Do("GET", string(key)))
			}
		})
	}
}

// A reload that adds quota 100/day in front of quota 1000/month (or
// reorders or removes one) keeps the month's count: the script does not
// read the month's count as the day's by its index, which would start the
// month over mid-month.
func TestAReloadAddingAQuotaKeepsTheMonthsCount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	s.clockOffset = time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	key := bucketFor("reload")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	day := bucket.Quota{N: 100, Period: bucket.Day, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 2)
	for range 5 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{month}, 1, out, qout[:1]); err != nil || !ok {
			t.Fatalf("take: %v %v", ok, err)
		}
	}
	// The reload: a day quota in front of the month's.
	if _, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day, month}, 0, out, qout); err != nil {
		t.Fatal(err)
	}
	if qout[1].Remaining != 995 || qout[0].Remaining != 100 {
		t.Errorf("after the reload: day %d left, month %d left; want 100 and 995 (5 taken this month)", qout[0].Remaining, qout[1].Remaining)
	}
}

// The script's give-back returns to the quota's count of the period the
// request was taken in, not of the period Redis is in now: a request taken
// at 23:59:59.9 and given back (count_status) at 00:00:00.1 does not refund
// the new day, which would then admit n+1. The same when the node's clock
// runs 150 ms ahead of Redis's: the give-back names the moment from the
// quota's answer (bucket.CountedAt), not the node's clock alone.
func TestAGiveBackAfterTheBoundaryDoesNotRefundTheNewDay(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	midnight := time.Date(2026, 5, 5, 0, 0, 0, 0, time.UTC).UnixMicro()
	for _, tt := range []struct {
		name        string
		redis, node int64 // the clocks at the request, from midnight (µs)
	}{
		{"the clocks agree", -100_000, -100_000},
		{"the node's runs 150 ms ahead", -50_000, 100_000},
	} {
		key := bucketFor("giveback " + tt.name)
		ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
		qs := []bucket.Quota{{N: 2, Period: bucket.Day, Loc: time.UTC}}
		out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
		s.clockOffset = midnight + tt.redis - time.Now().UnixMicro()
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil || !ok {
			t.Fatalf("%s: yesterday's request (by Redis's clock): %v %v", tt.name, ok, err)
		}
		at := bucket.CountedAt(midnight+tt.node, qout)
		s.clockOffset += 200_000 // past midnight, by Redis's clock
		admitted := 0
		for range 2 {
			if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil {
				t.Fatal(err)
			} else if ok {
				admitted++
			}
		}
		if err := s.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: qs}, 1, 1, at); err != nil { // yesterday's request did not count
			t.Fatal(err)
		}
		if ok, err := s.takeQuotas(bg, key, ls, qs, 1, out, qout); err != nil {
			t.Fatal(err)
		} else if ok {
			admitted++
		}
		if admitted != 2 {
			t.Errorf("%s: the new day admitted %d; quota 2/day admits 2", tt.name, admitted)
		}
	}
}

// The node sends the boundaries of the periods around its own now, and the
// script picks Redis's period among them. When Redis's clock is a day past
// the node's, the call answers the reset of Redis's day, or fails loudly
// (on_store_error decides) and writes nothing, rather than count in a
// period that ended, with a negative reset.
func TestTheQuotaPeriodIsRedissWhenTheNodeIsADayBehind(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	key := string(bucketFor("skew"))
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
	qs := []bucket.Quota{{N: 5, Period: bucket.Day, Loc: time.UTC}}
	// The node believes it is Monday noon; Redis's clock says Wednesday
	// noon (ARGV[4] shifts only Redis's TIME).
	node := time.Date(2026, 5, 4, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	s.clockOffset = node
	args := s.args("take", bucket.Tier{Limits: ls, Quotas: qs}, 0, 1)
	args[3] = node + 2*24*3600*1_000_000
	// The node sends the boundaries of the periods around its own now;
	// beyond them, Redis cannot tell the period: the call fails loudly
	// (on_store_error decides) rather than count in a period that ended.
	vals, err := s.call(bg, key, args, false, 3+4*2)
	if err == nil {
		if reset := vals[3+4*1+3]; reset <= 0 || reset > 12*3600*1_000_000 {
			t.Errorf("the quota's reset after: %d µs; want Redis's day's end, 12 h on (%d µs)", reset, int64(12*3600*1_000_000))
		}
	} else if !strings.Contains(err.Error(), "clock is more than a quota period") {
		t.Fatal(err)
	}
	if n := srv.Do("EXISTS", key).(int64); n != 0 {
		t.Errorf("a call that failed on the clocks wrote the bucket")
	}
}

// A reload that adds a quota while a request is at the origin: the
// request settles under the old tier, and its give-back names the old
// quotas only; the script keeps the counts of the quotas a call does not
// name, so the new month quota's count is not dropped.
func TestAGiveBackNamingFewerQuotasKeepsTheOthersCount(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	s.clockOffset = time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	key := bucketFor("fewer-quotas")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out := make([]bucket.Result, 1)
	// A request under the old config (day quota only) is at the origin.
	if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day}, 1, out, make([]bucket.Result, 1)); err != nil || !ok {
		t.Fatal(ok, err)
	}
	taken := time.Now().UnixMicro() + s.clockOffset
	// The reload adds the month quota; the new config admits 5.
	qout := make([]bucket.Result, 2)
	for range 5 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day, month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	// The old request's response does not count: its give-back names the
	// old tier's quotas.
	if err := s.GiveBack(bg, key, bucket.Tier{Limits: ls, Quotas: []bucket.Quota{day}}, 1, 1, taken); err != nil {
		t.Fatal(err)
	}
	if err := s.peekQuotas(bg, key, ls, []bucket.Quota{day, month}, out, qout); err != nil {
		t.Fatal(err)
	}
	if qout[1].Remaining != 995 {
		t.Errorf("the month quota after an old request's give-back: %d left, want 995 (5 counted since the reload): its count was dropped", qout[1].Remaining)
	}
	if qout[0].Remaining != 45 {
		t.Errorf("the day quota: %d left, want 45", qout[0].Remaining)
	}
}

// quotaBoundsAround are the day and the month of the moment at, and the
// start of the day before it.
func quotaBoundsAround(at int64) (dayStart, dayEnd, yesterday, monthStart, monthEnd int64) {
	day := bucket.Quota{N: 1, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1, Period: bucket.Month, Loc: time.UTC}
	dayStart, dayEnd = day.Bounds(at)
	yesterday, _ = day.Bounds(dayStart - 1)
	monthStart, monthEnd = month.Bounds(at)
	return
}

// A count in the old segment format (q<p>:<start>:<used>, as every key
// written before the format changed holds it) of a quota a call does not
// name outlives that call: the key, which lived until the month's end,
// keeps that life, and the month's count with it, though the call names
// only a day quota.
func TestAnOldFormatQuotaCountOutlivesACallThatDoesNotNameIt(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, dayEnd, _, monthStart, monthEnd := quotaBoundsAround(now)
	key := string(bucketFor("old-format-ttl"))
	// As the version before wrote it: limit 1 full, the month's count in
	// the old format, the key living until the month's end.
	srv.Do("SET", key, fmt.Sprintf(";q3:%d:7", monthStart), "PX", (monthEnd-now)/1000)
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	if ok, err := s.takeQuotas(bg, []byte(key), ls, []bucket.Quota{day}, 1, out, qout); err != nil || !ok {
		t.Fatal(ok, err)
	}
	v, _ := srv.Do("GET", key).(string)
	if !strings.Contains(v, fmt.Sprintf("q3:%d:7", monthStart)) {
		t.Fatalf("the month's count is gone from the key: %q", v)
	}
	ttl := srv.Do("PTTL", key).(int64) * 1000
	if ttl < (monthEnd-now)-60*second {
		t.Errorf("the key holding the month's count (7) now expires in %s, at the day's end (%s away); the month ends in %s: the count dies with the key",
			time.Duration(ttl)*time.Microsecond, time.Duration(dayEnd-now)*time.Microsecond, time.Duration(monthEnd-now)*time.Microsecond)
	}
}

// A count in the old segment format of a quota the config no longer has
// (yesterday's count of a dropped day quota) does not stay in the key for
// good: no call reads it, and today's takes drop it.
func TestAnOldFormatCountOfADroppedQuotaIsDropped(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, _, yesterday, monthStart, monthEnd := quotaBoundsAround(now)
	key := string(bucketFor("old-format-stale"))
	// The version before: a day and a month quota; yesterday's day count
	// stayed in the key, which lives until the month's end.
	srv.Do("SET", key, fmt.Sprintf(";q1:%d:5;q3:%d:9", yesterday, monthStart), "PX", (monthEnd-now)/1000)
	// The config now has the month quota only.
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 1)
	for range 3 {
		if ok, err := s.takeQuotas(bg, []byte(key), ls, []bucket.Quota{month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if qout[0].Remaining != 1000-12 {
		t.Fatalf("the month's quota: %d left, want %d (the old count read)", qout[0].Remaining, 1000-12)
	}
	v, _ := srv.Do("GET", key).(string)
	if stale := fmt.Sprintf("q1:%d:5", yesterday); strings.Contains(v, stale) {
		t.Errorf("yesterday's count of a dropped day quota (%s) is still in the key after today's takes: %q; an old-format segment is kept by every call", stale, v)
	}
}

// A count of a quota the call does not name is kept, with the key living
// until its period ends, and is read again by a call that names it.
func TestAnUnnamedQuotasCountIsKeptUntilItsPeriodEnds(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	now := time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro()
	s.clockOffset = now - time.Now().UnixMicro()
	_, _, _, _, monthEnd := quotaBoundsAround(now)
	key := bucketFor("new-format")
	ls := []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}
	day := bucket.Quota{N: 50, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 1000, Period: bucket.Month, Loc: time.UTC}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 2)
	for range 4 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day, month}, 1, out, qout); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	for range 3 {
		if ok, err := s.takeQuotas(bg, key, ls, []bucket.Quota{day}, 1, out, qout[:1]); err != nil || !ok {
			t.Fatal(ok, err)
		}
	}
	if ttl := srv.Do("PTTL", string(key)).(int64) * 1000; ttl < (monthEnd-now)-60*second {
		t.Errorf("PTTL %s; the month's count needs %s", time.Duration(ttl)*time.Microsecond, time.Duration(monthEnd-now)*time.Microsecond)
	}
	if err := s.peekQuotas(bg, key, ls, []bucket.Quota{day, month}, out, qout); err != nil {
		t.Fatal(err)
	}
	if qout[0].Remaining != 43 || qout[1].Remaining != 996 {
		t.Errorf("day %d left, month %d left; want 43 and 996", qout[0].Remaining, qout[1].Remaining)
	}
}
