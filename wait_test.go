package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
)

// max_wait's settings, placeholder, metric and listing.

func TestMaxWaitCaddyfile(t *testing.T) {
	t.Parallel()
	site := func(block string) string {
		return fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit 1 10/s {\n\t\t%s\n\t}\n\trespond ok\n}\n", freePort(t), block)
	}
	cfg, err := adaptCaddyfile(site("max_wait 1s\n\t\tmax_waiting 50\n\t\ttier slow 5 1/s {\n\t\t\tmax_wait 3s\n\t\t\tmatch path /slow\n\t\t}"))
	if err != nil {
		t.Fatal(err)
	}
	hs := findHandlers(t, cfg)
	if len(hs) != 1 || hs[0].MaxWait != caddy.Duration(time.Second) || hs[0].MaxWaiting != 50 || hs[0].Tiers[0].MaxWait != caddy.Duration(3*time.Second) {
		t.Fatalf("adapted: %s", cfg)
	}
	// Adapted JSON shows what was written, and no default.
	if !strings.Contains(string(cfg), `"max_wait":1000000000,"max_waiting":50`) || strings.Contains(string(cfg), `"max_wait":0`) {
		t.Errorf("adapted JSON: %s", cfg)
	}
	for _, tt := range []struct{ block, want string }{
		{"max_wait 0", `max_wait "0": must be above 0`},
		{"max_wait -1s", `max_wait "-1s": must not be negative`},
		{"max_wait soon", `max_wait "soon"`},
		{"max_waiting 0", "max_waiting 0: must be at least 1"},
		{"max_waiting -5", "max_waiting -5: must be at least 1"},
		{"max_wait 1s\n\t\tmax_wait 2s", "max_wait"},
		{"max_wait 2h", "max_wait 2h0m0s: must be at most the time 1000 capacities take to refill, 1m40s"},
		{"tier t 5 1/s {\n\t\t\tmax_wait 0\n\t\t\tmatch path /t\n\t\t}", `max_wait "0": must be above 0`},
	} {
		_, err := adaptCaddyfile(site(tt.block))
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.block, err, tt.want)
		}
	}
}

func TestMaxWaitJSONMistakesFailAtProvision(t *testing.T) {
	for _, tt := range []struct{ cfg, want string }{
		{`{"max_wait":-1000,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`, "max_wait -1µs"},
		{`{"max_waiting":-1,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`, "max_waiting -1"},
		{`{"tiers":[{"name":"default","capacity":1,"refill":"1/s","max_wait":-5}]}`, `tier "default": max_wait -5ns`},
	} {
		h := new(Handler)
		if err := json.Unmarshal([]byte(tt.cfg), h); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		err := h.Provision(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error containing %q", tt.cfg, err, tt.want)
		}
	}
}

