package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// scrape reads Caddy's /metrics from the admin API.
func scrape(t *testing.T, admin string) string {
	t.Helper()
	resp, err := http.Get(admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /metrics: %d %v", resp.StatusCode, err)
	}
	return string(body)
}

// metricValue finds one sample: the metric's name and its labels in
// Prometheus' text order (sorted by name).
func metricValue(t *testing.T, metrics, name, labels string) float64 {
	t.Helper()
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name+"{"+labels+"}") + ` (\S+)$`)
	m := re.FindStringSubmatch(metrics)
	if m == nil {
		t.Fatalf("no sample %s{%s} in:\n%s", name, labels, grepLines(metrics, "rate_limit"))
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// metricOr0 is metricValue, or 0 when metrics holds no such sample.
func metricOr0(t *testing.T, metrics, name, labels string) float64 {
	t.Helper()
	if !strings.Contains(metrics, name+"{"+labels+"} ") {
		return 0
	}
	return metricValue(t, metrics, name, labels)
}

func grepLines(s, substr string) string {
	var out []string
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, substr) {
			out = append(out, line)
		}
	}
	return strings.Join(out, "\n")
}

var metricsRuns atomic.Int64

func TestMetricsCountDecisionsAcrossAReload(t *testing.T) {
	useFakeClock(t)
	// The counters live as long as the process, so each run of this test
	// (go test -count) has a policy of its own.
	policy := fmt.Sprintf("metered%d", metricsRuns.Add(1))
	site := `
	rate_limit 3 1/h {
		name ` + policy + `
		key header X-API-Key
	}
	respond "%s"`
	s, admin := serveWithAdmin(t, fmt.Sprintf(site, "one"))
	for range 5 {
		s.get("/", "X-API-Key: sk-live-0123456789")
	}
	m := scrape(t, admin)
	if got := metricValue(t, m, "caddy_http_rate_limit_requests_total", `decision="allowed",policy="`+policy+`",tier="default"`); got != 3 {
		t.Errorf("allowed %v, want 3", got)
	}
	if got := metricValue(t, m, "caddy_http_rate_limit_requests_total", `decision="denied",policy="`+policy+`",tier="default"`); got != 2 {
		t.Errorf("denied %v, want 2", got)
	}
	if got := metricValue(t, m, "caddy_http_rate_limit_keys", `policy="`+policy+`"`); got != 1 {
		t.Errorf("keys %v, want 1", got)
	}
	// The local store decides in memory, far below the histogram's lowest
	// bucket: its decisions are not timed (a clock read each).
	if line := grepLines(m, `store_duration_seconds_count{store="local"}`); line != "" {
		t.Errorf("the local store's decisions timed: %s", line)
	}

	// Reload: the same admin address, a changed site.
	cfg, err := adaptCaddyfile(fmt.Sprintf("{\n\tadmin %s\n}\nhttp://127.0.0.1:%d {\n%s\n}\n", strings.TrimPrefix(admin, "http://"), s.port, fmt.Sprintf(site, "two")))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		s.get("/", "X-API-Key: sk-live-0123456789")
	}
	s.get("/", "X-API-Key: sk-live-other")
	m = scrape(t, admin)
	if got := metricValue(t, m, "caddy_http_rate_limit_requests_total", `decision="denied",policy="`+policy+`",tier="default"`); got != 4 {
		t.Errorf("denied after the reload %v, want 4: the count went on", got)
	}
	if got := metricValue(t, m, "caddy_http_rate_limit_requests_total", `decision="allowed",policy="`+policy+`",tier="default"`); got != 4 {
		t.Errorf("allowed after the reload %v, want 4", got)
	}
	for _, secret := range []string{"sk-live", "0123456789", "127.0.0.1"} {
		if line := grepLines(grepLines(m, "rate_limit"), secret); line != "" {
			t.Errorf("a metric carries the client key %q:\n%s", secret, line)
		}
	}
}

// adminCall sends a request to the admin API and decodes a bucket state.
func adminCall(t *testing.T, method, url string) (int, bucketState, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var st bucketState
	if resp.StatusCode == 200 {
		if err := json.Unmarshal(body, &st); err != nil {
			t.Fatalf("%s %s: %v in %s", method, url, err, body)
		}
	}
	return resp.StatusCode, st, string(body)
}

