package ratelimit

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// skipNearUTCMidnight skips a real-clock test that a day boundary could
// disturb.
func skipNearUTCMidnight(t *testing.T) {
	now := time.Now().UTC()
	if now.Hour() == 23 && now.Minute() >= 58 || now.Hour() == 0 && now.Minute() < 2 {
		t.Skip("too close to midnight UTC")
	}
}

// Through Caddy with the real clocks: quota 5/day admits about every
// other request instead of 5 a day.
func TestReview24LocalQuotaAdmitsNThroughCaddyWithRealClocks(t *testing.T) {
	skipNearUTCMidnight(t)
	s := serve(t, `rate_limit {
		key header X-Key
		tier all 1000 1000/s {
			quota 5/day
		}
	}
	respond ok`)
	admitted := 0
	for range 60 {
		if r := s.get("/", "X-Key: jitter"); r.status == 200 {
			admitted++
		}
	}
	if admitted != 5 {
		t.Errorf("quota 5/day admitted %d of 60 requests, want 5", admitted)
	}
}

// Defect: on a day whose midnight does not exist (Havana, DST at 00:00 on
// 8 March 2026), Bounds puts Saturday's end at Saturday 23:00 (the
// normalized "Sunday 00:00"), so a client refused by `quota 1/day` at
// Saturday 23:30 gets Retry-After: 1 (the boundary is 30 minutes away:
// Sunday 01:00) and is refused again when it retries. Breaks "Refused on
// a quota: Retry-After = seconds until the boundary". bucket/quota.go:84-104.
func TestReview24RetryAfterOnAHavanaDSTEve(t *testing.T) {
	clock := useFakeClock(t)
	havana, err := time.LoadLocation("America/Havana")
	if err != nil {
		t.Fatal(err)
	}
	clock.micros.Store(time.Date(2026, 3, 7, 12, 0, 0, 0, havana).UnixMicro())
	s := serve(t, `rate_limit {
		timezone America/Havana
		key header X-Key
		tier all 100 100/s {
			quota 1/day
		}
	}
	respond ok`)
	if r := s.get("/", "X-Key: cu"); r.status != 200 {
		t.Fatalf("the day's first: %d", r.status)
	}
	clock.micros.Store(time.Date(2026, 3, 7, 23, 30, 0, 0, havana).UnixMicro())
	r := s.get("/", "X-Key: cu")
	if r.status != 429 || r.header.Get("Retry-After") != "1800" {
		t.Errorf("Saturday 23:30: %d, Retry-After %q; want 429, 1800 (Sunday begins at 01:00 CDT, 30 minutes on)", r.status, r.header.Get("Retry-After"))
	}
}

// Defect: when a quota and a rate limit both refuse, the limits are only
// peeked (bucket.TakeAllQuotas, shared.go/quota.go refuse path; the Lua
// script's peek), so their RetryAfter is 0 and Retry-After is the
// quota's boundary alone: 1 s before midnight a client whose limit needs
// 59 minutes is told "Retry-After: 1", and its retry at midnight is refused
// again. Retry-After promises a time the request passes.
func TestReview24RetryAfterCoversTheLimitWhenAQuotaAlsoRefuses(t *testing.T) {
	clock := useFakeClock(t)
	clock.micros.Store(time.Date(2026, 5, 4, 23, 59, 0, 0, time.UTC).UnixMicro())
	s := serve(t, `rate_limit {
		key header X-Key
		tier all 1 1/h {
			quota 1/day
		}
	}
	respond ok`)
	if r := s.get("/", "X-Key: both"); r.status != 200 {
		t.Fatalf("first: %d", r.status)
	}
	clock.micros.Store(time.Date(2026, 5, 4, 23, 59, 59, 0, time.UTC).UnixMicro())
	r := s.get("/", "X-Key: both")
	retry := r.header.Get("Retry-After")
	clock.micros.Store(time.Date(2026, 5, 5, 0, 0, 1, 0, time.UTC).UnixMicro())
	again := s.get("/", "X-Key: both")
	if r.status == 429 && retry == "1" && again.status == 429 {
		t.Errorf("refused at 23:59:59 with Retry-After %q; the retry after it (00:00:01) is refused too (%d, Retry-After %q): Retry-After must cover the limit (about 3540 s)", retry, again.status, again.header.Get("Retry-After"))
	}
}

// Defect: quota counts are stored by index (the local table's quotaID(id,
// i); Redis's q<i> segments), and a quota's period is recovered from
// its stored end by the CURRENT quota i's calendar. A reload that adds
// `quota 100/day` in front of `quota 1000/month` on the last day of the
// month hands the month's count (5) to the day quota (day's FullAt-1 is
// today) and starts the month's count over at 0. Breaks "a quota is a
// count that starts over at the period's boundary" (the month's count
// started over mid-month) and the spirit of "a reload that changes n
// keeps the count". quota.go:145 (quotaID by index), quota.go:147-154.
func TestReview24ReloadAddingAQuotaKeepsTheOthersCounts(t *testing.T) {
	clock := useFakeClock(t)
	clock.micros.Store(time.Date(2026, 5, 31, 12, 0, 0, 0, time.UTC).UnixMicro())
	site := func(port int, quotas string) string {
		return fmt.Sprintf(`{
	admin off
	skip_install_trust
}
http://127.0.0.1:%d {
	rate_limit {
		name review24_reload
		headers ietf
		key header X-Key
		tier all 100 100/s {
			%s
		}
	}
	respond ok
}
`, port, quotas)
	}
	port := freePort(t)
	s := serveCaddyfile(t, port, site(port, "quota 1000/month"))
	for range 5 {
		if r := s.get("/", "X-Key: plan"); r.status != 200 {
			t.Fatalf("before the reload: %d", r.status)
		}
	}
	cfg, err := adaptCaddyfile(site(port, "quota 100/day\n\t\t\tquota 1000/month"))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	r := s.get("/", "X-Key: plan")
	got := r.header.Get("RateLimit")
	if !strings.Contains(got, `"all-month";r=994;`) || !strings.Contains(got, `"all-day";r=99;`) {
		t.Errorf("after the reload, RateLimit %q; want the month at 994 left (5 before, 1 now) and the day at 99", got)
	}
}