// {http.rate_limit.waited} and the histogram say how long a request
// waited; a tier of several limits waits for the slowest; the listing
// shows max_wait. The clock is fake and stands still, so the waits are
// exact: the timers are real.
func TestMaxWaitPlaceholderMetricAndSlowestLimit(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"waited","max_wait":1000000000,"tiers":[{"name":"default","limits":[{"capacity":1,"refill":"100/s"},{"capacity":1,"refill":"20/s"}]}]}`)
	defer done()
	before := waitCount(t, "waited", "default")
	waited := make([]string, 3)
	var wg sync.WaitGroup
	for i := range 3 {
		wg.Go(func() {
			// In order: the i-th request takes the i-th place.
			time.Sleep(time.Duration(i) * 20 * time.Millisecond)
			r := keyed(benchRequest("127.0.0.1"))
			w := httptest.NewRecorder()
			if err := h.ServeHTTP(w, r, nopHandler); err != nil {
				t.Error(err)
			}
			repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			waited[i], _ = repl.GetString("http.rate_limit.waited")
		})
	}
	wg.Wait()
	// The slow limit (20/s) binds: 0, 50 and 100 ms.
	if got := strings.Join(waited, " "); got != "0 50 100" {
		t.Errorf("{http.rate_limit.waited}: %s, want 0 50 100", got)
	}
	if n := waitCount(t, "waited", "default") - before; n != 2 {
		t.Errorf("wait_seconds counted %d requests, want the 2 that waited", n)
	}
	v := viewOf(h)
	if v.Tiers[0].MaxWait != "1s" || v.MaxWaiting != defaultMaxWaiting || v.Waiting != 0 {
		t.Errorf("policy listing: %+v", v)
	}
}

// keyed names r's client "k" by X-Key.
func keyed(r *http.Request) *http.Request {
	r.Header.Set("X-Key", "k")
	return r
}

// waitCount is the wait histogram's count for a policy's tier.
func waitCount(t *testing.T, policy, tier string) uint64 {
	t.Helper()
	var m dto.Metric
	if err := waitSeconds.WithLabelValues(policy, tier).(interface{ Write(*dto.Metric) error }).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// A dry run never delays a request, and a request over max_waiting is
// refused at once and takes nothing.
func TestMaxWaitDryRunAndMaxWaiting(t *testing.T) {
	t.Parallel()
	clock := newFakeClock().clocks()
	dry, done := provisionedHandlerOn(t, clock, `{"name":"dry_wait","dry_run":true,"max_wait":10000000000,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
	defer done()
	for i := range 3 {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		err := dry.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")).WithContext(ctx), nopHandler)
		late := ctx.Err()
		cancel()
		if err != nil || late != nil {
			t.Fatalf("dry run, request %d: %v, %v; want through at once", i, err, late)
		}
	}

	h, done2 := provisionedHandlerOn(t, clock, `{"name":"one_waiter","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":10000000000,"max_waiting":1,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
	defer done2()
	gone, hangUp := context.WithCancel(context.Background())
	defer hangUp()
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	first := make(chan error, 1)
	go func() {
		r := keyed(benchRequest("127.0.0.1")).WithContext(gone)
		first <- h.ServeHTTP(httptest.NewRecorder(), r, nopHandler)
	}()
	for h.waiting.Load() != 1 {
		time.Sleep(time.Millisecond)
	}
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler)
	if err == nil || !strings.Contains(err.Error(), "max_waiting") || w.Header().Get("Retry-After") != "2" {
		t.Fatalf("the second waiter: %v, Retry-After %q; want refused, retry in 2 s (its wait)", err, w.Header().Get("Retry-After"))
	}
	// The refused one took nothing, and the waiter whose client went (499)
	// gave its token back: the bucket lacks only the first request's
	// token, so the next request waits one token's refill, 1 s.
	hangUp()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	res, err := takeLimit(context.Background(), h.store, &Bucket{Policy: "one_waiter", Tier: "default", Keyer: "header/X-Key", Value: []byte("k")}, h.Tiers[0].limits[0], 1)
	if err != nil || !res.Allowed || res.Wait != 1_000_000 {
		t.Fatalf("after the waiter went, the next request: %+v, %v; want allowed after exactly 1 s", res, err)
	}
}

// A request that waits answers its RateLimit fields from when it goes on,
// for every limit of its tier: the slowest limit's reset less the wait,
// and a limit that had room taken when the request goes on, as its level
// then says. They spoke from the decision: the minute's limit said 8 left
// and 2 s to full, where 9 and 1 s were true when the headers went out.
func TestAWaiterAnswersEachLimitFromWhenItGoesOn(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"waited_items","headers":"ietf","max_wait":2000000000,"tiers":[{"name":"default","limits":[{"capacity":1,"refill":"1/s"},{"capacity":10,"refill":"1/s"}]}]}`)
	defer done()
	var got []string
	for range 2 {
		w := httptest.NewRecorder()
		if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
			t.Fatal(err)
		}
		got = append(got, w.Header().Get("RateLimit"))
	}
	// The first goes at once; the second waits 1 s for the first limit's
	// token, and takes from the second limit when it goes on, when the
	// first request's token is back there.
	want := []string{`"default";r=0;t=1, "default-2";r=9;t=1`, `"default";r=0;t=1, "default-2";r=9;t=1`}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("request %d: RateLimit %q, want %q", i+1, got[i], want[i])
		}
	}
}

// statusOrigin answers with the status the request's X-Status asks for.
var statusOrigin = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	if r.Header.Get("X-Status") == "401" {
		w.WriteHeader(http.StatusUnauthorized)
		return nil
	}
	w.WriteHeader(http.StatusOK)
	return nil
})

