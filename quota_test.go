package ratelimit

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Calendar quotas through real Caddy configs.

// On New York's 23-hour day, `quota 3/day`: 3 pass, the 4th is refused
// until midnight (2 h, exactly), the headers report the quota that binds,
// and at midnight the count starts over. A refusal by the rate limit
// takes nothing from the quota.
func TestQuotaThroughCaddyOnADSTDay(t *testing.T) {
	clock := useFakeClock(t)
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Fatal(err)
	}
	clock.micros.Store(time.Date(2026, 3, 8, 22, 0, 0, 0, ny).UnixMicro())
	s := serve(t, `rate_limit {
		timezone America/New_York
		headers both
		key header X-Key
		tier all 2 1/m {
			quota 3/day
		}
	}
	respond ok`)
	get := func() response { return s.get("/", "X-Key: ann") }
	for i, want := range []int{200, 200, 429} {
		if r := get(); r.status != want {
			t.Fatalf("request %d: %d, want %d (the rate limit: 2, then 1 a minute)", i, r.status, want)
		}
	}
	clock.advance(time.Minute)
	r := get()
	if r.status != 200 || r.header.Get("X-Ratelimit-Remaining") != "0" || !strings.Contains(r.header.Get("RateLimit"), `"all-day";r=0;`) {
		t.Fatalf("the 3rd admitted: %d, remaining %q, RateLimit %q; want 200 with the quota's last (the refused request took nothing)", r.status, r.header.Get("X-Ratelimit-Remaining"), r.header.Get("RateLimit"))
	}
	// The window is the length of the day the request is answered in (by
	// the server's clock, which this fake clock does not move).
	today := time.Now().In(ny)
	day := time.Date(today.Year(), today.Month(), today.Day()+1, 0, 0, 0, 0, ny).Sub(time.Date(today.Year(), today.Month(), today.Day(), 0, 0, 0, 0, ny))
	if got, want := r.header.Get("RateLimit-Policy"), fmt.Sprintf(`"all";q=2;w=120, "all-day";q=3;w=%d`, int(day.Seconds())); got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	clock.advance(time.Minute)
	r = get()
	left := int64(2*3600 - 2*60)
	if r.status != 429 || r.header.Get("Retry-After") != strconv.FormatInt(left, 10) || r.header.Get("X-Ratelimit-Limit") != "3" {
		t.Fatalf("the 4th: %d, Retry-After %q, limit %q; want 429 until midnight, %d s, the quota (3) binding", r.status, r.header.Get("Retry-After"), r.header.Get("X-Ratelimit-Limit"), left)
	}
	if got := r.header.Get("RateLimit"); !strings.Contains(got, fmt.Sprintf(`"all-day";r=0;t=%d`, left)) {
		t.Errorf("RateLimit %q, want the day's item with r=0 and t=%d", got, left)
	}
	clock.micros.Store(time.Date(2026, 3, 9, 0, 0, 0, 0, ny).UnixMicro())
	if r := get(); r.status != 200 || r.header.Get("X-Ratelimit-Remaining") != "1" {
		t.Fatalf("at midnight: %d, remaining %q; want 200 (a new day; the rate limit binds with 1 left)", r.status, r.header.Get("X-Ratelimit-Remaining"))
	}
}

// In Redis, strict: the quota admits exactly n, and refuses until the
// boundary by Redis's clock.
func TestQuotaInRedis(t *testing.T) {
	srv := startRedis(t)
	s := serve(t, fmt.Sprintf(`rate_limit {
		key header X-Key
		tier all 100 100/s {
			quota 3/day
		}
		store redis {
			address %s
		}
	}
	respond ok`, srv.url()))
	for i := range 3 {
		if r := s.get("/", "X-Key: bob"); r.status != 200 {
			t.Fatalf("request %d: %d", i, r.status)
		}
	}
	r := s.get("/", "X-Key: bob")
	now := time.Now().UTC()
	midnight := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)
	retry, _ := strconv.Atoi(r.header.Get("Retry-After"))
	if want := int(midnight.Sub(now).Seconds()); r.status != 429 || retry < want-2 || retry > want+2 {
		t.Fatalf("the 4th: %d, Retry-After %d; want 429 until midnight UTC, about %d s", r.status, retry, want)
	}
	if ttl := srv.do("PTTL", srv.do("KEYS", "rl:*").([]any)[0]).(int64); ttl > midnight.Sub(now).Milliseconds()+3000 {
		t.Errorf("the key lives %d ms, past the day's end", ttl)
	}
}

