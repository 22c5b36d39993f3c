package ratelimit

import (
	"context"
	"fmt"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// count_status, ban and cost_from_response with several limits (issue
// 25): the give-back returns to every limit, a ban empties every limit,
// the charge takes from every limit. In every store mode: local, Redis
// strict and Redis leases.

func TestCountStatusAndBanWithSeveralLimits(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, fmt.Sprintf(`rate_limit {
		name several_login_%d
		key header X-User
		limit 3 1/h
		limit 20 1/d
		count_status 401
		ban 1h
		%s
	}
	@wrong header X-Password wrong
	respond @wrong "wrong password" 401
	respond "welcome"`, i, mode.store))
			// Successes give back to both limits: 10 of them leave both full.
			countFailures(t, s)
			r := s.get("/", "X-User: ann", "X-Password: right")
			if after, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || after <= 3600 {
				t.Errorf("during the ban: %d, Retry-After %q; want 429, more than the ban's 3600 s", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}

func TestCostFromResponseWithSeveralLimits(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, fmt.Sprintf(`rate_limit {
		name several_llm_%d
		headers ietf
		key header X-Key
		tier llm {
			limit 100 1/s
			limit 1000 1/h
			cost_from_response X-Used
		}
		%s
	}
	header X-Used 40
	respond ok`, i, mode.store))
			s.get("/", "X-Key: k")
			// Charged 40 after the first request: the next sees 100-1-40-1
			// and 1000-1-40-1 left.
			want := `"llm";r=58;t=42, "llm-2";r=958;t=151200`
			got := s.get("/", "X-Key: k").header.Get("RateLimit")
			if strings.Contains(mode.name, "lease") {
				// With leases, a reset counts the tokens the node holds as
				// spent: it is when the shared bucket is full again.
				got, want = stripResets(got), stripResets(want)
			}
			if got != want {
				t.Errorf("after a charge of 40: RateLimit %q; want both limits charged, %q", got, want)
			}
		})
	}
}

// A client that hangs up while Redis decides is no store failure: no
// store error is counted, and the access log gets 499.
func TestClientGoneWhileTheStoreDecidesIsNoStoreError(t *testing.T) {
	srv := startRedis(t)
	h, done := provisionedHandler(t, fmt.Sprintf(`{"name":"gone_client","store":{"store":"redis","addresses":[%q]},"tiers":[{"name":"default","capacity":5,"refill":"1/s"}]}`, srv.url()))
	defer done()
	before := counterValue(t, storeErrorsTotal.WithLabelValues("redis"))
	r := benchRequest("127.0.0.1")
	ctx, cancel := context.WithCancel(r.Context())
	cancel()
	w := httptest.NewRecorder()
	if err := h.ServeHTTP(w, r.WithContext(ctx), nopHandler); err != nil || w.Code != 499 {
		t.Fatalf("a request whose client is gone: %d, %v; want 499", w.Code, err)
	}
	if n := counterValue(t, storeErrorsTotal.WithLabelValues("redis")) - before; n != 0 {
		t.Errorf("%v store errors counted for a client that went away", n)
	}
}

// stripResets drops the t= parameters of a RateLimit field.
func stripResets(field string) string {
	return regexp.MustCompile(`;t=\d+`).ReplaceAllString(field, "")
}
