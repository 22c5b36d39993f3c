package ratelimit

import (
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func TestBurstGetsThreeThenRetryAfter(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 3 1/10s
	respond "ok"`)

	before := time.Now().Unix()
	for i, want := range []string{"2", "1", "0"} {
		r := s.get("/")
		if r.status != 200 {
			t.Fatalf("request %d: status %d, want 200", i+1, r.status)
		}
		if got := r.header.Get("X-RateLimit-Remaining"); got != want {
			t.Errorf("request %d: X-RateLimit-Remaining %q, want %q", i+1, got, want)
		}
		if got := r.header.Get("X-RateLimit-Limit"); got != "3" {
			t.Errorf("request %d: X-RateLimit-Limit %q, want 3", i+1, got)
		}
	}
	r := s.get("/")
	after := time.Now().Unix()
	if r.status != 429 {
		t.Fatalf("4th request: status %d, want 429", r.status)
	}
	if got := r.header.Get("Retry-After"); got != "10" {
		t.Errorf("Retry-After %q, want 10", got)
	}
	// Three tokens are missing, at one per 10 s: full again 30 s from now.
	reset, err := strconv.ParseInt(r.header.Get("X-RateLimit-Reset"), 10, 64)
	if err != nil || reset < before+30 || reset > after+31 {
		t.Errorf("X-RateLimit-Reset %q, want the epoch second 30 s ahead, in [%d, %d]", r.header.Get("X-RateLimit-Reset"), before+30, after+31)
	}
}

func TestOneRequestPassesAgainAfterTheRefillTime(t *testing.T) {
	clock := useFakeClock(t)
	s := serve(t, `
	rate_limit 2 10/s
	respond "ok"`)

	for i := range 2 {
		if r := s.get("/"); r.status != 200 {
			t.Fatalf("request %d: status %d, want 200", i+1, r.status)
		}
	}
	if r := s.get("/"); r.status != 429 {
		t.Fatalf("3rd request: status %d, want 429", r.status)
	}
	clock.advance(99 * time.Millisecond)
	if r := s.get("/"); r.status != 429 {
		t.Fatalf("99 ms later: status %d, want 429", r.status)
	}
	clock.advance(time.Millisecond)
	if r := s.get("/"); r.status != 200 {
		t.Fatalf("100 ms later: status %d, want 200", r.status)
	}
	if r := s.get("/"); r.status != 429 {
		t.Fatalf("then again: status %d, want 429: only one token came back", r.status)
	}
}

func TestHeadersModes(t *testing.T) {
	tests := []struct {
		mode      string
		present   []string
		absent    []string
		wantIETF  string
		wantPolic string
	}{
		{"x", []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}, []string{"RateLimit", "RateLimit-Policy"}, "", ""},
		{"ietf", []string{"RateLimit", "RateLimit-Policy"}, []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}, `"default";r=4;t=2`, `"default";q=5;w=10`},
		{"both", []string{"RateLimit", "RateLimit-Policy", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}, nil, `"default";r=4;t=2`, `"default";q=5;w=10`},
		{"none", nil, []string{"RateLimit", "RateLimit-Policy", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.mode, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, `
	rate_limit 5 1/2s {
		headers `+tt.mode+`
	}
	respond "ok"`)
			r := s.get("/")
			for _, h := range tt.present {
				if r.header.Get(h) == "" {
					t.Errorf("%s missing", h)
				}
			}
			for _, h := range tt.absent {
				if v := r.header.Get(h); v != "" {
					t.Errorf("%s: %q, want none", h, v)
				}
			}
			if tt.wantIETF != "" && r.header.Get("RateLimit") != tt.wantIETF {
				t.Errorf("RateLimit %q, want %q", r.header.Get("RateLimit"), tt.wantIETF)
			}
			if tt.wantPolic != "" && r.header.Get("RateLimit-Policy") != tt.wantPolic {
				t.Errorf("RateLimit-Policy %q, want %q", r.header.Get("RateLimit-Policy"), tt.wantPolic)
			}
			for range 4 {
				s.get("/")
			}
			if r := s.get("/"); r.status != 429 || r.header.Get("Retry-After") != "2" {
				t.Errorf("6th request: status %d, Retry-After %q; want 429 and 2 whatever the headers mode", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}

func TestRejectionGoesThroughHandleErrors(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/m
	respond "ok"
	handle_errors 429 {
		respond "slow down: {http.rate_limit.decision}, retry in {http.rate_limit.retry_after}s, tier {http.rate_limit.tier}" 429
	}`)
	s.get("/")
	r := s.get("/")
	if r.status != 429 || r.body != "slow down: denied, retry in 60s, tier default" {
		t.Fatalf("got %d %q, want 429 with the handle_errors page", r.status, r.body)
	}
	if r.header.Get("Retry-After") != "60" || r.header.Get("X-RateLimit-Remaining") != "0" {
		t.Errorf("Retry-After %q, X-RateLimit-Remaining %q: want 60 and 0 through handle_errors", r.header.Get("Retry-After"), r.header.Get("X-RateLimit-Remaining"))
	}
}