func TestQuotaSettingsAreChecked(t *testing.T) {
	site := func(block string) string {
		return fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit {\n\t\t%s\n\t}\n\trespond ok\n}\n", freePort(t), block)
	}
	for _, tt := range []struct{ block, want string }{
		{"tier all 5 1/s {\n\t\t\tquota 0/day\n\t\t}", `quota "0/day"`},
		{"tier all 5 1/s {\n\t\t\tquota 5/fortnight\n\t\t}", `period "fortnight"`},
		{"tier all 5 1/s {\n\t\t\tcost 3\n\t\t\tquota 2/day\n\t\t}", "quota 2/day: smaller than a request's cost"},
		{"timezone Mars/Olympus\n\t\ttier all 5 1/s {\n\t\t\tquota 5/day\n\t\t}", `timezone "Mars/Olympus"`},
		{"timezone Local\n\t\ttier all 5 1/s {\n\t\t\tquota 5/day\n\t\t}", `timezone "Local"`},
	} {
		if _, err := adaptCaddyfile(site(tt.block)); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: %v, want an error containing %q", tt.block, err, tt.want)
		}
	}
	cfg, err := adaptCaddyfile(site("timezone Europe/Berlin\n\t\ttier all 5 1/s {\n\t\t\tquota 10000/month\n\t\t\tquota 500/day\n\t\t}"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(cfg), `"quotas":["10000/month","500/day"]`) || !strings.Contains(string(cfg), `"timezone":"Europe/Berlin"`) {
		t.Errorf("adapted: %s", cfg)
	}
}

// The admin API shows each quota's used, left and reset, DELETE starts it
// over, and the policy listing shows the quotas and their zone.
func TestQuotaAdmin(t *testing.T) {
	s, admin := serveWithAdmin(t, `rate_limit {
		name quota_admin
		timezone Europe/Berlin
		tier all 100 100/s {
			quota 5/month
		}
	}
	respond ok`)
	for range 2 {
		if r := s.from("127.0.0.2", "/"); r.status != 200 {
			t.Fatal(r.status)
		}
	}
	var got bucketState
	if status := getJSON(t, admin+"/rate_limit/buckets?policy=quota_admin&value=127.0.0.2", &got); status != 200 || len(got.Quotas) != 1 {
		t.Fatalf("GET: %d, %+v", status, got)
	}
	q := got.Quotas[0]
	berlin, _ := time.LoadLocation("Europe/Berlin")
	now := time.Now().In(berlin)
	next := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, berlin).Unix()
	if q.Quota != "5/month" || q.Used != 2 || q.Left != 3 || q.Reset < next || q.Reset > next+1 {
		t.Fatalf("the quota: %+v; want 2 used, 3 left, reset at %d (the 1st in Berlin)", q, next)
	}
	req, _ := http.NewRequest(http.MethodDelete, admin+"/rate_limit/buckets?policy=quota_admin&value=127.0.0.2", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if status := getJSON(t, admin+"/rate_limit/buckets?policy=quota_admin&value=127.0.0.2", &got); status != 200 || got.Quotas[0].Used != 0 {
		t.Fatalf("after DELETE: %d, %+v", status, got.Quotas)
	}
	var views []policyView
	getJSON(t, admin+"/rate_limit/policies", &views)
	for _, v := range views {
		if v.Policy == "quota_admin" && (len(v.Tiers) != 1 || fmt.Sprint(v.Tiers[0].Quotas) != "[5/month]" || v.Tiers[0].Timezone != "Europe/Berlin") {
			t.Errorf("listing: %+v", v.Tiers)
		}
	}
}

// A reload that changes a quota's n keeps the period's count, in the
// local store and in Redis; a second quota of one period is an error.
func TestQuotaReloadKeepsTheCount(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			conf := func(n int) string {
				return fmt.Sprintf(`rate_limit {
		name quota_reload_%d
		headers ietf
		key header X-Key
		tier all 100 100/s {
			quota %d/month
		}
		%s
	}
	respond ok`, i, n, mode.store)
			}
			s := serve(t, conf(5))
			for range 3 {
				s.get("/", "X-Key: carol")
			}
			s = serve(t, conf(10))
			if got := s.get("/", "X-Key: carol").header.Get("RateLimit"); !strings.Contains(got, `"all-month";r=6;`) {
				t.Fatalf("after the reload to 10/month: RateLimit %q, want 6 left (3 used before, 1 now)", got)
			}
		})
	}
	if _, err := adaptCaddyfile(fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit {\n\t\ttier all 5 1/s {\n\t\t\tquota 5/day\n\t\t\tquota 9/day\n\t\t}\n\t}\n}\n", freePort(t))); err == nil || !strings.Contains(err.Error(), "a second quota per day") {
		t.Errorf("two quotas per day: %v", err)
	}
}

