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
	portA, portB, adminPort := freePort(t), freePort(t), freePort(t)
	admin := "http://127.0.0.1:" + strconv.Itoa(adminPort)
	s := serveCaddyfile(t, portA, fmt.Sprintf(`{
	admin 127.0.0.1:%d
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d, http://127.0.0.1:%d {
	rate_limit 10 1/h {
		name reconcile_copies
		store redis {
			address redis://%s
			timeout 100ms
			breaker_cooldown 50ms
		}
		on_store_error local reconcile
	}
	respond "ok"
}`, adminPort, portA, portB, proxy.Addr()))
	// The client goes to the copy that is not the newest, which the admin
	// API finds the policy by.
	newest := latestHandler("reconcile_copies")
	if n := len(runningHandlers()["reconcile_copies"]); n != 2 || newest == nil {
		t.Fatalf("%d running handlers of the policy; want 2, one a server", n)
	}
	older := portA
	if strings.Contains(newest.where, ":"+strconv.Itoa(portA)) {
		older = portB
	}
	s.base = "http://127.0.0.1:" + strconv.Itoa(older)
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
