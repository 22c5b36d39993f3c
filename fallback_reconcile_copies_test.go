package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// TestAnAdminResetForgivesWhatEveryCopyOfThePolicyOwes: a site on two
// ports has a copy of its rate_limit in each server, each counting what
// its fallback admits during a cut. An admin DELETE of the bucket forgives
// what the client owes on this node, whichever copy admitted it.
func TestAnAdminResetForgivesWhatEveryCopyOfThePolicyOwes(t *testing.T) {
	useFakeClock(t)
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	s, admin := serveOnTwoPorts(t, "reconcile_copies", `rate_limit 10 1/h {
		name %s
		store redis {
			address redis://`+proxy.Addr()+`
			timeout 100ms
			breaker_cooldown 50ms
		}
		on_store_error local reconcile
	}`)
	const client, prober = "127.0.0.90", "127.0.0.91"

	proxy.Cut()
	for i := range 3 {
		if r := s.from(client, "/"); r.status != http.StatusOK {
			t.Fatalf("cut off, request %d: %d; want 200 from the fallback", i+1, r.status)
		}
	}
	// Redis is cut off: its layer fails (502), this node's are reset.
	if status, body := adminDo(t, http.MethodDelete, admin+"/rate_limit/buckets?policy=reconcile_copies&value="+client); !strings.Contains(body, `"local_fallback"`) {
		t.Fatalf("DELETE during the cut: %d %s; want the local fallback reset", status, body)
	}
	proxy.Restore()

	// Once the store answers, the copy charges what it still counts.
	url := admin + "/rate_limit/buckets?policy=reconcile_copies&value=" + client
	var got struct {
		Remaining int64 `json:"remaining"`
	}
	waitFor(t, 5*time.Second, "a request to reach Redis", func() bool {
		return s.from(prober, "/").header.Get("X-RateLimit-Remaining") == "9"
	})
	for _, h := range runningHandlers()["reconcile_copies"] {
		h.owed.wait()
	}
	if getJSON(t, url, &got); got.Remaining != 10 {
		t.Fatalf("the shared bucket once the store answers: %d left; want 10: the admin reset forgave the 3 requests the fallback admitted", got.Remaining)
	}
}

// TestAnAdminResetRefillsTheFallbackOfEveryCopyOfThePolicy: each copy of a
// policy on two ports decides with on_store_error local while Redis is cut
// off. A client that emptied its bucket in the copy that is not the newest
// is let through again once an admin DELETE (which finds the policy by its
// newest copy) reset it.
func TestAnAdminResetRefillsTheFallbackOfEveryCopyOfThePolicy(t *testing.T) {
	useFakeClock(t)
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	s, admin := serveOnTwoPorts(t, "fallback_copies", `rate_limit 3 1/h {
		name %s
		store redis {
			address redis://`+proxy.Addr()+`
			timeout 100ms
			breaker_cooldown 1h
		}
		on_store_error local
	}`)
	const client = "127.0.0.92"
	proxy.Cut()
	for i := range 3 {
		if r := s.from(client, "/"); r.status != http.StatusOK {
			t.Fatalf("cut off, request %d: %d; want 200 from the fallback", i+1, r.status)
		}
	}
	if r := s.from(client, "/"); r.status != http.StatusTooManyRequests {
		t.Fatalf("cut off, request 4: %d; want 429, the fallback's bucket of 3 empty", r.status)
	}
	if status, body := adminDo(t, http.MethodDelete, admin+"/rate_limit/buckets?policy=fallback_copies&value="+client); !strings.Contains(body, `"local_fallback"`) {
		t.Fatalf("DELETE during the cut: %d %s; want the local fallback reset", status, body)
	}
	if r := s.from(client, "/"); r.status != http.StatusOK {
		t.Fatalf("cut off, after the admin reset: %d; want 200, the copy's fallback refilled", r.status)
	}
}

// TestAnAdminResetEndsTheLeaseHoldOffOfEveryCopyOfThePolicy: with leases,
// a copy whose lease call was refused holds off, refusing from memory,
// until the bucket would have a lease again. An admin DELETE (which finds
// the policy by its newest copy) refills the shared bucket, and the copy
// that is not the newest lets the client through again at once.
func TestAnAdminResetEndsTheLeaseHoldOffOfEveryCopyOfThePolicy(t *testing.T) {
	useFakeClock(t)
	srv := startRedis(t)
	s, admin := serveOnTwoPorts(t, "lease_copies", `rate_limit 4 1/h {
		name %s
		store redis {
			address `+srv.URL()+`
			lease 2
		}
	}`)
	const client = "127.0.0.93"
	for i := range 4 {
		if r := s.from(client, "/"); r.status != http.StatusOK {
			t.Fatalf("request %d: %d; want 200 from two leases of 2", i+1, r.status)
		}
	}
	if r := s.from(client, "/"); r.status != http.StatusTooManyRequests {
		t.Fatalf("request 5: %d; want 429, the shared bucket of 4 leased out", r.status)
	}
	if status, body := adminDo(t, http.MethodDelete, admin+"/rate_limit/buckets?policy=lease_copies&value="+client); status != http.StatusOK {
		t.Fatalf("DELETE: %d %s", status, body)
	}
	if r := s.from(client, "/"); r.status != http.StatusOK {
		t.Fatalf("after the admin reset: %d; want 200, the shared bucket refilled", r.status)
	}
}

// serveOnTwoPorts serves a site on two ports whose rate_limit, named
// policy, is block (a %s in it for the name), on a node with an admin API.
// The server it returns talks to the copy that is not the newest, the one
// the admin API does not find the policy by; admin is the API's base URL.
func serveOnTwoPorts(t *testing.T, policy, block string) (s *testServer, admin string) {
	t.Helper()
	portA, portB, adminPort := freePort(t), freePort(t), freePort(t)
	admin = "http://127.0.0.1:" + strconv.Itoa(adminPort)
	s = serveCaddyfile(t, portA, fmt.Sprintf(`{
	admin 127.0.0.1:%d
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d, http://127.0.0.1:%d {
	%s
	respond "ok"
}`, adminPort, portA, portB, fmt.Sprintf(block, policy)))
	newest := latestHandler(policy)
	if n := len(runningHandlers()[policy]); n != 2 || newest == nil {
		t.Fatalf("%d running handlers of the policy; want 2, one a server", n)
	}
	older := portA
	if strings.Contains(newest.where, ":"+strconv.Itoa(portA)) {
		older = portB
	}
	s.base = "http://127.0.0.1:" + strconv.Itoa(older)
	return s, admin
}
