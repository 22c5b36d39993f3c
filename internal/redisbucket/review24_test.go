package redisbucket

import (
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Defect: the script keeps quota counts in segments named by the quota's
// index, q<i>:<start>:<used>, and drops a segment whose start is not
// quota i's current start. A reload that adds `quota 100/day` in front
// of `quota 1000/month` (or reorders or removes one) makes the month's
// count q1 -- read as the day quota's, whose start differs -- and the
// month's count starts over at 0 mid-month (on the 1st it is handed to the
// day quota instead). Breaks "a quota is a count that starts over at the
// period's boundary" and the spirit of "a reload that changes n keeps the
// count". script.go: the q<i> parse ("local q = Q[tonumber(qi)]") and save.
func TestReview24RedisReloadAddingAQuotaKeepsTheMonthsCount(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	s.clockOffset = time.Date(2026, 5, 15, 12, 0, 0, 0, time.UTC).UnixMicro() - time.Now().UnixMicro()
	key := bucketFor("review24-reload")
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

// Defect: the script's giveback subtracts from the quota's count of the
// period Redis is in now, not of the period the request was taken in: a
// request taken at 23:59:59.9 whose give-back (count_status) runs at
// 00:00:00.1 refunds a token of the new day, which then admits n+1.
// Breaks "a quota is a count that starts over at the boundary" (n a
// period) and "count_status give-backs return to quotas".
//
// And (review of issue 25) the same when the node's clock runs 150 ms
// ahead of Redis's: a request Redis counted at 23:59:59.95 was decided at
// 00:00:00.1 by the node's clock; a give-back named by the node's clock
// alone refunded the new day. It names the moment from the quota's answer
// (bucket.CountedAt), as settle.go does.
func TestReview24RedisGiveBackAfterTheBoundaryDoesNotRefundTheNewDay(t *testing.T) {
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
		key := bucketFor("review24-giveback " + tt.name)
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

// Defect: the node sends the boundaries of the period before, the period
// and the next around ITS clock, and the script clamps Redis's TIME into
// them. When Redis's clock is more than a period past the node's, the
// script picks [b2, b3), a period that ended: the quota's reset (and a
// refusal's Retry-After) is negative, and the count is kept under a past
// start. Breaks "the period is decided by Redis's clock". script.go: the
// "if now < b1 ... elseif now >= b2" choice.
func TestReview24RedisPeriodIsRedissWhenTheNodeIsADayBehind(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	key := string(bucketFor("review24-skew"))
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
