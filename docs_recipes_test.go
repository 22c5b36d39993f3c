package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// The recipes of docs/ run as a reader runs them: each test takes its
// example from the page, not a copy of it.

// docBlock is the first fenced block of a language in file that holds
// want.
func docBlock(t *testing.T, file, lang, want string) string {
	t.Helper()
	for _, b := range fencedBlocks(t, file, lang) {
		if strings.Contains(b.text, want) {
			return b.text
		}
	}
	t.Fatalf("%s has no %s block with %q", file, lang, want)
	return ""
}

// serveDocSite runs a page's whole Caddyfile on a free port, its site
// address http://127.0.0.1:8080, with the admin API off and its
// reverse_proxy 127.0.0.1:9000 sent to an origin that answers "origin".
func serveDocSite(t *testing.T, site string) *testServer {
	t.Helper()
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "origin")
	}))
	t.Cleanup(origin.Close)
	if !strings.Contains(site, "http://127.0.0.1:8080 {") {
		t.Fatalf("the page's Caddyfile has no site http://127.0.0.1:8080:\n%s", site)
	}
	port := freePort(t)
	cfg := strings.NewReplacer(
		"http://127.0.0.1:8080 {", fmt.Sprintf("http://127.0.0.1:%d {", port),
		"reverse_proxy 127.0.0.1:9000", "reverse_proxy "+strings.TrimPrefix(origin.URL, "http://"),
	).Replace(site)
	return serveCaddyfile(t, port, "{\n\tadmin off\n}\n\n"+cfg)
}

// The placeholders recipe of docs/operating.md sets X-RateLimit-Tier on
// the responses that pass and on the refusals, which go through Caddy's
// error path, where a `header >` of the site's route never runs.
// Regression test for issue 31 item 3.
func TestDocsOperatingHeaderOnRefusals(t *testing.T) {
	useFakeClock(t)
	s := serveDocSite(t, docBlock(t, "docs/operating.md", "caddyfile", "X-RateLimit-Tier"))
	var r response
	for i := 0; ; i++ {
		r = s.get("/")
		if r.status != http.StatusOK {
			break
		}
		if got := r.header.Get("X-RateLimit-Tier"); got != "default" {
			t.Fatalf("request %d passed with X-RateLimit-Tier %q, want default", i+1, got)
		}
	}
	if r.status != http.StatusTooManyRequests || r.header.Get("X-RateLimit-Tier") != "default" {
		t.Errorf("refusal: %d, X-RateLimit-Tier %q; want 429 and default", r.status, r.header.Get("X-RateLimit-Tier"))
	}
}

// docs/logins.md's no_key deny recipe answers a login that names no
// username with a 400 that says what is missing, and never reaches the
// origin; one that names it does.
// Regression test for issue 31 item 4.
func TestDocsLoginsNoKeyDenySaysWhatIsMissing(t *testing.T) {
	useFakeClock(t)
	s := serveDocSite(t, docBlock(t, "docs/logins.md", "caddyfile", "no_key deny\n\t}\n\treverse_proxy"))
	r := s.do(http.MethodPost, "/login", "password=secret", "Content-Type: application/x-www-form-urlencoded")
	if r.status != http.StatusBadRequest || !strings.Contains(r.body, "username") {
		t.Errorf("a login without a username: %d %q; want 400 and a body that names the missing username", r.status, r.body)
	}
	r = s.do(http.MethodPost, "/login", "username=alice&password=secret", "Content-Type: application/x-www-form-urlencoded")
	if r.status != http.StatusOK || r.body != "origin" {
		t.Errorf("a login with a username: %d %q; want the origin's 200", r.status, r.body)
	}
}

// docExample is a curl line of a page and the reply the page shows under
// it, on lines of its own that start with #.
type docExample struct {
	method, path, reply string
}

var curlURL = regexp.MustCompile(`curl .*'?http://localhost:2019(/[^' ]*)'?`)