// serveStatus serves one request of the client k through h to
// statusOrigin, asking it for status ("" for 200); any error of h fails
// the test (Errorf: it may run in a goroutine).
func serveStatus(t *testing.T, h *Handler, status string) *httptest.ResponseRecorder {
	r := keyed(benchRequest("127.0.0.1"))
	if status != "" {
		r.Header.Set("X-Status", status)
	}
	w, err := serveOne(h, r, statusOrigin)
	if err != nil {
		t.Errorf("ServeHTTP: %v", err)
	}
	return w
}

// bubbleClocks are the clocks of a synctest bubble, for a handler
// provisioned in it: the waits' timers, the decision's start (time.Now)
// and the local store's clocks are then all the bubble's fake time, which
// starts at 2000-01-01 00:00 UTC, so a wait of hours takes none.
var bubbleClocks = clocks{now: wallMicros, wall: wallMicros}

// quotasNow reads the last tier's quotas of the client k as they stand now.
func quotasNow(t *testing.T, h *Handler) []bucket.Result {
	tier := h.Tiers[len(h.Tiers)-1]
	b := &Bucket{Policy: h.Name, Tier: tier.Name, Keyer: "header/X-Key", Value: []byte("k"), secret: h.keySecret}
	out := make([]bucket.Result, len(tier.limits)+len(tier.quotas))
	if err := h.store.peek(context.Background(), b, tier.shape(), out); err != nil {
		t.Fatal(err)
	}
	return out[len(tier.limits):]
}

// A request that waits across midnight (an ordinary one-minute max_wait,
// 30 s before midnight) goes on in a new day, and its quota item speaks of
// the quota as it stands then: the new day's count, and the seconds to the
// next midnight.
// Regression test for 596d67b.
func TestAWaitersQuotaItemAcrossMidnightSpeaksOfTheNewDay(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		time.Sleep(23*time.Hour + 59*time.Minute + 30*time.Second) // 23:59:30
		h, done := provisionedHandlerOn(t, bubbleClocks, `{"name":"wait_quota_item","keys":[{"keyer":"header","field":"X-Key"}],"headers":"both","max_wait":120000000000,
			"tiers":[{"name":"default","capacity":1,"refill":"1/m","quotas":["10/day"]}]}`)
		defer done()
		serveStatus(t, h, "")
		start := time.Now()
		w := serveStatus(t, h, "") // waits a minute: goes on at 00:00:30
		if waited := time.Since(start); waited != time.Minute {
			t.Fatalf("the second request waited %s, want 1m", waited)
		}
		q := quotasNow(t, h)[0]
		want := fmt.Sprintf(`"default-day";r=%d;t=%d`, q.Remaining, bucket.CeilDiv(q.ResetAfter, 1e6))
		got := w.Header().Get("RateLimit")
		t.Logf("at %s: RateLimit %q, RateLimit-Policy %q; the quota as it stands: %+v", time.Now().UTC().Format(time.TimeOnly), got, w.Header().Get("RateLimit-Policy"), q)
		if !strings.Contains(got, want) {
			t.Errorf("the waiter's quota item: RateLimit %q, want %s (the new day's quota, as it stands when the request goes on)", got, want)
		}
	})
}

// With a long max_wait (10 h, valid for a limit of 1 token every 2 h), a
// request that waits past midnight by more than an hour and is given back
// (count_status) refunds the day that counted it, and no other.
// Regression test for 596d67b.
func TestAGiveBackOfAWaitHoursPastMidnightRefundsTheDayThatCountedIt(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		time.Sleep(23*time.Hour + 50*time.Minute) // 23:50 on 1 January
		h, done := provisionedHandlerOn(t, bubbleClocks, `{"name":"wait_giveback_long","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","count_status":["200"],"max_wait":36000000000000,
			"tiers":[{"name":"default","capacity":2,"refill":"1/2h","quotas":["10/day"]}]}`)
		defer done()
		// Two requests at 23:50 take both tokens, counted on 1 January.
		serveStatus(t, h, "")
		serveStatus(t, h, "")
		var wg sync.WaitGroup
		// B, at 23:50, counted on 1 January, waits 2 h for a token and
		// goes on at 01:50 on 2 January; the origin says 401, which does
		// not count: its token goes back, and so does 1 January's count.
		wg.Go(func() { serveStatus(t, h, "401") })
		time.Sleep(20 * time.Minute)
		// C, at 00:10 on 2 January, is counted there (it waits too).
		wg.Go(func() { serveStatus(t, h, "") })
		time.Sleep(time.Second)
		if q := quotasNow(t, h)[0]; q.Remaining != 9 {
			t.Fatalf("2 January after C: %+v, want 9 left", q)
		}
		wg.Wait()
		q := quotasNow(t, h)[0]
		t.Logf("at %s, 2 January's quota: %+v", time.Now().UTC().Format(time.DateTime), q)
		if q.Remaining != 9 {
			t.Errorf("B's give-back (counted on 1 January) refunded 2 January: %d left there, want 9 (C was counted there, B was not)", q.Remaining)
		}
	})
}

