package ratelimit

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
	"github.com/caddyserver/caddy/v2"
)

// serveLoggingTo is serve with Caddy's default log going to a file at
// INFO, whose path it returns.
func serveLoggingTo(t *testing.T, directives string) (*testServer, string) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "caddy.log")
	return serveWithGlobals(t, fmt.Sprintf("admin off\n\tlog {\n\t\toutput file %s\n\t\tlevel INFO\n\t}", file), directives), file
}

// TestStoreDownUnderAFloodLogsAFewLinesAndNoKey sends 200 requests with
// an API key to a policy whose Redis is down, with on_store_error deny:
// each gets its 503, and the log, at INFO, holds a few sampled lines about
// it, none with the key. With handle_errors, the 503 is still the user's
// to shape.
// Regression test for issue 32 item 6.
func TestStoreDownUnderAFloodLogsAFewLinesAndNoKey(t *testing.T) {
	dead := freePort(t) // nothing listens here
	for _, c := range []struct {
		name, errors, body string
	}{
		{"plain", "", ""},
		{"handle_errors", `handle_errors 503 {
	respond "store down, retry in {http.response.header.Retry-After}s" 503
}`, "store down, retry in 1s"},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, file := serveLoggingTo(t, fmt.Sprintf(`
	rate_limit 100 10/s {
		key header X-Api-Key
		store redis {
			address redis://127.0.0.1:%d
		}
		on_store_error deny
	}
	respond "ok"
	%s`, dead, c.errors))
			for i := range 200 {
				r := s.get("/", "X-Api-Key: k3")
				if r.status != 503 || r.header.Get("Retry-After") != "1" || c.body != "" && r.body != c.body {
					t.Fatalf("request %d with Redis down: %d %q, Retry-After %q; want 503 %q, Retry-After 1", i, r.status, r.body, r.header.Get("Retry-After"), c.body)
				}
			}
			log, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			var about []string
			for line := range strings.SplitSeq(strings.TrimSpace(string(log)), "\n") {
				if strings.Contains(line, "k3") {
					t.Fatalf("a log line holds the client's key: %s", line)
				}
				// Without its time, which may hold "503" too.
				text := logTime.ReplaceAllString(line, "")
				if strings.Contains(text, "503") || strings.Contains(text, "store") || strings.Contains(text, "redis") || strings.Contains(text, `"error"`) {
					about = append(about, line)
				}
			}
			if len(about) > 10 {
				t.Fatalf("%d log lines about 200 refusals with Redis down, want a few; the first:\n%s", len(about), strings.Join(about[:3], "\n"))
			}
		})
	}
}

// logTime is a JSON log line's time field.
var logTime = regexp.MustCompile(`"ts":[0-9.e+]+,?`)

// TestOnStoreErrorLocalAdmitsOneCapacityPlusRefillPerOutage measures what
// on_store_error local lets one client through one node while Redis is
// down, on the local buckets' fake clock: its fallback bucket starts full,
// whatever Redis held, so an outage of T lets through capacity + rate x T
// more, on top of what Redis admitted just before. docs/fleet.md states
// this bound and names this test.
// Regression test for issue 31 item 11.
func TestOnStoreErrorLocalAdmitsOneCapacityPlusRefillPerOutage(t *testing.T) {
	const capacity, perSecond, outage = 10, 5, 2 * time.Second
	srv := startRedis(t)
	clock := useFakeClock(t)
	s := serveOnRedisWith(t, srv, fmt.Sprintf(`
	rate_limit %d %d/s {
		name outage_bound
		store redis {
			address %s
		}
		on_store_error local
	}
	respond "ok"`, capacity, perSecond, srv.url()))
	burst := func() (admitted int) {
		for range 2 * capacity {
			if s.from("127.0.4.1", "/").status != 200 {
				return admitted
			}
			admitted++
		}
		return admitted
	}
	if got := burst(); got != capacity {
		t.Fatalf("Redis admitted %d of a burst, want the capacity %d", got, capacity)
	}
	srv.kill()
	// The deny cache refuses the client until Redis's retry time, by the
	// real clock, without asking Redis: past it, the fallback decides.
	time.Sleep(time.Second/perSecond + 100*time.Millisecond)
	fallback := 0
	const step = 100 * time.Millisecond
	for at := time.Duration(0); ; at += step {
		fallback += burst()
		if at == outage {
			break
		}
		clock.advance(step)
	}
	bound := capacity + int(perSecond*outage/time.Second)
	if fallback != bound {
		t.Fatalf("the fallback admitted %d over a %s outage, want capacity + rate x outage = %d", fallback, outage, bound)
	}
	fleet, err := os.ReadFile("docs/fleet.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(fleet), "TestOnStoreErrorLocalAdmitsOneCapacityPlusRefillPerOutage") {
		t.Fatalf("docs/fleet.md does not state the bound this test measures (%d admitted by Redis, then %d by the fallback, where one bucket allows %d over the window)", capacity, fallback, bound)
	}
}