// docExamples are the admin API calls of a page's sh blocks that show a
// reply.
func docExamples(t *testing.T, file string) []docExample {
	t.Helper()
	var out []docExample
	for _, b := range fencedBlocks(t, file, "sh") {
		lines := strings.Split(b.text, "\n")
		for i, l := range lines {
			m := curlURL.FindStringSubmatch(l)
			if m == nil {
				continue
			}
			ex := docExample{method: http.MethodGet, path: m[1]}
			if strings.Contains(l, "-X DELETE") {
				ex.method = http.MethodDelete
			}
			for _, r := range lines[i+1:] {
				rest, ok := strings.CutPrefix(strings.TrimSpace(r), "#")
				if !ok || strings.HasPrefix(strings.TrimSpace(rest), "{") && ex.reply != "" {
					break
				}
				ex.reply += strings.TrimSpace(rest)
			}
			out = append(out, ex)
		}
	}
	return out
}

var keyerAndID = regexp.MustCompile(`"keyer":"[^"]+","key_id":"[^"]+"`)

// The key_ids of docs/operating.md's admin API examples are those a run
// prints for the values they name: the policy edge of example.Caddyfile
// (the client IP 127.0.0.1, the API key demo-key-1) and the policy plans
// of docs/metering-and-quotas.md (the JWT subject alice), with no
// key_secret. /rate_limit/top's is 127.0.0.1's, denied.
// Regression test for issue 31 item 4.
func TestDocsOperatingKeyIDsAreWhatRunsPrints(t *testing.T) {
	useFakeClock(t)
	forgetDenials("edge")
	s, admin := serveWithAdmin(t, `
	rate_limit 5 1/10s {
		name edge
		key header X-API-Key
		tier api 100 10/s {
			keyer header
			concurrency 5
		}
	}
	rate_limit 5 1/10s {
		name plans
		key jwt sub
		jwt {
			secret "a secret of the docs' recipes test"
		}
		tier pro 100 20/s {
			claim plan pro
			quota 100000/month
			quota 10000/day
		}
	}
	respond "ok"`)
	// The sixth request is denied: 127.0.0.1 is on /rate_limit/top.
	for range 6 {
		s.get("/")
	}
	latestHandler("edge").notes.flush()

	checked := 0
	for _, ex := range docExamples(t, "docs/operating.md") {
		want := keyerAndID.FindString(ex.reply)
		if want == "" {
			continue
		}
		req, _ := http.NewRequest(ex.method, admin+ex.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(body), want) {
			got := keyerAndID.FindString(string(body))
			t.Errorf("%s %s: the page shows %s, a run prints %s", ex.method, ex.path, want, got)
		}
		checked++
	}
	if checked < 5 {
		t.Errorf("only %d examples with a key_id found in docs/operating.md; the pattern may have broken", checked)
	}
}

// docsExec is an events handler that stands in for the exec module of
// docs/operating.md (github.com/mholt/caddy-events-exec): it takes the
// same settings, expands the placeholders in its args as that module
// does, and keeps the command lines instead of running them.
type docsExec struct {
	Command string   `json:"command,omitempty"`
	Args    []string `json:"args,omitempty"`
}

var docsExecRan = struct {
	sync.Mutex
	lines [][]string
}{}

func (docsExec) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.rate_limit_test_exec", New: func() caddy.Module { return new(docsExec) }}
}

func (e *docsExec) Handle(ctx context.Context, _ caddy.Event) error {
	repl := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	line := []string{e.Command}
	for _, a := range e.Args {
		line = append(line, repl.ReplaceAll(a, ""))
	}
	docsExecRan.Lock()
	docsExecRan.lines = append(docsExecRan.lines, line)
	docsExecRan.Unlock()
	return nil
}

func init() { caddy.RegisterModule(docsExec{}) }

var _ caddyevents.Handler = (*docsExec)(nil)

