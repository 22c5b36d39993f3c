package ratelimit

import (
	"context"
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
)

// Review 27b (f9ca558): a waiter's headers and its give-back, when its
// wait crosses a quota's period boundary. These run in a synctest bubble:
// the waits' timers, the decision's start (time.Now) and the local store's
// clocks are all the bubble's fake time, so a wait of hours takes none.
// The bubble's clock starts at 2000-01-01 00:00 UTC.

// r27bBubbleClocks makes the local tables read the bubble's clock, for
// the test's duration; call it in the bubble, before provisioning.
func r27bBubbleClocks(t *testing.T) {
	old, oldWall := localClock, localWallClock
	localClock = func() int64 { return time.Now().UnixMicro() }
	localWallClock = localClock
	t.Cleanup(func() { localClock, localWallClock = old, oldWall })
}

// r27bOrigin answers with the status the request's X-Status asks for.
var r27bOrigin = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	if r.Header.Get("X-Status") == "401" {
		w.WriteHeader(http.StatusUnauthorized)
		return nil
	}
	w.WriteHeader(http.StatusOK)
	return nil
})

func r27bServe(t *testing.T, h *Handler, status string) *httptest.ResponseRecorder {
	r := keyed(benchRequest("127.0.0.1"))
	if status != "" {
		r.Header.Set("X-Status", status)
	}
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, r, r27bOrigin); err != nil {
		t.Errorf("ServeHTTP: %v", err)
	}
	return w
}

// r27bQuotaPeek reads the tier's quotas as they stand now.
func r27bQuotaPeek(t *testing.T, h *Handler) []bucket.Result {
	tier := h.Tiers[len(h.Tiers)-1]
	b := &Bucket{Policy: h.Name, Tier: tier.Name, Keyer: "header/X-Key", Value: []byte("k"), secret: h.keySecret}
	out := make([]bucket.Result, len(tier.limits)+len(tier.quotas))
	if err := h.store.peek(context.Background(), b, tier.shape(), out); err != nil {
		t.Fatal(err)
	}
	return out[len(tier.limits):]
}

// Claim 1: a request that waits across midnight (an ordinary one-minute
// max_wait, 30 s before midnight) goes on in a new day. Its quota item
// must speak of the quota as it stands then: the new day's count, and the
// seconds to the next midnight. It said the old day's count, with t=0:
// "full now", yet fewer left than the quota.
func TestReview27bQuotaItemOfAWaitAcrossMidnight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r27bBubbleClocks(t)
		time.Sleep(23*time.Hour + 59*time.Minute + 30*time.Second) // 23:59:30
		h, done := provisionedHandler(t, `{"name":"r27b_item","keys":[{"keyer":"header","field":"X-Key"}],"headers":"both","max_wait":120000000000,
			"tiers":[{"name":"default","capacity":1,"refill":"1/m","quotas":["10/day"]}]}`)
		defer done()
		r27bServe(t, h, "")
		start := time.Now()
		w := r27bServe(t, h, "") // waits a minute: goes on at 00:00:30
		if waited := time.Since(start); waited != time.Minute {
			t.Fatalf("the second request waited %s, want 1m", waited)
		}
		q := r27bQuotaPeek(t, h)[0]
		want := fmt.Sprintf(`"default-day";r=%d;t=%d`, q.Remaining, bucket.CeilDiv(q.ResetAfter, 1e6))
		got := w.Header().Get("RateLimit")
		t.Logf("at %s: RateLimit %q, RateLimit-Policy %q; the quota as it stands: %+v", time.Now().UTC().Format(time.TimeOnly), got, w.Header().Get("RateLimit-Policy"), q)
		if !strings.Contains(got, want) {
			t.Errorf("the waiter's quota item: RateLimit %q, want %s (the new day's quota, as it stands when the request goes on)", got, want)
		}
	})
}

// Claim 2: with a long max_wait (10 h, valid for a limit of 1 token every
// 2 h), a request that waits past midnight by more than an hour and is
// given back (count_status) must refund the day that counted it, and no
// other. CountedAt named start+max(wait, left)-1h: with the wait more
// than an hour past midnight, that was in the new day, whose count it
// lowered; the new day then admitted one request more than its quota.
// The give-back names the decision's moment now (d.start stays put).
func TestReview27bGiveBackOfALongWaitAcrossMidnight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r27bBubbleClocks(t)
		time.Sleep(23*time.Hour + 50*time.Minute) // 23:50 on 1 January
		h, done := provisionedHandler(t, `{"name":"r27b_giveback","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","count_status":["200"],"max_wait":36000000000000,
			"tiers":[{"name":"default","capacity":2,"refill":"1/2h","quotas":["10/day"]}]}`)
		defer done()
		// Two requests at 23:50 take both tokens, counted on 1 January.
		r27bServe(t, h, "")
		r27bServe(t, h, "")
		var wg sync.WaitGroup
		// B, at 23:50, counted on 1 January, waits 2 h for a token and
		// goes on at 01:50 on 2 January; the origin says 401, which does
		// not count: its token goes back, and so does 1 January's count.
		wg.Go(func() { r27bServe(t, h, "401") })
		time.Sleep(20 * time.Minute)
		// C, at 00:10 on 2 January, is counted there (it waits too).
		wg.Go(func() { r27bServe(t, h, "") })
		time.Sleep(time.Second)
		if q := r27bQuotaPeek(t, h)[0]; q.Remaining != 9 {
			t.Fatalf("2 January after C: %+v, want 9 left", q)
		}
		wg.Wait()
		q := r27bQuotaPeek(t, h)[0]
		t.Logf("at %s, 2 January's quota: %+v", time.Now().UTC().Format(time.DateTime), q)
		if q.Remaining != 9 {
			t.Errorf("B's give-back (counted on 1 January) refunded 2 January: %d left there, want 9 (C was counted there, B was not)", q.Remaining)
		}
	})
}