// dry_run "decides, counts, sets headers and placeholders, but never
// rejects" (docs/caddyfile.md), for trying a policy on live traffic: with
// on_store_error deny beside it, a dead Redis must not turn the dry run
// into 503s, for the tokens or for the slots of concurrency.
func TestADryRunIsNotRefusedWhenTheStoreFailsWithOnStoreErrorDeny(t *testing.T) {
	dead := freePort(t) // nothing listens here
	for _, tier := range []string{"limit 100 10/s", "concurrency 5"} {
		t.Run(tier, func(t *testing.T) {
			s := serve(t, fmt.Sprintf(`rate_limit {
		%s
		store redis {
			address redis://127.0.0.1:%d
		}
		on_store_error deny
		dry_run
	}
	respond "{http.rate_limit.decision}"`, tier, dead))
			if r := s.get("/"); r.status != 200 {
				t.Errorf("a dry run with Redis down and on_store_error deny: %d %q, Retry-After %q; want 200, let through", r.status, r.body, r.header.Get("Retry-After"))
			}
		})
	}
}

// A reload keeps every bucket of a policy on the local store, whatever its
// name: one named as the on_store_error local fallback of another policy
// would be ("api/on_store_error" beside "api") shares nothing with that
// fallback, which each config load empties.
func TestAReloadKeepsTheBucketsOfAPolicyNamedLikeAnotherPolicysFallback(t *testing.T) {
	dead := freePort(t) // nothing listens here
	port := freePort(t)
	caddyfile := fmt.Sprintf(`{
	admin off
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
	handle /a {
		rate_limit 5 1/h {
			name api
			store redis {
				address redis://127.0.0.1:%d
				timeout 100ms
			}
			on_store_error local
		}
		respond "a"
	}
	handle /b {
		rate_limit 1 1/h {
			name api/on_store_error
		}
		respond "b"
	}
}
`, port, dead)
	s := serveCaddyfile(t, port, caddyfile)
	if got := s.from("127.0.5.1", "/b").status; got != 200 {
		t.Fatalf("the first request: %d, want 200", got)
	}
	if got := s.from("127.0.5.1", "/b").status; got != 429 {
		t.Fatalf("the second request of a capacity of 1: %d, want 429", got)
	}
	cfg, err := adaptCaddyfile(caddyfile)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	if got := s.from("127.0.5.1", "/b").status; got != 429 {
		t.Fatalf("after a reload, the next request: %d, want 429: the reload emptied the policy's buckets", got)
	}
}

