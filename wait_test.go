package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	dto "github.com/prometheus/client_model/go"
)

// max_wait's settings, placeholder, metric and listing.

func TestMaxWaitCaddyfile(t *testing.T) {
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
	useFakeClock(t)
	h, done := provisionedHandler(t, `{"name":"waited","max_wait":1000000000,"tiers":[{"name":"default","limits":[{"capacity":1,"refill":"100/s"},{"capacity":1,"refill":"20/s"}]}]}`)
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
	useFakeClock(t)
	dry, done := provisionedHandler(t, `{"name":"dry_wait","dry_run":true,"max_wait":10000000000,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
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

	h, done2 := provisionedHandler(t, `{"name":"one_waiter","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":10000000000,"max_waiting":1,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
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
	useFakeClock(t)
	h, done := provisionedHandler(t, `{"name":"waited_items","headers":"ietf","max_wait":2000000000,"tiers":[{"name":"default","limits":[{"capacity":1,"refill":"1/s"},{"capacity":10,"refill":"1/s"}]}]}`)
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
