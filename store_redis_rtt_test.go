package ratelimit

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/caddyserver/caddy/v2"
)

// The bounds on a round trip measured through a proxy that delays each
// direction by 20 ms: generous, for a loaded machine.
const rttOneWay = 20 * time.Millisecond

func checkRTTSeconds(t *testing.T, what string, seconds float64) {
	t.Helper()
	if seconds < 0.035 || seconds > 0.120 {
		t.Errorf("%s: %v s through a proxy delaying each way %s; want 0.035 to 0.120", what, seconds, rttOneWay)
	}
}

// waitForScript waits until the Redis server holds the bucket script, so
// that a test's first requests do not race the store's cold start.
func waitForScript(t *testing.T, srv *redisServer) {
	t.Helper()
	waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
		v, _ := srv.do("SCRIPT", "EXISTS", redisbucket.ScriptHash()).([]any)
		return len(v) == 1 && v[0] == int64(1)
	})
}

// storeRTTOf is the field store_rtt_seconds of the policy in GET
// /rate_limit/policies; false when the field is left out.
func storeRTTOf(t *testing.T, admin, policy string) (float64, bool) {
	t.Helper()
	var views []map[string]any
	getJSON(t, admin+"/rate_limit/policies", &views)
	for _, v := range views {
		if v["policy"] == policy {
			rtt, ok := v["store_rtt_seconds"].(float64)
			return rtt, ok
		}
	}
	t.Fatalf("policy %s not in %v", policy, views)
	return 0, false
}

// A Redis store behind a proxy that delays each direction by 20 ms
// measures a round trip of about 40 ms, which the gauge
// caddy_http_rate_limit_store_rtt_seconds and the policy's
// store_rtt_seconds show; neither shows one before the first answer.
func TestStoreRoundTripIsShownInMetricsAndPolicies(t *testing.T) {
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), rttOneWay)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 1000 1/s {
		name rtt_shown
		store redis {
			address redis://%s
			timeout 2s
		}
	}
	respond "ok"`, proxy.addr()))
	waitForScript(t, srv)
	if rtt, shown := storeRTTOf(t, admin, "rtt_shown"); shown {
		t.Errorf("store_rtt_seconds %v before any request, want it left out", rtt)
	}
	if line := grepLines(scrape(t, admin), `store_rtt_seconds{policy="rtt_shown"`); line != "" {
		t.Errorf("a round trip before any request: %s", line)
	}
	before := scrape(t, admin)
	for i := range 15 {
		if r := s.from("127.0.0."+strconv.Itoa(10+i), "/"); r.status != 200 {
			t.Fatalf("request %d: %d %s", i, r.status, r.body)
		}
	}
	after := scrape(t, admin)
	checkRTTSeconds(t, "the gauge", metricValue(t, after, "caddy_http_rate_limit_store_rtt_seconds", `policy="rtt_shown",store="redis"`))
	// Each decision waited a round trip in the store, and the store
	// duration histogram timed it (other tests' Redis stores may add theirs).
	const duration = "caddy_http_rate_limit_store_duration_seconds"
	if n := metricOr0(t, after, duration+"_count", `store="redis"`) - metricOr0(t, before, duration+"_count", `store="redis"`); n < 15 {
		t.Errorf("%v Redis decisions timed, want at least the 15 sent", n)
	}
	if sum := metricOr0(t, after, duration+"_sum", `store="redis"`) - metricOr0(t, before, duration+"_sum", `store="redis"`); sum < 15*2*rttOneWay.Seconds()*0.9 {
		t.Errorf("the Redis decisions took %.3f s in all by the histogram, want at least 15 round trips of %v", sum, 2*rttOneWay)
	}
	rtt, shown := storeRTTOf(t, admin, "rtt_shown")
	if !shown {
		t.Fatal("no store_rtt_seconds after 15 requests")
	}
	checkRTTSeconds(t, "store_rtt_seconds", rtt)
}

// roundTripLines is the lines of the log file that warn of a setting under
// the measured round trip, decoded.
func roundTripLines(t *testing.T, logFile string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	var found []map[string]any
	for _, line := range strings.Split(string(data), "\n") {
		if !strings.Contains(line, "measured round trip") {
			continue
		}
		var entry map[string]any
		if err := json.Unmarshal([]byte(line), &entry); err != nil {
			t.Fatalf("%v: %s", err, line)
		}
		found = append(found, entry)
	}
	return found
}

// With leases, lease_ttl 100ms against a round trip of about 40 ms (under
// 4 of them) is warned of in the policy's log, at warn, naming the
// setting, its value and the round trip: once however many requests
// follow, and once again after a reload, whose store measures afresh.
func TestLeaseTTLUnderFourRoundTripsIsWarnedOfOnceAConfig(t *testing.T) {
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), rttOneWay)
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	port := freePort(t)
	caddyfile := func(body string) string {
		return fmt.Sprintf(`{
	admin off
	log {
		output file %s
		format json
	}
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
	rate_limit 100 10/s {
		name rtt_warned
		store redis {
			address redis://%s
			timeout 2s
			lease 10
			lease_ttl 100ms
		}
	}
	respond %q
}`, logFile, port, proxy.addr(), body)
	}
	s := serveCaddyfile(t, port, caddyfile("one"))
	waitForScript(t, srv)
	client := 0
	// Each request of a new client is one lease call: one sample.
	requestUntil := func(want int) {
		t.Helper()
		for range 100 {
			if len(roundTripLines(t, logFile)) >= want {
				return
			}
			client++
			s.get("/", "X-Forwarded-For: 10.0."+strconv.Itoa(client/250)+"."+strconv.Itoa(client%250))
		}
		t.Fatalf("100 requests, and %d round-trip warnings, want %d", len(roundTripLines(t, logFile)), want)
	}
	requestUntil(1)
	for range 20 {
		client++
		s.get("/", "X-Forwarded-For: 10.1.0."+strconv.Itoa(client%250))
	}
	lines := roundTripLines(t, logFile)
	if len(lines) != 1 {
		t.Fatalf("%d round-trip warnings, want 1: %v", len(lines), lines)
	}
	w := lines[0]
	if w["level"] != "warn" || w["setting"] != "lease_ttl" || w["lease_ttl"] != "100ms" || w["logger"] != "http.handlers.rate_limit" {
		t.Errorf("the warning %v; want level warn, setting lease_ttl, lease_ttl 100ms, in the policy's log", w)
	}
	// zap writes a duration in a JSON log as seconds.
	rtt, _ := w["round_trip"].(float64)
	checkRTTSeconds(t, "the warning's round_trip", rtt)

	cfg, err := adaptCaddyfile(caddyfile("two"))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	requestUntil(2)
	if lines := roundTripLines(t, logFile); len(lines) != 2 || lines[1]["setting"] != "lease_ttl" {
		t.Errorf("after the reload: %v; want a second lease_ttl warning", lines)
	}
}