func TestAdminDeleteUnblocksAClient(t *testing.T) {
	useFakeClock(t)
	s, admin := serveWithAdmin(t, `
	rate_limit 2 1/h {
		name adm
		key header X-API-Key
		tier partners 3 1/h {
			keyer header
		}
	}
	respond "ok"`)
	s.from("127.0.0.2", "/")
	s.from("127.0.0.2", "/")
	if r := s.from("127.0.0.2", "/"); r.status != 429 {
		t.Fatalf("third request: %d, want 429", r.status)
	}
	url := admin + "/rate_limit/buckets?policy=adm&value=127.0.0.2"
	code, st, body := adminCall(t, "GET", url)
	if code != 200 || st.Remaining != 0 || st.Capacity != 2 || st.Tier != "default" || st.ResetAfter != 7200 {
		t.Fatalf("GET: %d %s; want 0 remaining of 2 on default, full in 7200 s", code, body)
	}
	if strings.Contains(body, "127.0.0.2") {
		t.Errorf("the admin API echoed the client's address: %s", body)
	}
	if code, st, body := adminCall(t, "DELETE", url); code != 200 || !st.Deleted || st.Remaining != 2 {
		t.Fatalf("DELETE: %d %s; want a full bucket", code, body)
	}
	if r := s.from("127.0.0.2", "/"); r.status != 200 {
		t.Fatalf("after DELETE: %d, want 200 at once", r.status)
	}

	// A header-keyed client on another tier.
	s.get("/", "X-API-Key: partner-1")
	code, st, body = adminCall(t, "GET", admin+"/rate_limit/buckets?policy=adm&tier=partners&keyer=header&value=partner-1")
	if code != 200 || st.Remaining != 2 || st.Capacity != 3 {
		t.Fatalf("GET partner: %d %s; want 2 remaining of 3", code, body)
	}

	for _, tt := range []struct {
		query, want string
		code        int
	}{
		{"policy=nope&value=127.0.0.2", `policy \"nope\"`, 404},
		{"policy=adm&tier=gold&value=127.0.0.2", `tier \"gold\"`, 404},
		{"policy=adm&keyer=cookie&value=x", `keyer \"cookie\"`, 404},
		{"policy=adm", "value: required", 400},
		{"policy=adm&value=not-an-ip", `not an IP address`, 400},
	} {
		code, _, body := adminCall(t, "GET", admin+"/rate_limit/buckets?"+tt.query)
		if code != tt.code || !strings.Contains(body, tt.want) {
			t.Errorf("GET ?%s: %d %s; want %d mentioning %s", tt.query, code, body, tt.code, tt.want)
		}
	}
}

func TestPlaceholdersInAccessLogsAndHeaders(t *testing.T) {
	useFakeClock(t)
	logFile := filepath.Join(t.TempDir(), "access.log")
	s := serve(t, fmt.Sprintf(`
	log {
		output file %s
		format json
	}
	log_append rl_decision {http.rate_limit.decision}
	log_append rl_tier {http.rate_limit.tier}
	log_append rl_remaining {http.rate_limit.remaining}
	log_append rl_key {http.rate_limit.key_id}
	header >X-RL-Decision {http.rate_limit.decision}
	rate_limit 1 1/h {
		name logged
	}
	respond "ok"`, logFile))
	if r := s.from("127.0.0.2", "/"); r.header.Get("X-RL-Decision") != "allowed" {
		t.Errorf("header directive saw decision %q, want allowed", r.header.Get("X-RL-Decision"))
	}
	s.from("127.0.0.2", "/")

	var lines []map[string]any
	deadline := time.Now().Add(5 * time.Second)
	for len(lines) < 2 && time.Now().Before(deadline) {
		lines = lines[:0]
		data, _ := os.ReadFile(logFile)
		for _, l := range strings.Split(strings.TrimSpace(string(data)), "\n") {
			var m map[string]any
			if json.Unmarshal([]byte(l), &m) == nil {
				lines = append(lines, m)
			}
		}
		time.Sleep(20 * time.Millisecond) // the access log is written after the response
	}
	if len(lines) < 2 {
		t.Fatalf("access log has %d lines, want 2", len(lines))
	}
	want := []string{"allowed", "denied"}
	for i, l := range lines[:2] {
		if l["rl_decision"] != want[i] || l["rl_tier"] != "default" {
			t.Errorf("log line %d: decision %v tier %v, want %s on default", i+1, l["rl_decision"], l["rl_tier"], want[i])
		}
		if key, _ := l["rl_key"].(string); len(key) != 16 {
			t.Errorf("log line %d: key_id %q, want a 16-digit fingerprint", i+1, key)
		}
	}
	if lines[0]["rl_remaining"] != float64(0) && lines[0]["rl_remaining"] != "0" {
		t.Errorf("remaining %v, want 0", lines[0]["rl_remaining"])
	}
}

// storeTimed is how many decisions store_duration_seconds has timed for
// store in the metrics m: 0 when it shows none.
func storeTimed(t *testing.T, m, store string) float64 {
	t.Helper()
	return metricOr0(t, m, "caddy_http_rate_limit_store_duration_seconds_count", `store="`+store+`"`)
}