// `quota` in the rate_limit block counts for the catch-all tier: 3 pass,
// and the 4th is refused until the day's end.
// Regression test for issue 30 item 2.
func TestQuotaInTheRateLimitBlockRefusesUntilTheDaysEnd(t *testing.T) {
	clock := useFakeClock(t)
	clock.micros.Store(time.Date(2026, 3, 10, 20, 0, 0, 0, time.UTC).UnixMicro())
	s := serve(t, `rate_limit 100 10/s {
		key header X-Key
		headers both
		quota 3/day
	}
	respond ok`)
	for i := range 3 {
		if r := s.get("/", "X-Key: ann"); r.status != 200 {
			t.Fatalf("request %d: %d, want 200", i+1, r.status)
		}
	}
	r := s.get("/", "X-Key: ann")
	if r.status != 429 || r.header.Get("Retry-After") != "14400" || r.header.Get("X-Ratelimit-Limit") != "3" {
		t.Fatalf("the 4th: %d, Retry-After %q, limit %q; want 429 until midnight UTC, 14400 s, the quota (3) binding", r.status, r.header.Get("Retry-After"), r.header.Get("X-Ratelimit-Limit"))
	}
	if got := r.header.Get("RateLimit"); !strings.Contains(got, `"default-day";r=0;t=14400`) {
		t.Errorf("RateLimit %q, want the day's item with r=0 and t=14400", got)
	}
}