// The events recipe of docs/operating.md, its JSON merged into a Caddy
// config as a reader merges it: a flood on two clients runs its command
// once per client, with the policy, tier, keyer, key_id and retry_after.
// Regression test for issue 31 item 2.
func TestDocsOperatingEventsRecipeRunsOncePerBucket(t *testing.T) {
	useFakeClock(t)
	forgetDenials("docs_events")
	var recipe struct {
		Apps map[string]json.RawMessage `json:"apps"`
	}
	block := docBlock(t, "docs/operating.md", "json", `"rate_limit_exceeded"`)
	if err := json.Unmarshal([]byte(block), &recipe); err != nil || recipe.Apps["events"] == nil {
		t.Fatalf("the page's events config: %v, apps %v", err, recipe.Apps)
	}
	events := strings.Replace(string(recipe.Apps["events"]), `"handler": "exec"`, `"handler": "rate_limit_test_exec"`, 1)

	port := freePort(t)
	cfg, err := adaptCaddyfile(fmt.Sprintf("{\n\tadmin off\n\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}\n}\n\nhttp://127.0.0.1:%d {\n\trate_limit 2 1/s {\n\t\tname docs_events\n\t}\n\trespond \"ok\"\n}\n", port))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]map[string]json.RawMessage
	if err := json.Unmarshal(cfg, &doc); err != nil {
		t.Fatal(err)
	}
	doc["apps"]["events"] = json.RawMessage(events)
	cfg, _ = json.Marshal(doc)
	docsExecRan.Lock()
	docsExecRan.lines = nil
	docsExecRan.Unlock()
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading the page's events config: %v\n%s", err, events)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	s := &testServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port), port: port, client: &http.Client{Timeout: 10 * time.Second}}

	ids := map[string]bool{}
	for _, ip := range []string{"127.0.3.1", "127.0.3.2"} {
		for range 20 {
			s.from(ip, "/")
		}
		ids[keyID(&Bucket{Keyer: "ip/32/64", Value: mustAddr(t, ip)})] = true
	}
	latestHandler("docs_events").notes.flush()
	docsExecRan.Lock()
	lines := docsExecRan.lines
	docsExecRan.Unlock()
	if len(lines) != 2 {
		t.Fatalf("40 requests, 36 denied, on two clients ran the command %d times: %q; want once per client", len(lines), lines)
	}
	for _, l := range lines {
		if len(l) != 6 || l[1] != "docs_events" || l[2] != "default" || l[3] != "ip/32/64" || !ids[l[4]] || l[5] != "1" {
			t.Errorf("the command ran as %q; want the policy, tier, keyer, a client's key_id and retry_after 1", l)
		}
	}
}

// mustAddr is an IP address as the default ip keyer names it.
func mustAddr(t *testing.T, ip string) []byte {
	t.Helper()
	k := new(IPKeyer)
	if err := k.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	v, ok := k.appendAddr(nil, netip.MustParseAddr(ip))
	if !ok {
		t.Fatalf("the ip keyer names nobody for %s", ip)
	}
	return v
}

// docs/fleet.md's recipe for managed services puts the password from the
// environment into the address URL, naming Azure Cache among them, whose
// access keys are base64: about half hold a "/". With such a key set as
// the page says, the recipe must still reach Redis with it (only the
// host, port and scheme changed for a local redis-server).
func TestDocsFleetManagedServiceRecipeTakesABase64Password(t *testing.T) {
	const key = "q8Zr/T+x0kLmN2pQ7sVw4yB1cD3eF5gH6iJ9kL0mN1o="
	t.Setenv("REDIS_PASSWORD", key)
	srv := startRedis(t)
	srv.do("CONFIG", "SET", "requirepass", key)
	block := docBlock(t, "docs/fleet.md", "caddyfile", "{env.REDIS_PASSWORD}@")
	store := regexp.MustCompile(`rediss://([^:]+):\{env\.REDIS_PASSWORD\}@[^\s]+`).ReplaceAllString(block, "redis://$1:{env.REDIS_PASSWORD}@"+srv.addr())
	cfg, err := adaptSite("rate_limit 3 1/h {\n" + store + "\non_store_error deny\n}\nrespond ok")
	if err != nil {
		t.Fatal(err)
	}
	if err := loadAndStop(cfg); err != nil {
		t.Errorf("the recipe with a base64 access key as REDIS_PASSWORD: %v", err)
	}
}