func TestRejectionFillsCaddysErrorPlaceholders(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/m {
		tier bots {
			match {
				header User-Agent bot
			}
			deny
		}
	}
	respond "ok"
	handle_errors {
		respond "{http.error.status_code}|{http.error.message}|{http.error.id}|{http.error.trace}" {http.error.status_code}
	}`)
	s.get("/")
	ids := map[string]bool{}
	check := func(r response, status int, message string) {
		t.Helper()
		f := strings.Split(r.body, "|")
		if r.status != status || len(f) != 4 || f[0] != strconv.Itoa(status) || f[1] != message {
			t.Fatalf("got %d %q, want %d with status|%s|id|trace", r.status, r.body, status, message)
		}
		id := f[2]
		if len(id) != 9 || strings.Trim(id, "abcdefghijkmnpqrstuvwxyz23456789") != "" {
			t.Errorf("error id %q: want 9 characters of caddyhttp's alphabet", id)
		}
		if ids[id] {
			t.Errorf("error id %q given twice", id)
		}
		ids[id] = true
		if f[3] == "" {
			t.Errorf("no error trace")
		}
	}
	for range 5 {
		check(s.get("/"), 429, "rate limit exceeded")
		check(s.get("/", "User-Agent: bot"), 403, "client is on a deny tier")
	}
}

func TestStatusSetsTheRejectionCode(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/m {
		status 503
	}
	respond "ok"`)
	s.get("/")
	if r := s.get("/"); r.status != 503 || r.header.Get("Retry-After") != "60" {
		t.Fatalf("got %d with Retry-After %q, want 503 and 60", r.status, r.header.Get("Retry-After"))
	}
}

// A flood of denials answered with a 5xx status logs no line a denial and
// no client's key: docs/operating.md promises debug lines with key_id only.
// Caddy logs a handler's 5xx error at error level, with the request's
// headers, once a request.
func TestDenialsWithA5xxStatusUnderAFloodLogAFewLinesAndNoKey(t *testing.T) {
	useFakeClock(t)
	s, file := serveLoggingTo(t, `
	rate_limit 1 1/h {
		key header X-Api-Key
		status 503
	}
	respond "ok"`)
	for i := range 200 {
		if r := s.get("/", "X-Api-Key: k3"); r.status != 503 && i > 0 {
			t.Fatalf("request %d over the limit: %d, want 503", i+1, r.status)
		}
	}
	log, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(log)), "\n") {
		if strings.Contains(line, "k3") {
			lines = append(lines, line)
		}
	}
	if len(lines) > 0 {
		t.Fatalf("%d log lines about 199 denials hold the client's key; the first:\n%s", len(lines), lines[0])
	}
}

