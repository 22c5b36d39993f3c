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
