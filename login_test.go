package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	dto "github.com/prometheus/client_model/go"
)

// loginDirectives is a login form's limit: wrong passwords get 401 from a
// matcher, right ones 200.
const loginDirectives = `
	rate_limit 3 1/h {
		key header X-User
		%s
	}
	@wrong header X-Password wrong
	respond @wrong "wrong password" 401
	respond "welcome"`

// storeMode is a store block to test a feature in, by name.
type storeMode struct{ name, store string }

// storeModes are the local store, Redis strict and Redis with leases, on
// srv.
func storeModes(srv *redisServer) []storeMode {
	return []storeMode{
		{"local", ""},
		{"redis", "store redis {\n address " + srv.url() + "\n timeout 2s\n }"},
		{"redis lease 50%", "store redis {\n address " + srv.url() + "\n timeout 2s\n lease 50%\n }"},
	}
}

// In every store mode: successes cost nothing, failures spend the bucket,
// and the ban that ends them holds even the right password off.
func TestCountStatusAndBanInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			s := serve(t, fmt.Sprintf(loginDirectives, "count_status 401\n ban 1h\n "+tt.store))
			countFailures(t, s)
			r := s.get("/", "X-User: ann", "X-Password: right")
			if after, _ := strconv.Atoi(r.header.Get("Retry-After")); r.status != 429 || after <= 3600 {
				t.Errorf("during the ban: %d, Retry-After %q; want 429 and more than the ban's 3600 s", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}

func TestCountStatusLimitsFailedAttemptsOnly(t *testing.T) {
	useFakeClock(t)
	s := serve(t, fmt.Sprintf(loginDirectives, "count_status 401"))
	countFailures(t, s)
}

// countFailures checks a loginDirectives site with count_status 401.
func countFailures(t *testing.T, s *testServer) {
	t.Helper()
	right, wrong := []string{"X-User: ann", "X-Password: right"}, []string{"X-User: ann", "X-Password: wrong"}
	for i := range 10 {
		if r := s.get("/", right...); r.status != 200 {
			t.Fatalf("right password %d: %d, want 200: successes are given back", i+1, r.status)
		}
	}
	for i := range 3 {
		if r := s.get("/", wrong...); r.status != 401 {
			t.Fatalf("wrong password %d: %d, want 401", i+1, r.status)
		}
	}
	if r := s.get("/", wrong...); r.status != 429 {
		t.Fatalf("fourth wrong password: %d, want 429", r.status)
	}
	// The point: a user who has spent the bucket is refused even with the
	// right password, so the password cannot be found by trying.
	if r := s.get("/", right...); r.status != 429 {
		t.Fatalf("right password after three wrong: %d, want 429", r.status)
	}
	if r := s.get("/", "X-User: bob", "X-Password: wrong"); r.status != 401 {
		t.Fatalf("another user: %d, want 401 from a bucket of its own", r.status)
	}
}

// The status that counts is the one the client gets: an error from a later
// handler counts with its code, 500 when it has none.
func TestCountStatusSeesErrorsOfLaterHandlers(t *testing.T) {
	for _, tt := range []struct {
		name, counts, handler string
		wantStatus            int
		counted               bool
	}{
		{"error 403 counted by code", "403", `error "forbidden" 403`, 403, true},
		{"error 403 counted by class", "4xx", `error "forbidden" 403`, 403, true},
		{"error without a code is a 500", "4xx", `error "boom"`, 500, false},
		{"error 500 counted by class", "5xx", `error "boom" 500`, 500, true},
		{"a 200 not counted", "4xx", `respond "ok"`, 200, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, fmt.Sprintf(`
	rate_limit 2 1/h {
		count_status %s
	}
	%s`, tt.counts, tt.handler))
			got := make([]int, 4)
			for i := range got {
				got[i] = s.from("127.0.0.2", "/").status
			}
			want := []int{tt.wantStatus, tt.wantStatus, tt.wantStatus, tt.wantStatus}
			if tt.counted {
				want[2], want[3] = 429, 429
			}
			if fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("statuses %v, want %v", got, want)
			}
		})
	}
}

