package ratelimit

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// A site on two ports is served by two servers, each with a copy of its
// rate_limit: one policy, whose round trip is measured once, shown once
// and warned of once.

// copiesCaddyfile is a site on two ports whose rate_limit, policy
// rtt_copies, uses Redis through addr with the settings given, logging
// to logFile, with the admin API on adminPort.
func copiesCaddyfile(adminPort int, logFile string, portA, portB int, addr, settings string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	log {
		output file %s
		format json
	}
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d, http://127.0.0.1:%d {
	rate_limit 1000 1/s {
		name rtt_copies
		store redis {
			address redis://%s
			%s
		}
	}
	respond "ok"
}`, adminPort, logFile, portA, portB, addr, settings)
}

// TestARoundTripMeasuredByOneCopyOfAPolicyIsShownAndWarnedOfOnce sends
// requests to the copy of the policy that is not the newest one: the gauge
// and store_rtt_seconds show its round trip, and the timeout under two
// round trips is warned of once, however many copies see it.
func TestARoundTripMeasuredByOneCopyOfAPolicyIsShownAndWarnedOfOnce(t *testing.T) {
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), rttOneWay)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	portA, portB := freePort(t), freePort(t)
	adminPort := freePort(t)
	admin := "http://127.0.0.1:" + strconv.Itoa(adminPort)
	// A timeout of 60ms is under two round trips of about 40 ms.
	s := serveCaddyfile(t, portA, copiesCaddyfile(adminPort, logFile, portA, portB, proxy.addr(), "timeout 60ms"))
	waitForScript(t, srv)
	newest := latestHandler("rtt_copies")
	if n := len(runningHandlers()["rtt_copies"]); n != 2 || newest == nil {
		t.Fatalf("%d running handlers of the policy; want 2, one a server", n)
	}
	// The requests go to the port the newest copy does not serve.
	older, other := portA, portB
	if strings.Contains(newest.where, ":"+strconv.Itoa(portA)) {
		older, other = portB, portA
	}
	s.base = "http://127.0.0.1:" + strconv.Itoa(older)
	for i := range 40 {
		if r := s.from("127.0.0."+strconv.Itoa(10+i), "/"); r.status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	if _, shown := storeRTTOf(t, admin, "rtt_copies"); !shown {
		t.Error("store_rtt_seconds left out after 40 requests to one copy of the policy")
	}
	if line := grepLines(scrape(t, admin), `store_rtt_seconds{policy="rtt_copies"`); line == "" {
		t.Error("no caddy_http_rate_limit_store_rtt_seconds for the policy after 40 requests to one copy of it")
	}
	timeouts := func() int {
		n := 0
		for _, l := range roundTripLines(t, logFile) {
			if l["setting"] == "timeout" {
				n++
			}
		}
		return n
	}
	// The warning waits for 20 answered calls: on a loaded machine some
	// calls outlast the 60 ms timeout and are not measured, so more
	// requests go until it comes.
	for i := 0; timeouts() == 0 && i < 400; i++ {
		if r := s.from("127.0.2."+strconv.Itoa(i%200+10), "/"); r.status != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	// The other copy sees the same round trip.
	s.base = "http://127.0.0.1:" + strconv.Itoa(other)
	for i := range 40 {
		if r := s.from("127.0.1."+strconv.Itoa(10+i), "/"); r.status != http.StatusOK {
			t.Fatalf("request %d to the other copy: %d %s", i, r.status, r.body)
		}
	}
	if timeouts := timeouts(); timeouts != 1 {
		t.Errorf("%d warnings of the timeout under two round trips for the policy; want 1", timeouts)
	}
}