// The shorter case beside it: a wait past midnight by less than an hour
// refunds nothing of the new day either.
func TestAGiveBackOfAWaitJustPastMidnightRefundsTheDayThatCountedIt(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		time.Sleep(23*time.Hour + 59*time.Minute) // 23:59
		h, done := provisionedHandlerOn(t, bubbleClocks, `{"name":"wait_giveback_short","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","count_status":["200"],"max_wait":600000000000,
			"tiers":[{"name":"default","capacity":2,"refill":"1/2m","quotas":["10/day"]}]}`)
		defer done()
		serveStatus(t, h, "")
		serveStatus(t, h, "")
		var wg sync.WaitGroup
		wg.Go(func() { serveStatus(t, h, "401") }) // goes on at 00:01
		time.Sleep(90 * time.Second)
		wg.Go(func() { serveStatus(t, h, "") }) // 00:00:30, counted on 2 January
		wg.Wait()
		if q := quotasNow(t, h)[0]; q.Remaining != 9 {
			t.Errorf("2 January's quota: %+v, want 9 left", q)
		}
	})
}

// rateLimitItem reads one RateLimit item's r and t by its name.
func rateLimitItem(t *testing.T, field, name string) (r, tt int64) {
	t.Helper()
	for _, item := range strings.Split(field, ", ") {
		if strings.HasPrefix(item, strconv.Quote(name)+";") {
			if _, err := fmt.Sscanf(strings.TrimPrefix(item, strconv.Quote(name)), ";r=%d;t=%d", &r, &tt); err != nil {
				t.Fatalf("item %q: %v", item, err)
			}
			return r, tt
		}
	}
	t.Fatalf("RateLimit %q has no item %q", field, name)
	return 0, 0
}

// adminQuotas is admin GET's answer with the quotas.
type adminQuotas struct {
	adminBucket
	Quotas []struct {
		Left       int64 `json:"left"`
		ResetAfter int64 `json:"reset_after"`
		Reset      int64 `json:"reset"`
	} `json:"quotas"`
}