// Tokens are taken before the request goes on: concurrent wrong attempts
// never get more than the capacity through before their give-backs.
func TestConcurrentFailedAttemptsNeverOverrunTheBucket(t *testing.T) {
	useFakeClock(t)
	s := serve(t, fmt.Sprintf(loginDirectives, "count_status 401"))
	var unauthorized, limited, other atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 60 {
		wg.Go(func() {
			<-start
			switch s.get("/", "X-User: carol", "X-Password: wrong").status {
			case 401:
				unauthorized.Add(1)
			case 429:
				limited.Add(1)
			default:
				other.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if unauthorized.Load() != 3 || limited.Load() != 57 || other.Load() != 0 {
		t.Errorf("60 concurrent wrong attempts: %d reached the form, %d limited, %d other; want 3, 57, 0", unauthorized.Load(), limited.Load(), other.Load())
	}
}

func TestBanHoldsADeniedClientOff(t *testing.T) {
	clock := useFakeClock(t)
	s := serve(t, `
	rate_limit 2 1/s {
		ban 1h
	}
	respond "ok"`)
	for range 2 {
		s.from("127.0.0.2", "/")
	}
	r := s.from("127.0.0.2", "/")
	if r.status != 429 || r.header.Get("Retry-After") != "3601" {
		t.Fatalf("the banning denial: %d, Retry-After %q; want 429 and 3601 (the ban, then a token)", r.status, r.header.Get("Retry-After"))
	}
	var m dto.Metric
	if err := bansTotal.WithLabelValues("default", "default").Write(&m); err != nil || m.GetCounter().GetValue() < 1 {
		got := m.GetCounter().GetValue()
		t.Errorf("bans_total{default,default} = %v after a ban, want at least 1", got)
	}
	clock.advance(10 * time.Minute)
	if r := s.from("127.0.0.2", "/"); r.status != 429 || r.header.Get("Retry-After") != "3001" {
		t.Fatalf("10 minutes into the ban: %d, Retry-After %q; want 429 and 3001: a denial does not extend the ban", r.status, r.header.Get("Retry-After"))
	}
	if r := s.from("127.0.0.3", "/"); r.status != 200 {
		t.Fatalf("another client: %d, want 200", r.status)
	}
	clock.advance(50*time.Minute + time.Second)
	if r := s.from("127.0.0.2", "/"); r.status != 200 {
		t.Fatalf("after the ban and a second's refill: %d, want 200", r.status)
	}
	if r := s.from("127.0.0.2", "/"); r.status != 429 {
		t.Fatalf("a second request at once: %d, want 429: the bucket refills from empty", r.status)
	}
}

func TestLoginSettingsMistakes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ line, want string }{
		{"count_status", "count_status: want one or more"},
		{"count_status 401 6xx", `count_status "6xx"`},
		{"count_status 42", `count_status "42"`},
		{"ban 0s", "ban"},
		{"ban -1m", "ban"},
		{"ban soon", "ban"},
		{"ban 1m\n ban 2m", "ban: given twice"},
	} {
		_, err := adaptSite("rate_limit 10 1/s {\n " + tt.line + "\n }")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.line, err, tt.want)
		}
	}
}