// Claim 2, the shorter case for comparison: a wait past midnight by less
// than an hour refunds nothing of the new day (CountedAt lands before
// midnight).
func TestReview27bGiveBackOfAShortWaitAcrossMidnight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r27bBubbleClocks(t)
		time.Sleep(23*time.Hour + 59*time.Minute) // 23:59
		h, done := provisionedHandler(t, `{"name":"r27b_giveback_short","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","count_status":["200"],"max_wait":600000000000,
			"tiers":[{"name":"default","capacity":2,"refill":"1/2m","quotas":["10/day"]}]}`)
		defer done()
		r27bServe(t, h, "")
		r27bServe(t, h, "")
		var wg sync.WaitGroup
		wg.Go(func() { r27bServe(t, h, "401") }) // goes on at 00:01
		time.Sleep(90 * time.Second)
		wg.Go(func() { r27bServe(t, h, "") }) // 00:00:30, counted on 2 January
		wg.Wait()
		if q := r27bQuotaPeek(t, h)[0]; q.Remaining != 9 {
			t.Errorf("2 January's quota: %+v, want 9 left", q)
		}
	})
}

// r27bItem reads one RateLimit item's r and t by its name.
func r27bItem(t *testing.T, field, name string) (r, tt int64) {
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

type r27bAdmin struct {
	adminBucket
	Quotas []struct {
		Left       int64 `json:"left"`
		ResetAfter int64 `json:"reset_after"`
		Reset      int64 `json:"reset"`
	} `json:"quotas"`
}

// Claim 1 in every store mode: a request of a tier of two limits and a
// quota that waits (max_wait) answers each RateLimit item, and the X-
// fields, as the bucket stands when it goes on: what admin GET reads right
// after it (the limits refill too slowly for the ms between to matter).
func TestReview27bWaiterItemsMatchTheBucketInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			name := fmt.Sprint("r27b_items_", i)
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
			var got r27bAdmin
			if status := getJSON(t, admin+"/rate_limit/buckets?policy="+name+"&tier=api&value=127.0.0.2", &got); status != 200 {
				t.Fatalf("GET: %d", status)
			}
			field := r.header.Get("RateLimit")
			t.Logf("RateLimit %q, X-RateLimit-Remaining %q, X-RateLimit-Reset %q; GET %+v", field, r.header.Get("X-RateLimit-Remaining"), r.header.Get("X-RateLimit-Reset"), got)
			near := func(a, b int64) bool { return a-b <= 1 && b-a <= 1 }
			for j, item := range []string{"api", "api-2"} {
				rr, tt := r27bItem(t, field, item)
				if rr != got.Limits[j].Remaining || !near(tt, got.Limits[j].ResetAfter) || tt < 0 {
					t.Errorf("limit %d: item r=%d t=%d; the bucket when it went on: %+v", j+1, rr, tt, got.Limits[j])
				}
			}
			rr, tt := r27bItem(t, field, "api-day")
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

// Claim 1, a request of cost 0 (a cost placeholder) on a tier whose first
// limit is in debt (cost_from_response) waits that debt out; goTogether
// left a cost of 0 alone, so the other limit's item kept the level it
// had at the decision, while its reset was cut by the wait: when it went
// on, that limit was full (t=0) but its item said 4 left of 10.
func TestReview27bCostZeroWaiterItems(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		r27bBubbleClocks(t)
		time.Sleep(12 * time.Hour)
		h, done := provisionedHandler(t, `{"name":"r27b_cost0","keys":[{"keyer":"header","field":"X-Key"}],"headers":"ietf","max_wait":10000000000,
			"tiers":[{"name":"default","cost_placeholder":"{r27b.cost}","cost_from_response":"X-Used","limits":[{"capacity":2,"refill":"1/s"},{"capacity":10,"refill":"10/s"}]}]}`)
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
			r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).Set("r27b.cost", cost)
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
// second limit is full when it goes on (GET says so), and its item must
// say so, not what it had at the decision.
func TestReview27bCostZeroWaiterItemsInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			name := fmt.Sprint("r27b_cost0_", i)
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
			var got r27bAdmin
			getJSON(t, admin+"/rate_limit/buckets?policy="+name+"&tier=api&value=127.0.0.2", &got)
			field := r.header.Get("RateLimit")
			t.Logf("cost 0 waited %s: %d, RateLimit %q; GET limits %+v", waited, r.status, field, got.Limits)
			if waited < 200*time.Millisecond {
				t.Fatalf("the request of cost 0 did not wait")
			}
			rr, tt := r27bItem(t, field, "api-2")
			if rr != got.Limits[1].Remaining || tt != got.Limits[1].ResetAfter {
				t.Errorf("the second limit's item r=%d t=%d; when the request went on: %+v", rr, tt, got.Limits[1])
			}
		})
	}
}