// In every store mode, a request of a tier of two limits and a quota that
// waits (max_wait) answers each RateLimit item, and the X- fields, as the
// bucket stands when it goes on: what admin GET reads right after it (the
// limits refill too slowly for the ms between to matter).
// Regression test for 596d67b.
func TestAWaitersItemsMatchTheBucketWhenItGoesOnInEveryStoreMode(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			name := fmt.Sprint("wait_items_", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		headers both
		max_wait 3s
		tier api {
			limit 4 1/s
			limit 20 1/10s
			quota 1000/day
		}
		%s
	}
	respond "ok"`, name, mode.store))
			var r response
			var waited time.Duration
			for n := range 8 {
				began := time.Now()
				r = s.from("127.0.0.2", "/")
				if waited = time.Since(began); waited > 300*time.Millisecond {
					t.Logf("request %d waited %s", n+1, waited)
					break
				}
			}
			if waited <= 300*time.Millisecond || r.status != 200 {
				t.Fatalf("no request waited: last %d after %s", r.status, waited)
			}
			var got adminQuotas
			if status := getJSON(t, admin+"/rate_limit/buckets?policy="+name+"&tier=api&value=127.0.0.2", &got); status != 200 {
				t.Fatalf("GET: %d", status)
			}
			field := r.header.Get("RateLimit")
			t.Logf("RateLimit %q, X-RateLimit-Remaining %q, X-RateLimit-Reset %q; GET %+v", field, r.header.Get("X-RateLimit-Remaining"), r.header.Get("X-RateLimit-Reset"), got)
			near := func(a, b int64) bool { return a-b <= 1 && b-a <= 1 }
			for j, item := range []string{"api", "api-2"} {
				rr, tt := rateLimitItem(t, field, item)
				if rr != got.Limits[j].Remaining || !near(tt, got.Limits[j].ResetAfter) || tt < 0 {
					t.Errorf("limit %d: item r=%d t=%d; the bucket when it went on: %+v", j+1, rr, tt, got.Limits[j])
				}
			}
			rr, tt := rateLimitItem(t, field, "api-day")
			if rr != got.Quotas[0].Left || !near(tt, got.Quotas[0].ResetAfter) {
				t.Errorf("quota: item r=%d t=%d; the quota when it went on: %+v", rr, tt, got.Quotas[0])
			}
			rem, _ := strconv.ParseInt(r.header.Get("X-RateLimit-Remaining"), 10, 64)
			reset, _ := strconv.ParseInt(r.header.Get("X-RateLimit-Reset"), 10, 64)
			if rem != got.Remaining || !near(reset, got.Reset) {
				t.Errorf("X-RateLimit-Remaining %d, -Reset %d; the binding limit when it went on: %+v", rem, reset, got.adminLimit)
			}
		})
	}
}

// A request of cost 0 (a cost placeholder) on a tier whose first limit is
// in debt (cost_from_response) waits that debt out, and answers the other
// limit's item as it stands when it goes on (full), not as it stood at the
// decision.
// Regression test for 596d67b.
func TestACostZeroWaiterAnswersTheOtherLimitFromWhenItGoesOn(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		time.Sleep(12 * time.Hour)
		h, done := provisionedHandlerOn(t, bubbleClocks, `{"name":"wait_cost0","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","max_wait":10000000000,
			"tiers":[{"name":"default","cost_placeholder":"{wait.cost}","cost_from_response":"X-Used","limits":[{"capacity":2,"refill":"1/s"},{"capacity":10,"refill":"10/s"}]}]}`)
		defer done()
		origin := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if u := r.Header.Get("X-Report"); u != "" {
				w.Header().Set("X-Used", u)
			}
			w.WriteHeader(http.StatusOK)
			return nil
		})
		serve := func(cost, report string) (*httptest.ResponseRecorder, time.Duration) {
			r := keyed(benchRequest("127.0.0.1"))
			r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).Set("wait.cost", cost)
			if report != "" {
				r.Header.Set("X-Report", report)
			}
			w := httptest.NewRecorder()
			began := time.Now()
			if err := h.ServeHTTP(w, r, origin); err != nil {
				t.Fatal(err)
			}
			return w, time.Since(began)
		}
		// 1 taken and 5 charged: the first limit lacks 6 of 2 (4 in debt),
		// the second 6 of 10, full again in 0.6 s.
		serve("1", "5")
		w, waited := serve("0", "0")
		field := w.Header().Get("RateLimit")
		t.Logf("the request of cost 0 waited %s; RateLimit %q", waited, field)
		if waited == 0 {
			t.Skip("a request of cost 0 did not wait")
		}
		tier := h.Tiers[0]
		b := &Bucket{Policy: h.Name, Tier: tier.Name, Keyer: "header/X-Key", Value: []byte("k"), secret: h.keySecret}
		out := make([]bucket.Result, 2)
		if _, err := h.store.take(context.Background(), b, tier.shape(), 0, out); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf(`"default-2";r=%d;t=%d`, out[1].Remaining, bucket.CeilDiv(out[1].ResetAfter, 1e6))
		if !strings.Contains(field, want) {
			t.Errorf("the second limit's item after the wait: RateLimit %q, want %s (the limit as it stands when the request goes on)", field, want)
		}
	})
}

// The same in every store mode, through Caddy, on the real clock: the
// request of cost 0 waits half a second for the first limit's debt; the
// second limit is full when it goes on (GET says so), and so says its item.
// Regression test for 596d67b.
func TestACostZeroWaiterAnswersTheOtherLimitFromWhenItGoesOnInEveryStoreMode(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			name := fmt.Sprint("wait_cost0_", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		headers ietf
		max_wait 3s
		tier api {
			limit 2 4/s
			limit 10 100/s
			cost {http.request.header.X-Cost}
			cost_from_response X-Used
		}
		%s
	}
	@report header X-Report 3
	header @report X-Used 3
	respond "ok"`, name, mode.store))
			s.from("127.0.0.2", "/", "X-Cost: 1", "X-Report: 3")
			began := time.Now()
			r := s.from("127.0.0.2", "/", "X-Cost: 0")
			waited := time.Since(began)
			var got adminQuotas
			getJSON(t, admin+"/rate_limit/buckets?policy="+name+"&tier=api&value=127.0.0.2", &got)
			field := r.header.Get("RateLimit")
			t.Logf("cost 0 waited %s: %d, RateLimit %q; GET limits %+v", waited, r.status, field, got.Limits)
			if waited < 200*time.Millisecond {
				t.Fatalf("the request of cost 0 did not wait")
			}
			rr, tt := rateLimitItem(t, field, "api-2")
			if rr != got.Limits[1].Remaining || tt != got.Limits[1].ResetAfter {
				t.Errorf("the second limit's item r=%d t=%d; when the request went on: %+v", rr, tt, got.Limits[1])
			}
		})
	}
}