// Two Caddy processes on one redis-server: successes given back on either
// node leave the shared bucket whole; failures on both spend it; the ban
// that one node starts holds on the other.
func TestTwoCaddyProcessesShareGiveBacksAndBans(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process (two Caddy processes, one Redis)")
	srv := startRedis(t)
	var ports [2]int
	for i := range ports {
		ports[i] = freePort(t)
		startCaddyProcess(t, ports[i], fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	handle /ready {
		respond "ready"
	}
	rate_limit 3 1/h {
		name login
		key header X-User
		count_status 401
		ban 1h
		store redis {
			address %s
			timeout 2s
		}
	}
	@wrong header X-Password wrong
	respond @wrong "wrong password" 401
	respond "welcome"
}
`, ports[i], srv.url()))
	}
	client := &http.Client{Timeout: 10 * time.Second}
	attempt := func(node int, password string) *http.Response {
		req, _ := http.NewRequest("GET", "http://127.0.0.1:"+strconv.Itoa(ports[node])+"/", nil)
		req.Header.Set("X-User", "dave")
		req.Header.Set("X-Password", password)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}
	for i := range 8 {
		if r := attempt(i%2, "right"); r.StatusCode != 200 {
			t.Fatalf("right password %d on node %d: %d, want 200", i+1, i%2, r.StatusCode)
		}
	}
	for i := range 3 {
		if r := attempt(i%2, "wrong"); r.StatusCode != 401 {
			t.Fatalf("wrong password %d on node %d: %d, want 401", i+1, i%2, r.StatusCode)
		}
	}
	r := attempt(1, "wrong")
	// The ban's hour, then an hour to refill one attempt at 1/h.
	if r.StatusCode != 429 || r.Header.Get("Retry-After") != "7200" {
		t.Fatalf("fourth wrong password on node 1: %d, Retry-After %q; want 429 and 7200", r.StatusCode, r.Header.Get("Retry-After"))
	}
	if r := attempt(0, "right"); r.StatusCode != 429 {
		t.Fatalf("right password on node 0 during the ban node 1 started: %d, want 429", r.StatusCode)
	}
}

// A client that hangs up mid-stream makes reverse_proxy panic with
// http.ErrAbortHandler once the headers are out. The steps after the
// response still run, and the panic goes on to net/http: count_status
// gives back the tokens of a response that does not count, and
// cost_from_response charges what the origin reported.
func TestAfterResponseStepsRunWhenTheStreamAborts(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name, tier, extra string
		remaining         string
	}{
		{"count_status gives back", `"capacity":3,"refill":"1/h"`, `,"count_status":["401"]`, "2"},
		{"cost_from_response charges", `"capacity":100,"refill":"1/s","cost_from_response":"X-Tokens-Used"`, "", "38"},
		{"both", `"capacity":100,"refill":"1/s","cost_from_response":"X-Tokens-Used"`, `,"count_status":["401"]`, "39"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, done := provisionedHandlerOn(t, newFakeClock().clocks(), `{"name":"abort `+tt.name+`","tiers":[{"name":"default",`+tt.tier+`}]`+tt.extra+`}`)
			defer done()
			aborting := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
				w.Header().Set("X-Tokens-Used", "60")
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte("part of the ans"))
				panic(http.ErrAbortHandler)
			})
			func() {
				defer func() {
					if v := recover(); v != http.ErrAbortHandler {
						t.Errorf("recovered %v, want the handler's own http.ErrAbortHandler to go on", v)
					}
				}()
				_ = h.ServeHTTP(httptest.NewRecorder(), benchRequest("127.0.0.2"), aborting)
			}()
			w := httptest.NewRecorder()
			if err := h.ServeHTTP(w, benchRequest("127.0.0.2"), nopHandler); err != nil {
				t.Fatal(err)
			}
			if got := w.Header().Get("X-RateLimit-Remaining"); got != tt.remaining {
				t.Errorf("after the aborted response: remaining %s, want %s", got, tt.remaining)
			}
		})
	}
}

// givebackCounter is a local store that counts the give-backs it is asked
// for, by the tokens they return.
type givebackCounter struct{ *LocalStore }

var givebacks = struct {
	sync.Mutex
	byTokens map[int64]int
}{byTokens: map[int64]int{}}

func (*givebackCounter) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.rate_limit.stores.test_giveback_counter", New: func() caddy.Module { return &givebackCounter{new(LocalStore)} }}
}

func (s *givebackCounter) giveBack(ctx context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error {
	givebacks.Lock()
	givebacks.byTokens[n]++
	givebacks.Unlock()
	return s.LocalStore.giveBack(ctx, b, tr, limitsN, n, at)
}

func init() { caddy.RegisterModule(new(givebackCounter)) }

// A request whose placeholder cost is 0 took nothing, so an uncounted
// response has nothing to give back: the store is not asked to, since a
// give-back is never free (a Redis call, and a write to a banned or
// indebted bucket).
func TestZeroCostGivesNothingBack(t *testing.T) {
	useFakeClock(t)
	h, done := provisionedHandler(t, `{"name":"zero giveback","count_status":["401"],"store":{"store":"test_giveback_counter"},
		"tiers":[{"name":"default","capacity":5,"refill":"1/h","cost_placeholder":"{test.cost}"}]}`)
	defer done()
	givebacks.Lock()
	clear(givebacks.byTokens)
	givebacks.Unlock()
	for _, cost := range []string{"0", "2", "0"} {
		r := benchRequest("127.0.0.2")
		r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).Set("test.cost", cost)
		if err := h.ServeHTTP(httptest.NewRecorder(), r, nopHandler); err != nil {
			t.Fatalf("cost %s: %v", cost, err)
		}
	}
	givebacks.Lock()
	defer givebacks.Unlock()
	if fmt.Sprint(givebacks.byTokens) != "map[2:1]" {
		t.Errorf("give-backs by tokens: %v, want one of 2 and none of 0", givebacks.byTokens)
	}
}

// The login recipe's ban on a username holds through a flood of wrong
// attempts on other usernames, ten times the local store's max_keys.
// Regression test: a flood of distinct keys could lift a ban.
func TestABanOnAUsernameHoldsThroughAFloodOfOtherUsernames(t *testing.T) {
	clock := useFakeClock(t)
	const maxKeys = 50
	s := serve(t, fmt.Sprintf(`
	rate_limit 3 1/h {
		key form username normalize
		no_key deny
		count_status 401
		ban 15m
		store local {
			max_keys %d
		}
	}
	@wrong header X-Password wrong
	respond @wrong "wrong password" 401
	respond "welcome"`, maxKeys))
	attempt := func(user, password string) int {
		return s.do(http.MethodPost, "/", "username="+user, "Content-Type: application/x-www-form-urlencoded", "X-Password: "+password).status
	}
	for i := range 3 {
		if got := attempt("alice", "wrong"); got != 401 {
			t.Fatalf("wrong password %d for alice: %d, want 401", i+1, got)
		}
	}
	if got := attempt("alice", "wrong"); got != 429 {
		t.Fatalf("the fourth wrong password for alice: %d, want 429, starting the ban", got)
	}
	for i := range 10 * maxKeys {
		if got := attempt("decoy"+strconv.Itoa(i), "wrong"); got != 401 {
			t.Fatalf("a wrong password for decoy %d: %d, want 401", i, got)
		}
	}
	clock.advance(time.Minute)
	if got := attempt("alice", "right"); got != 429 {
		t.Fatalf("alice's right password after a flood of %d other usernames: %d, want 429: the ban holds", 10*maxKeys, got)
	}
	clock.advance(14*time.Minute + time.Hour)
	if got := attempt("alice", "right"); got != 200 {
		t.Fatalf("alice's right password after the ban and an hour's refill: %d, want 200", got)
	}
}