func TestPlaceholdersOnAllowedRequests(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 4 1/s {
		name api
	}
	respond "{http.rate_limit.policy} {http.rate_limit.tier} {http.rate_limit.decision} {http.rate_limit.limit} {http.rate_limit.remaining} {http.rate_limit.retry_after} {http.rate_limit.key_id}"`)
	r := s.from("127.0.0.2", "/")
	sum := (&Bucket{Keyer: "ip/32/64", Value: []byte("127.0.0.2")}).Digest()
	want := "api default allowed 4 3 0 " + hex.EncodeToString(sum[:8])
	if r.body != want {
		t.Fatalf("body %q, want %q", r.body, want)
	}
	if strings.Contains(r.body, "127.0.0.2") {
		t.Errorf("a placeholder showed the client's address")
	}
}

func TestTiersFirstMatchWins(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 3 1/h {
		key header X-API-Key
		tier bots 1 1/h {
			match {
				header User-Agent *bot*
			}
		}
		tier partners 5 1/h {
			keyer header
		}
		tier heavy 4 1/h {
			match {
				path /export/*
			}
			cost 2
		}
		tier staff {
			match {
				header X-Staff yes
			}
			unlimited
		}
		tier banned {
			match {
				header User-Agent BadBot*
			}
			deny
		}
	}
	respond "{http.rate_limit.tier}"`)

	count := func(n int, ip, path string, headers ...string) (allowed int, tier string) {
		for range n {
			r := s.from(ip, path, headers...)
			if r.status == 200 {
				allowed++
				tier = r.body
			}
		}
		return allowed, tier
	}
	for _, tt := range []struct {
		name        string
		ip, path    string
		headers     []string
		wantAllowed int
		wantTier    string
	}{
		{"bot by user agent", "127.0.1.1", "/", []string{"User-Agent: crawlbot/1.0"}, 1, "bots"},
		{"partner by API key", "127.0.1.2", "/", []string{"X-API-Key: k1"}, 5, "partners"},
		{"anonymous", "127.0.1.3", "/", nil, 3, "default"},
		{"cost 2 of 4", "127.0.1.4", "/export/x", nil, 2, "heavy"},
		{"staff unlimited", "127.0.1.5", "/", []string{"X-Staff: yes"}, 20, "staff"},
	} {
		allowed, tier := count(20, tt.ip, tt.path, tt.headers...)
		if allowed != tt.wantAllowed || tier != tt.wantTier {
			t.Errorf("%s: %d allowed on tier %q, want %d on %q", tt.name, allowed, tier, tt.wantAllowed, tt.wantTier)
		}
	}
	// The first matching tier wins: a bot with an API key is a bot.
	if allowed, tier := count(3, "127.0.1.6", "/", "User-Agent: bot", "X-API-Key: k2"); allowed != 1 || tier != "bots" {
		t.Errorf("bot with API key: %d on %q, want 1 on bots", allowed, tier)
	}
	r := s.from("127.0.1.7", "/", "User-Agent: BadBot/2")
	if r.status != 403 || r.header.Get("X-RateLimit-Limit") != "" {
		t.Errorf("deny tier: %d with X-RateLimit-Limit %q, want 403 and no limit headers", r.status, r.header.Get("X-RateLimit-Limit"))
	}
	if r := s.from("127.0.1.8", "/", "X-Staff: yes"); r.header.Get("X-RateLimit-Limit") != "" {
		t.Errorf("unlimited tier sent X-RateLimit-Limit %q", r.header.Get("X-RateLimit-Limit"))
	}
}

func TestUpstreamHeadersReachTheOrigin(t *testing.T) {
	useFakeClock(t)
	port, origin := freePort(t), freePort(t)
	s := serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 10 1/s {
		upstream_headers
	}
	reverse_proxy 127.0.0.1:%d
}
http://127.0.0.1:%d {
	respond "limit={header.X-RateLimit-Limit} remaining={header.X-RateLimit-Remaining}"
}`, port, origin, origin))
	if r := s.get("/"); r.body != "limit=10 remaining=9" {
		t.Fatalf("origin saw %q, want limit=10 remaining=9", r.body)
	}
}

func TestClientCannotForgeUpstreamHeaders(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 10 1/s {
		upstream_headers
	}
	respond "{header.X-RateLimit-Remaining}"`)
	if r := s.get("/", "X-RateLimit-Remaining: 1000000"); r.body != "9" {
		t.Fatalf("later handlers saw %q, want the limiter's 9", r.body)
	}
}

func TestDryRunNeverRejects(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 2 1/h {
		dry_run
	}
	respond "{http.rate_limit.decision}"`)
	var bodies []string
	for range 4 {
		r := s.get("/")
		if r.status != 200 {
			t.Fatalf("dry run rejected with %d", r.status)
		}
		bodies = append(bodies, r.body)
	}
	if got := strings.Join(bodies, ","); got != "allowed,allowed,dry_run,dry_run" {
		t.Errorf("decisions %s, want allowed,allowed,dry_run,dry_run", got)
	}
	// A 200 is not a rejection: Retry-After would tell the client to wait.
	if r := s.get("/"); r.header.Get("X-RateLimit-Remaining") != "0" || r.header.Values("Retry-After") != nil {
		t.Errorf("dry run over the limit: Remaining %q, Retry-After %q; want 0 and none", r.header.Get("X-RateLimit-Remaining"), r.header.Values("Retry-After"))
	}
}

func TestPolicyNameSharesBucketsAcrossRoutes(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	handle /a {
		rate_limit 2 1/h {
			name shared
		}
		respond "a"
	}
	handle /b {
		rate_limit 2 1/h {
			name shared
		}
		respond "b"
	}
	handle /c {
		rate_limit 2 1/h {
			name other
		}
		respond "c"
	}`)
	s.get("/a")
	s.get("/b")
	if r := s.get("/a"); r.status != 429 {
		t.Errorf("third request across /a and /b of one policy: %d, want 429", r.status)
	}
	if r := s.get("/c"); r.status != 200 {
		t.Errorf("another policy: %d, want its own bucket", r.status)
	}
}