// The on_store_error local fallback of a Redis store that nothing answers
// keeps a ban through a flood of distinct clients ten times its table's
// bound, as the local store does (docs/logins.md), and the bound holds.
func TestABanInTheLocalFallbackHoldsThroughAFloodOfDistinctClients(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	h := deadRedisHandler(t, clock, "fallback-ban-flood", `"on_store_error": "local", "ban": "15m"`,
		`[{"name": "t", "capacity": 3, "refill": "1/h"}]`)
	// The fallback's table has the default bound; one of a small bound,
	// on the handler's clocks, makes the flood short.
	const maxKeys = 50
	h.local.buckets = localbucket.New(localOptions(maxKeys, clock.clocks()))
	status := func(ip string) int {
		w, _ := serveOne(h, benchRequest(ip), nopHandler)
		return w.Code
	}
	for i := range 3 {
		if got := status("192.0.2.7"); got != http.StatusOK {
			t.Fatalf("request %d with Redis down: %d, want 200 from the fallback", i+1, got)
		}
	}
	if got := status("192.0.2.7"); got != http.StatusTooManyRequests {
		t.Fatalf("the fourth request: %d, want 429, starting the ban", got)
	}
	for i := range 10 * maxKeys {
		ip := fmt.Sprintf("10.0.%d.%d", i/250, 1+i%250)
		if got := status(ip); got != http.StatusOK {
			t.Fatalf("flood client %s: %d, want 200", ip, got)
		}
		if n := h.local.buckets.Len(); n > maxKeys {
			t.Fatalf("after %d flood clients the fallback holds %d buckets, want at most %d", i+1, n, maxKeys)
		}
	}
	if h.local.buckets.Evictions() == 0 {
		t.Fatalf("the flood evicted nothing: it did not fill the fallback's table")
	}
	clock.advance(time.Minute)
	if got := status("192.0.2.7"); got != http.StatusTooManyRequests {
		t.Fatalf("the banned client after a flood of %d others: %d, want 429: the ban holds", 10*maxKeys, got)
	}
	clock.advance(14*time.Minute + time.Hour)
	if got := status("192.0.2.7"); got != http.StatusOK {
		t.Fatalf("after the ban and an hour's refill: %d, want 200", got)
	}
}

// Through a real Caddy config on a real redis-server, with a ban and
// max_wait: the refusal that starts the ban, and those after it, which a
// leasing node's table refuses without a lease call, send the same
// Retry-After and reset headers as strict mode (to the second): the ban's
// retry, when a request would go on within max_wait once it is over, not
// when the bucket holds the cost again.
func TestALeasedBanWithMaxWaitSendsStrictModesHeaders(t *testing.T) {
	srv := startRedis(t)
	headers := func(lease string) [][]string {
		t.Helper()
		s := serveOnRedisWith(t, srv, fmt.Sprintf(`
	rate_limit 4 1/10s {
		name ban_wait_%s
		ban 60s
		max_wait 1s
		headers both
		store redis {
			address %s
			%s
		}
	}
	respond "ok"`, strings.ReplaceAll(strings.TrimSpace(lease+" strict"), " ", "_"), srv.url(), lease))
		var got [][]string
		for i := range 7 {
			r := s.from("127.0.5.1", "/")
			if want := i < 4; (r.status == 200) != want {
				t.Fatalf("%q: request %d: %d, want admitted %v", lease, i, r.status, want)
			}
			// X-RateLimit-Reset is a Unix time: kept as from this
			// request's second, which the two runs may not share.
			reset, err := strconv.ParseInt(r.header.Get("X-RateLimit-Reset"), 10, 64)
			if err != nil {
				t.Fatalf("%q: request %d: X-RateLimit-Reset %q", lease, i, r.header.Get("X-RateLimit-Reset"))
			}
			got = append(got, []string{strconv.Itoa(r.status), r.header.Get("Retry-After"), strconv.FormatInt(reset-time.Now().Unix(), 10), r.header.Get("RateLimit")})
		}
		return got
	}
	strict, leased := headers(""), headers("lease 50%")
	t.Logf("strict mode: %q", strict)
	// Capacity 4, a token every 10 s (leases of 2): the fifth request's
	// token is due in 10 s, past max_wait; it is refused and bans for
	// 60 s, after which a request's token is due within max_wait at 69 s.
	if strict[4][1] != "69" {
		t.Fatalf("strict mode: the refusal that starts the ban says Retry-After %q, want 69", strict[4][1])
	}
	// The admitted requests' headers differ: a lease takes several tokens
	// at once (docs/fleet.md).
	near := func(a, b []string) bool {
		x, _ := strconv.Atoi(a[2])
		y, _ := strconv.Atoi(b[2])
		return a[0] == b[0] && a[1] == b[1] && a[3] == b[3] && x-y <= 1 && y-x <= 1
	}
	if !slices.EqualFunc(strict[4:], leased[4:], near) {
		t.Errorf("the refusals with leases, status, Retry-After, X-RateLimit-Reset (from now), RateLimit:\n%q\nin strict mode:\n%q", leased[4:], strict[4:])
	}
}
