package ratelimit

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"github.com/caddyserver/caddy/v2"
)

// Regression tests for the guarantees that review found broken: a
// give-back never lifts a ban or forgives a debt, never creates tokens
// under an older limit, a request of cost 0 waits out a ban or a debt, and
// leases never admit more than one bucket.

const second = int64(1_000_000)

// The README's login setup, in every store mode: a right password admitted
// before the ban and answered after it (a 200, which does not count) gives
// its token back into a banned bucket, which keeps the ban; the next wrong
// password is refused. The give-back used to end the ban, and a fourth
// wrong password reached the origin 0.4 s into a one-hour ban.
func TestSlowRightPasswordDoesNotLiftTheBan(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			release := make(chan struct{})
			arrived := make(chan struct{}, 1)
			origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("X-Password") != "right" {
					w.WriteHeader(http.StatusUnauthorized)
					return
				}
				arrived <- struct{}{}
				<-release
				w.WriteHeader(http.StatusOK)
			}))
			defer origin.Close()
			s := serve(t, fmt.Sprintf(`rate_limit 10 1/h {
				key header X-User
				count_status 401
				ban 1h
				%s
			}
			reverse_proxy %s`, tt.store, strings.TrimPrefix(origin.URL, "http://")))
			right, wrong := []string{"X-User: ann", "X-Password: right"}, []string{"X-User: ann", "X-Password: wrong"}
			done := make(chan response, 1)
			go func() { done <- s.get("/", right...) }()
			<-arrived
			for i := range 9 {
				if r := s.get("/", wrong...); r.status != 401 {
					t.Fatalf("wrong password %d: %d, want 401", i+1, r.status)
				}
			}
			if r := s.get("/", wrong...); r.status != 429 {
				t.Fatalf("the wrong password that bans: %d, want 429", r.status)
			}
			close(release)
			if r := <-done; r.status != 200 {
				t.Fatalf("the right password: %d, want 200", r.status)
			}
			if r := s.get("/", wrong...); r.status != 429 {
				t.Fatalf("a wrong password after the right one came back: %d, want 429: the ban holds", r.status)
			}
		})
	}
}

// A tier that goes from one limit to several keeps its first limit's
// bucket in Redis: the key does not move, so a reload refills no client.
func TestRedisBucketKeepsItsKeyAcrossLimitCounts(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second)})
	b := bucketFor("switch")
	l := slowLimit(10)
	for range 4 {
		if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed {
			t.Fatalf("take: %+v, %v", res, err)
		}
	}
	out := make([]bucket.Result, 2)
	allowed, err := s.take(bg, b, bucket.Tier{Limits: []bucket.Limit{l, slowLimit(100)}}, 1, out)
	if err != nil || !allowed {
		t.Fatalf("take on two limits: %v, %v", allowed, err)
	}
	if out[0].Remaining != 5 || out[1].Remaining != 99 {
		t.Fatalf("after a reload to two limits: %+v, want 5 left of the first (it kept its 4) and 99 of the new", out)
	}
	res, err := takeLimit(bg, s, b, l, 1)
	if err != nil || res.Remaining != 4 {
		t.Fatalf("back to one limit: %+v, %v; want 4 left", res, err)
	}
}

// A count_status give-back that reaches a node after a reload closed its
// lease table goes to the shared bucket instead of being lost.
func TestGiveBackAfterAReloadReachesTheSharedBucket(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second), Lease: "20%"})
	l := slowLimit(100)
	b := bucketFor("reloaded")
	for range 10 {
		if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed {
			t.Fatalf("take: %+v, %v", res, err)
		}
	}
	s.engine.Close() // the reload: what is held goes back
	level := func() int64 {
		res, err := peekLimit(bg, s, b, l)
		if err != nil {
			t.Fatal(err)
		}
		return res.Remaining
	}
	before := level()
	if err := s.giveBack(bg, b, bucket.Tier{Limits: []bucket.Limit{l}}, 1, 1, 0); err != nil {
		t.Fatal(err)
	}
	if after := level(); after != before+1 {
		t.Fatalf("the shared bucket holds %d after a give-back through a closed table, want %d", after, before+1)
	}
}

// A request admitted under one config and answered after a reload gives
// its tokens back as the running config counts them: `rate_limit 10 1/h`
// becomes `rate_limit 1000 100/h`, and the right password (a 200, which
// does not count) gives back one token, not the 100 that an hour of the
// old refill is worth under the new one.
func TestGiveBackAfterAReloadCountsInTheRunningLimit(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			release := make(chan struct{})
			var released sync.Once
			free := func() { released.Do(func() { close(release) }) }
			defer free() // so that Caddy can stop when the test fails early
			arrived := make(chan struct{}, 1)
			origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.Header.Get("X-Password") != "right" {
					w.WriteHeader(http.StatusUnauthorized)
					return
				}
				arrived <- struct{}{}
				<-release
			}))
			defer origin.Close()
			port := freePort(t)
			site := func(limit string) string {
				return fmt.Sprintf(`{
	admin off
	skip_install_trust
}
http://127.0.0.1:%d {
	rate_limit %s {
		name reload
		key header X-User
		count_status 401
		%s
	}
	reverse_proxy %s
}
`, port, limit, tt.store, strings.TrimPrefix(origin.URL, "http://"))
			}
			s := serveCaddyfile(t, port, site("10 1/h"))
			// A connection of its own for the held request, and none kept
			// across the reload for the others.
			held := *s
			held.client = &http.Client{Timeout: time.Minute}
			s.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
			done := make(chan response, 1)
			go func() { done <- held.get("/", "X-User: ann", "X-Password: right") }()
			<-arrived
			cfg, err := adaptCaddyfile(site("1000 100/h"))
			if err != nil {
				t.Fatal(err)
			}
			// The reload returns once the old server has drained, which
			// waits for the request held at the origin.
			loaded := make(chan error, 1)
			go func() { loaded <- caddy.Load(cfg, true) }()
			var last response
			waitFor(t, 10*time.Second, "the new config", func() bool {
				// A connection that meets the old server as it closes
				// fails; the next one reaches the new.
				req, _ := http.NewRequest(http.MethodGet, s.base+"/", nil)
				req.Header.Set("X-User", "probe")
				resp, err := s.client.Do(req)
				if err != nil {
					return false
				}
				resp.Body.Close()
				return resp.Header.Get("X-RateLimit-Limit") == "1000"
			})
			// The old config's token is an hour of refill: 100 under the
			// new one. 100 failures leave 800. (Per hour, so that Redis's
			// real clock refills nothing to speak of meanwhile.)
			for range 100 {
				if last = s.get("/", "X-User: ann", "X-Password: wrong"); last.status != 401 {
					t.Fatalf("a wrong password under the new config: %d", last.status)
				}
			}
			if got := last.header.Get("X-RateLimit-Remaining"); got != "800" {
				t.Fatalf("after the reload and 100 failures: %s left, want 800", got)
			}
			free()
			if r := <-done; r.status != 200 {
				t.Fatalf("the right password: %d", r.status)
			}
			if err := <-loaded; err != nil {
				t.Fatal(err)
			}
			// With leases the header is this node's view, which may lag;
			// it must still show no token created.
			got, _ := strconv.Atoi(s.get("/", "X-User: ann", "X-Password: wrong").header.Get("X-RateLimit-Remaining"))
			if got > 800 || got != 800 && !strings.Contains(tt.store, "lease") {
				t.Errorf("after the old config's request gave its token back and one more failure: %d left, want 800 (801 - 1)", got)
			}
		})
	}
}