func TestReloadKeepsBuckets(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 2 1/h
	respond "one"`)
	s.get("/")
	s.get("/")
	cfg, err := adaptCaddyfile(fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 2 1/h
	respond "two"
}`, s.port))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	r := s.get("/")
	if r.status != 429 {
		t.Fatalf("after a reload: %d %q, want 429: the bucket was lost", r.status, r.body)
	}
}

func TestClientCannotForgeUpstreamHeadersOfTheOtherMode(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 10 1/s {
		headers ietf
		upstream_headers
	}
	respond "[{header.X-RateLimit-Remaining}] {header.RateLimit}"`)
	if r := s.get("/", "X-RateLimit-Remaining: 1000000"); r.body != `[] "default";r=9;t=1` {
		t.Fatalf("later handlers saw %q, want no X- header and the limiter's RateLimit", r.body)
	}
}

func TestHeaderEditsDoNotLeakIntoLaterResponses(t *testing.T) {
	useFakeClock(t)
	// A deferred regex replace edits the response's header values in place;
	// each response must own its values, or the edit compounds.
	s := serve(t, `
	header >X-RateLimit-Limit "^(\d+)$" "${1}0"
	header >RateLimit-Policy "q=" "q=1"
	rate_limit 5 1/s {
		headers both
	}
	respond "ok"`)
	for i := range 4 {
		r := s.get("/")
		if got := r.header.Get("X-RateLimit-Limit"); got != "50" {
			t.Fatalf("response %d: X-RateLimit-Limit %q, want 50 (the edit applied once)", i, got)
		}
		if got := r.header.Get("RateLimit-Policy"); got != `"default";q=15;w=5` {
			t.Fatalf("response %d: RateLimit-Policy %q, want \"default\";q=15;w=5", i, got)
		}
	}
}

// Validate, which the Caddyfile adapter's check is, only checks: a handler
// it has read is as it was, every tier included, so that `caddy adapt`
// shows what was written and Provision alone works out what the settings
// imply.
func TestValidateChangesNothing(t *testing.T) {
	t.Parallel()
	const cfg = `{"name":"checked","headers":"both","count_status":["401"],"ban":60000000000,"max_wait":1000000000,"timezone":"Europe/Berlin","no_key":"ip",
		"tiers":[{"name":"api","keyer":"header","limits":[{"capacity":10,"refill":"1/s"},{"capacity":100,"refill":"10/m"}],"quotas":["1000/day"],"cost_from_response":"x-used"},
		{"name":"default","quotas":["50/month"],"concurrency":2}]}`
	var checked, written Handler
	for _, h := range []*Handler{&checked, &written} {
		if err := json.Unmarshal([]byte(cfg), h); err != nil {
			t.Fatal(err)
		}
	}
	if err := checked.Validate(); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(checked, written) {
		t.Errorf("Validate changed the handler:\n%+v\nwant it as written:\n%+v", checked, written)
		for i, tier := range checked.Tiers {
			t.Logf("tier %d: %+v", i, *tier)
		}
	}
}

// A store that fails with on_store_error deny fills {http.error.message}
// with what failed, never where: a handle_errors page that shows it must
// not give clients the store's address.
func TestAStoreFailureKeepsTheStoresAddressOutOfTheErrorMessage(t *testing.T) {
	useFakeClock(t)
	addr := "127.0.0.1:" + strconv.Itoa(freePort(t))
	s := serve(t, `
	rate_limit 10 1/m {
		store redis {
			address redis://`+addr+`
			timeout 200ms
		}
		on_store_error deny
	}
	respond "ok"
	handle_errors {
		respond "{http.error.status_code}|{http.error.message}" {http.error.status_code}
	}`)
	r := s.get("/")
	if r.status != 503 || r.body != "503|rate limit store unavailable" {
		t.Fatalf("with Redis at %s down: %d %q; want 503|rate limit store unavailable, no address", addr, r.status, r.body)
	}
}