// Every decision of a Redis store is timed by store_duration_seconds, one
// sample each: strict (allowed, refused by Redis, refused by the deny
// cache), leased (from memory and by a call), and decided by
// on_store_error once Redis is gone; no decision of a local store is, in
// the same config beside them or after a reload moves a policy from Redis
// to the local store.
func TestEveryRedisDecisionIsTimedAndNoLocalOne(t *testing.T) {
	srv := startRedis(t)
	run := metricsRuns.Add(1)
	site := func(strictStore string) string {
		return fmt.Sprintf(`
	route /strict {
		rate_limit 2 1/h {
			name timed_strict%[1]d
			%[2]s
		}
		respond "ok"
	}
	route /leased {
		rate_limit 100 1/h {
			name timed_leased%[1]d
			store redis {
				address %[3]s
				timeout 500ms
				lease 10
			}
			on_store_error allow
		}
		respond "ok"
	}
	route /local {
		rate_limit 2 1/h {
			name timed_local%[1]d
		}
		respond "ok"
	}`, run, strictStore, srv.url())
	}
	strictOnRedis := fmt.Sprintf("store redis {\n address %s\n timeout 500ms\n }\n on_store_error local", srv.url())
	s, admin := serveWithAdmin(t, site(strictOnRedis))
	waitForScript(t, srv)
	send := func(path string, n int, ip ...string) (statuses []int) {
		client := append(ip, "127.0.0.9")[0]
		for range n {
			statuses = append(statuses, s.from(client, path).status)
		}
		return statuses
	}
	scripts := func() int64 {
		calls := srv.info("commandstats", "cmdstat_evalsha")
		n, _ := strconv.ParseInt(strings.TrimPrefix(strings.Split(calls, ",")[0], "calls="), 10, 64)
		return n
	}

	before, calls := scrape(t, admin), scripts()
	strict, leased, local := send("/strict", 6), send("/leased", 14), send("/local", 5)
	after := scrape(t, admin)
	t.Logf("strict %v, leased %v, local %v; %d script calls", strict, leased, local, scripts()-calls)
	if !slices.Equal(strict, []int{200, 200, 429, 429, 429, 429}) || slices.ContainsFunc(leased, func(c int) bool { return c != 200 }) {
		t.Fatalf("strict %v, leased %v: not the decisions the test counts on", strict, leased)
	}
	if n := scripts() - calls; n >= 6+14 {
		t.Fatalf("%d script calls for 20 Redis decisions: neither the deny cache nor the lease answered any", n)
	}
	if got := storeTimed(t, after, "redis") - storeTimed(t, before, "redis"); got != 6+14 {
		t.Errorf("%v Redis decisions timed, want the 20 made (6 strict, 14 leased)", got)
	}
	if got := storeTimed(t, after, "local"); got != 0 {
		t.Errorf("%v local decisions timed, want none", got)
	}

	// Redis gone: on_store_error decides, after the failed call, which
	// is timed; the client refused before is refused by the deny cache.
	srv.kill()
	before = after
	strict, leased, local = send("/strict", 4, "127.0.0.10"), send("/leased", 20), send("/local", 2)
	denied := send("/strict", 2)
	after = scrape(t, admin)
	t.Logf("Redis down: strict %v (a client denied before: %v), leased %v, local %v", strict, denied, leased, local)
	if !slices.Equal(strict, []int{200, 200, 429, 429}) || !slices.Equal(denied, []int{429, 429}) {
		t.Fatalf("strict %v, denied %v: not the fallback's decisions the test counts on", strict, denied)
	}
	if got := storeTimed(t, after, "redis") - storeTimed(t, before, "redis"); got != 4+2+20 {
		t.Errorf("%v Redis decisions timed with Redis down, want the 26 made", got)
	}
	if got := metricValue(t, after, "caddy_http_rate_limit_store_errors_total", `store="redis"`) - metricOr0(t, before, "caddy_http_rate_limit_store_errors_total", `store="redis"`); got < 4 {
		t.Errorf("%v store errors with Redis down, want on_store_error to decide the strict ones at least", got)
	}
	if got := storeTimed(t, after, "local"); got != 0 {
		t.Errorf("%v local decisions timed with Redis down, want none (the fallback's included)", got)
	}

	// A reload moves the strict policy to the local store: its decisions
	// are no longer timed.
	cfg, err := adaptCaddyfile(siteCaddyfile("admin "+strings.TrimPrefix(admin, "http://"), s.port, site("store local")))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	before = scrape(t, admin)
	strict, local = send("/strict", 3), send("/local", 1)
	after = scrape(t, admin)
	if !slices.Equal(strict, []int{200, 200, 429}) || !slices.Equal(local, []int{429}) {
		t.Errorf("after the reload: strict %v, want a fresh local bucket of 2; local %v, want its spent bucket kept", strict, local)
	}
	if got := storeTimed(t, after, "redis") - storeTimed(t, before, "redis"); got != 0 {
		t.Errorf("%v Redis decisions timed after the reload, with only local ones made", got)
	}
	if got := storeTimed(t, after, "local"); got != 0 {
		t.Errorf("%v local decisions timed after the reload, want none", got)
	}
}