// The RateLimit (IETF) field of a request that waited gives its reset (t,
// seconds until full) from when it goes on, not from before the wait. In
// a synctest bubble, so the wait of a second takes none.
// Regression test for 1fff550.
func TestTheRateLimitResetOfAWaitedRequestCountsFromWhenItGoesOn(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		h, done := provisionedHandlerOn(t, bubbleClocks, `{"name":"wait_ietf_reset","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":2000000000,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
		defer done()
		if _, err := serveOne(h, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
			t.Fatal(err)
		}
		// The second request waits 1 s for its token; when it goes on, the
		// bucket is full again 1 s later.
		start := time.Now()
		w, err := serveOne(h, keyed(benchRequest("127.0.0.1")), nopHandler)
		if err != nil {
			t.Fatal(err)
		}
		waited := time.Since(start)
		full := start.Add(2 * time.Second)
		got := w.Header().Get("RateLimit")
		want := fmt.Sprintf(`"default";r=0;t=%d`, int((time.Until(full)+time.Second-1)/time.Second))
		if waited < 900*time.Millisecond {
			t.Fatalf("the second request waited %v, want about 1 s", waited)
		}
		if got != want {
			t.Fatalf("after waiting %v, RateLimit: %s; want %s (the bucket is full %v after the response)", waited.Round(time.Millisecond), got, want, time.Until(full).Round(time.Millisecond))
		}
	})
}

// In Redis strict mode, once waiters hang up and give their tokens back,
// the deny cache lets the next request wait for them, as Redis would:
// capacity 1 at 1/s, max_wait 10 s, 11 fit and the 12th is refused; 5 of
// the 10 waiters hang up, and the next request waits.
// Regression test for 1fff550.
func TestTheDenyCacheLetsARequestWaitForTheTokensOfWaitersThatHungUp(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	// 1/s, capacity 1, max_wait 10s: 11 fit, the 12th is refused for 1 s.
	h, done := provisionedHandler(t, fmt.Sprintf(`{"name":"wait_hung_up_deny_cache","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":10000000000,"store":{"store":"redis","addresses":[%q],"timeout":2000000000},"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`, srv.addr()))
	defer done()
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	stay, leave := context.WithCancel(context.Background())
	gone, hangUp := context.WithCancel(context.Background())
	defer leave()
	defer hangUp()
	var wg sync.WaitGroup
	for i := range 10 {
		ctx := stay
		if i >= 5 {
			ctx = gone
		}
		wg.Go(func() {
			_ = h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")).WithContext(ctx), nopHandler)
		})
	}
	defer wg.Wait()
	for deadline := time.Now().Add(5 * time.Second); h.waiting.Load() != 10; {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting, want 10", h.waiting.Load())
		}
		time.Sleep(time.Millisecond)
	}
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err == nil {
		t.Fatal("the 12th request: allowed, want refused (it would wait 11 s)")
	}
	// 5 waiters hang up: 5 tokens back.
	hangUp()
	for h.waiting.Load() != 5 {
		time.Sleep(time.Millisecond)
	}
	// The next request would wait about 6 s: allowed, and waiting.
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	w := httptest.NewRecorder()
	go func() { errc <- h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")).WithContext(ctx), nopHandler) }()
	time.Sleep(200 * time.Millisecond)
	cancel()
	err := <-errc
	leave()
	if err != nil {
		t.Fatalf("after 5 waiters hung up and gave their tokens back, the next request: %v (Retry-After %q); want it to wait for them", err, w.Header().Get("Retry-After"))
	}
}