// A tier of quotas and no rate limit is a plan, in a tier block and for
// the catch-all tier, in every store mode: its quotas admit n a period
// and refuse until the boundary, and headers, placeholders and the admin
// API show the quotas alone.
// Regression test for issue 30 item 3.
func TestATierOfQuotasAloneIsAPlanInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			policy := fmt.Sprintf("quotas_alone_%d", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		headers both
		key header X-Key
		tier free {
			match header X-Plan free
			quota 4/day
		}
		quota 10/month
		%s
	}
	respond "{http.rate_limit.limit} {http.rate_limit.remaining}"`, policy, mode.store))
			for i := range 4 {
				r := s.get("/", "X-Key: ann", "X-Plan: free")
				left := strconv.Itoa(3 - i)
				if r.status != 200 || r.body != "4 "+left || r.header.Get("X-Ratelimit-Limit") != "4" || r.header.Get("X-Ratelimit-Remaining") != left {
					t.Fatalf("request %d: %d, body %q, X-RateLimit-Limit %q, -Remaining %q; want 200 and the day's quota, 4, with %s left", i+1, r.status, r.body, r.header.Get("X-Ratelimit-Limit"), r.header.Get("X-Ratelimit-Remaining"), left)
				}
				if got := r.header.Get("RateLimit-Policy"); got != `"free-day";q=4;w=86400` {
					t.Errorf("request %d: RateLimit-Policy %q, want the quota's item alone", i+1, got)
				}
				if got := r.header.Get("RateLimit"); !strings.HasPrefix(got, `"free-day";r=`+left+";t=") || strings.Contains(got, ",") {
					t.Errorf("request %d: RateLimit %q, want the quota's item alone, %s left", i+1, got, left)
				}
			}
			r := s.get("/", "X-Key: ann", "X-Plan: free")
			now := time.Now().UTC()
			midnight := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)
			retry, _ := strconv.Atoi(r.header.Get("Retry-After"))
			want := int(midnight.Sub(now).Seconds())
			if r.status != 429 || retry < want-2 || retry > want+2 {
				t.Fatalf("the 5th: %d, Retry-After %d; want 429 until midnight UTC, about %d s", r.status, retry, want)
			}

			r = s.get("/", "X-Key: bob")
			month := time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC).Sub(time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC))
			if r.status != 200 || r.header.Get("X-Ratelimit-Limit") != "10" || r.header.Get("RateLimit-Policy") != fmt.Sprintf(`"default-month";q=10;w=%d`, int(month.Seconds())) {
				t.Errorf("the catch-all tier: %d, X-RateLimit-Limit %q, RateLimit-Policy %q; want 200 and the month's quota alone", r.status, r.header.Get("X-Ratelimit-Limit"), r.header.Get("RateLimit-Policy"))
			}

			var got bucketState
			if status := getJSON(t, admin+"/rate_limit/buckets?policy="+policy+"&tier=free&keyer=header&value=ann", &got); status != 200 {
				t.Fatalf("GET the bucket: %d, %+v", status, got)
			}
			if len(got.Limits) != 0 || got.Capacity != 0 || len(got.Quotas) != 1 || got.Quotas[0].Quota != "4/day" || got.Quotas[0].Used != 4 {
				t.Errorf("the bucket: %+v; want the quota alone, 4 used", got)
			}
			var views []policyView
			getJSON(t, admin+"/rate_limit/policies", &views)
			for _, v := range views {
				if v.Policy != policy {
					continue
				}
				for _, tv := range v.Tiers {
					if len(tv.Limits) != 0 || len(tv.Quotas) != 1 {
						t.Errorf("the listing's tier %q: %+v; want the quota alone", tv.Name, tv)
					}
				}
			}
		})
	}
}

// An origin's cost_from_response figure of 2^63-1 uses the quota up: the
// next request is refused until the day ends, though the limit, whose
// debt such a figure bounds, has refilled by then.
// Regression test for issue 30 item 1.
func TestAHugeResponseCostUsesUpTheQuota(t *testing.T) {
	clock := useFakeClock(t)
	noon := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	clock.micros.Store(noon.UnixMicro())
	origin := streamingOrigin(t, strconv.FormatInt(math.MaxInt64, 10))
	s := serve(t, fmt.Sprintf(`rate_limit {
		tier all 100 100000/s {
			quota 5/day
			cost_from_response X-Tokens-Used
		}
	}
	reverse_proxy %s`, origin))
	if r := s.from("127.0.0.2", "/?header=1"); r.status != 200 {
		t.Fatalf("the first request: %d", r.status)
	}
	// The limit's debt, a thousand capacities at 100000/s, is paid in a
	// second.
	clock.advance(10 * time.Second)
	r := s.from("127.0.0.2", "/?header=1")
	if want := strconv.Itoa(12*3600 - 10); r.status != 429 || r.header.Get("Retry-After") != want {
		t.Fatalf("after a charge of 2^63-1: %d, Retry-After %q; want 429 until midnight, %s s", r.status, r.header.Get("Retry-After"), want)
	}
}

// A reload that drops a tier's rate limit and keeps its quota: the tier
// becomes a plan of quotas alone, whose hidden limit "never refuses what
// the quotas admit". A client that had spent the old rate limit (its
// state is kept at the limit's place, where the hidden limit now reads)
// is admitted while the quota has room, not refused until the old limit
// would have refilled.
func TestAReloadToAPlanOfQuotasAloneAdmitsWhatTheQuotaHolds(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			conf := func(limit string) string {
				return fmt.Sprintf(`rate_limit {
		name quota_alone_%d
		key header X-Key
		tier all %s {
			quota 100/day
		}
		%s
	}
	respond ok`, i, limit, mode.store)
			}
			s := serve(t, conf("2 1/h"))
			for range 2 {
				s.get("/", "X-Key: dan")
			}
			if r := s.get("/", "X-Key: dan"); r.status != 429 {
				t.Fatalf("the third request under 2 1/h: %d, want 429", r.status)
			}
			s = serve(t, conf(""))
			if r := s.get("/", "X-Key: dan"); r.status != 200 {
				t.Errorf("after the reload to quotas alone, with 98 of 100 left today: %d, Retry-After %q; want 200", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}

// A plan of quotas alone with cost_from_response and count_status, across
// a reload that raises n, in every store mode: each request takes its
// cost, then the origin's figure, at most what is left; a used-up quota
// refuses until midnight; the reload keeps the count, so the new n leaves
// only the difference.
func TestAPlanOfQuotasAloneWithAResponseCostAcrossAReload(t *testing.T) {
	srv := startRedis(t)
	origin := streamingOrigin(t, "3")
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			conf := func(n int) string {
				return fmt.Sprintf(`rate_limit {
		name quota_plan_reload_%d
		key header X-Key
		quota %d/day
		cost_from_response X-Tokens-Used
		count_status 2xx
		%s
	}
	reverse_proxy %s`, i, n, mode.store, origin)
			}
			s := serve(t, conf(10))
			var trace []string
			get := func() response {
				r := s.get("/?header=1", "X-Key: ann")
				trace = append(trace, fmt.Sprintf("%d remaining %q retry %q", r.status, r.header.Get("X-Ratelimit-Remaining"), r.header.Get("Retry-After")))
				return r
			}
			// 4 each: 1 to go on, 3 after; the third finds 2 left.
			for range 3 {
				if r := get(); r.status != 200 {
					t.Fatalf("the first three: %s", strings.Join(trace, "; "))
				}
			}
			r := get()
			now := time.Now().UTC()
			untilMidnight := int(time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC).Sub(now).Seconds())
			if retry, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || retry < untilMidnight-2 || retry > untilMidnight+2 {
				t.Fatalf("the fourth, with the quota used up: %s; want 429 until midnight, about %d s", strings.Join(trace, "; "), untilMidnight)
			}
			s = serve(t, conf(12))
			if r := get(); r.status != 200 || r.header.Get("X-Ratelimit-Remaining") != "1" {
				t.Fatalf("after the reload to 12 a day, with 10 used: %s; want 200 with 1 left", strings.Join(trace, "; "))
			}
			if r := get(); r.status != 429 {
				t.Errorf("with 12 of 12 used: %s; want 429", strings.Join(trace, "; "))
			}
		})
	}
}
