package ratelimit

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Two sites pasted side by side, each with an unnamed rate_limit, would be
// one policy ("default") and limit each other's clients: after 6 requests
// to one, the other's first was refused with the first one's Retry-After.
// The config is refused at load, naming both and asking for names.
// Regression test for issue 31 (item 1).
func TestUnnamedHandlersOfOneConfigAreRefused(t *testing.T) {
	a, b := freePort(t), freePort(t)
	for _, tt := range []struct{ name, caddyfile string }{
		{"two sites", fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 5 1/10s
	respond "a"
}
http://127.0.0.1:%d {
	rate_limit 100 10/s
	respond "b"
}`, a, b)},
		{"two routes of one site", fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit /login 3 1/m
	rate_limit 100 10/s
	respond "a"
}`, a)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := adaptCaddyfile(tt.caddyfile)
			if err != nil {
				t.Fatal(err)
			}
			err = caddy.Load(cfg, true)
			if err == nil {
				_ = caddy.Stop()
				t.Fatal("a config of two unnamed rate_limit handlers loaded")
			}
			for _, want := range []string{"no name", "name api", "default (5 1/10s)", "default (100 10/s)"} {
				if tt.name == "two routes of one site" && strings.HasPrefix(want, "default (5") {
					want = "default (3 1/m)"
				}
				if !strings.Contains(err.Error(), want) {
					t.Errorf("the error does not say %q: %v", want, err)
				}
			}
		})
	}
}

// One unnamed handler is the policy "default", as before; a handler of
// each name is its own policy; two of one name share, on purpose.
func TestNamedHandlersOfOneConfigLoad(t *testing.T) {
	a, b := freePort(t), freePort(t)
	srv := serveCaddyfile(t, a, fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 2 1/h {
		name a
	}
	respond "a"
}
http://127.0.0.1:%d {
	rate_limit 2 1/h {
		name b
	}
	respond "b"
}`, a, b))
	for range 2 {
		srv.get("/")
	}
	if r := srv.get("/"); r.status != 429 {
		t.Fatalf("a's third request: %d, want 429", r.status)
	}
	other := &testServer{t: t, base: fmt.Sprintf("http://127.0.0.1:%d", b), port: b, client: srv.client}
	if r := other.get("/"); r.status != 200 {
		t.Errorf("b's first request after a's ran out: %d, want 200: the sites share buckets", r.status)
	}
}

// Handlers that share a name on purpose but limit differently are told of
// at load, in Caddy's log.
func TestHandlersOfOneNameThatLimitDifferentlyAreWarnedOf(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	a, b := freePort(t), freePort(t)
	serveCaddyfile(t, a, fmt.Sprintf(`{
	admin off
	log {
		output file %s
		format json
	}
}
http://127.0.0.1:%d {
	rate_limit 5 1/10s {
		name shared
	}
	respond "a"
}
http://127.0.0.1:%d {
	rate_limit 100 10/s {
		name shared
	}
	respond "b"
}`, logFile, a, b))
	data, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), "limit differently") || !strings.Contains(string(data), `"policy":"shared"`) {
		t.Errorf("no warning of the two handlers of the policy \"shared\" in the log:\n%s", data)
	}
}

// One rate_limit line in a site of two addresses on two ports (as
// `http://example.com, https://example.com`, or `:80, :443`, which Caddy
// serves from two servers): the Caddyfile puts a copy of the site's
// routes in each server, so the one handler is provisioned twice. It is
// one policy as written, limiting the site's clients across both: the
// config loads, and the two copies share the buckets.
func TestOneUnnamedHandlerInASiteOfTwoAddressesLoads(t *testing.T) {
	a, b := freePort(t), freePort(t)
	cfg, err := adaptCaddyfile(fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d, http://127.0.0.1:%d {
	rate_limit 2 1/h
	respond "ok"
}`, a, b))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("one rate_limit line in a site of two addresses: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	codes := ""
	for _, port := range []int{a, b, a} {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/", port))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		codes += fmt.Sprint(resp.StatusCode, " ")
	}
	if codes != "200 200 429 " {
		t.Errorf("three requests across the two addresses: %s; want 200 200 429 (one policy, capacity 2)", codes)
	}
}

// hostGet sends a GET to 127.0.0.1:port for the site named host, and
// returns its status.
func hostGet(t *testing.T, port int, host, path string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d%s", port, path), nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// loadOrRefused loads a Caddyfile; it reports whether the config was
// refused at load, and stops Caddy when the test ends otherwise.
func loadOrRefused(t *testing.T, caddyfile string) (refused bool) {
	t.Helper()
	cfg, err := adaptCaddyfile(caddyfile)
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Logf("refused at load: %v", err)
		return true
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return false
}

// Two unnamed rate_limit lines that happen to read the same, on two paths
// of one site (a login and a search, each `3 1/h` as a recipe says), are
// two handlers, not copies of one: the login's attempts must not spend
// the search's bucket. They are kept apart, or the config is refused.
func TestTwoUnnamedHandlersOfOneSiteThatReadTheSameDoNotShareABucket(t *testing.T) {
	port := freePort(t)
	if loadOrRefused(t, fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit /login 2 1/h
	rate_limit /search 2 1/h
	respond "ok"
}`, port)) {
		return
	}
	codes := fmt.Sprint(hostGet(t, port, "127.0.0.1", "/login"), hostGet(t, port, "127.0.0.1", "/login"), hostGet(t, port, "127.0.0.1", "/search"))
	if codes != "200200200" {
		t.Errorf("two /login, then /search: %s; want 200 200 200: the search's first request was refused by the login's bucket", codes)
	}
}

// Two sites on one port (two hosts), each with the same unnamed line
// pasted from a recipe: one server holds both handlers, which are two, so
// one site's clients must not spend the other's bucket.
func TestTwoUnnamedHandlersOfTwoHostsOnOnePortDoNotShareABucket(t *testing.T) {
	port := freePort(t)
	if loadOrRefused(t, fmt.Sprintf(`{
	admin off
}
http://a.localhost:%d {
	rate_limit 2 1/h
	respond "a"
}
http://b.localhost:%d {
	rate_limit 2 1/h
	respond "b"
}`, port, port)) {
		return
	}
	a := fmt.Sprintf("a.localhost:%d", port)
	b := fmt.Sprintf("b.localhost:%d", port)
	codes := fmt.Sprint(hostGet(t, port, a, "/"), hostGet(t, port, a, "/"), hostGet(t, port, b, "/"))
	if codes != "200200200" {
		t.Errorf("two to a, then one to b: %s; want 200 200 200: b's first request was refused by a's bucket", codes)
	}
}

// A snippet imported by two sites on two ports is two handlers written
// alike in two servers, which a config cannot tell from one site on two
// ports: they are one policy, as docs/caddyfile.md says (name them to keep
// them apart). Two sites on one port are refused (TestTwoUnnamedHandlersOfTwoHostsOnOnePortDoNotShareABucket).
func TestAnUnnamedSnippetImportedBySitesOnTwoPortsIsOnePolicy(t *testing.T) {
	a, b := freePort(t), freePort(t)
	if loadOrRefused(t, fmt.Sprintf(`{
	admin off
}
(limits) {
	rate_limit 2 1/h
}
http://127.0.0.1:%d {
	import limits
	respond "a"
}
http://127.0.0.1:%d {
	import limits
	respond "b"
}`, a, b)) {
		return
	}
	codes := fmt.Sprint(hostGet(t, a, "127.0.0.1", "/"), hostGet(t, a, "127.0.0.1", "/"), hostGet(t, b, "127.0.0.1", "/"))
	if codes != "200 200 429" {
		t.Errorf("two to a, then one to b: %s; want 200 200 429, one policy", codes)
	}
}

// A handler named "default" beside an unnamed one that limits otherwise,
// on two paths of one site: both are the policy "default" and share
// buckets, whichever comes first, so the clash is refused or at least
// warned of in either order.
func TestANamedDefaultBesideAnUnnamedHandlerIsWarnedOf(t *testing.T) {
	for _, order := range []string{"named first", "unnamed first"} {
		t.Run(order, func(t *testing.T) {
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			port := freePort(t)
			// Caddy orders the two routes by path: /a is provisioned first.
			named := "rate_limit /a 5 1/10s {\n\t\tname default\n\t}"
			unnamed := "rate_limit /b 100 10/s"
			if order == "unnamed first" {
				named = "rate_limit /b 5 1/10s {\n\t\tname default\n\t}"
				unnamed = "rate_limit /a 100 10/s"
			}
			first, second := named, unnamed
			if loadOrRefused(t, fmt.Sprintf(`{
	admin off
	log {
		output file %s
		format json
	}
}
http://127.0.0.1:%d {
	%s
	%s
	respond "ok"
}`, logFile, port, first, second)) {
				return
			}
			data, err := os.ReadFile(logFile)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(string(data), "limit differently") && !strings.Contains(string(data), "no name") {
				t.Errorf("no word in the log of a handler named \"default\" and an unnamed one, which share buckets:\n%s", data)
			}
		})
	}
}

// The running handlers a request reads are a snapshot that no register or
// unregister changes: a give-back that looked up its policy's handlers
// goes on with the ones it found, without a lock, while configs load and
// unload.
func TestTheRunningHandlersAReaderHoldsDoNotChange(t *testing.T) {
	t.Parallel()
	a, b := &Handler{Name: "snapshot"}, &Handler{Name: "snapshot"}
	a.register()
	defer a.unregister()
	held := runningHandlers()["snapshot"]
	b.register()
	if got := runningHandlers()["snapshot"]; len(got) != 2 || got[1] != b {
		t.Fatalf("after the second register: %v, want both, the newest last", got)
	}
	b.unregister()
	a.unregister()
	if len(held) != 1 || held[0] != a {
		t.Fatalf("the snapshot read before: %v, want the first handler alone", held)
	}
	if got := runningHandlers()["snapshot"]; got != nil {
		t.Fatalf("after both unregistered: %v, want none", got)
	}
	a.register() // for the deferred unregister
}

// Two handlers of one policy on two ports that list their keyers in
// another order, the second with one keyer fewer, share the bucket of a
// client that the same keyer names in both, and of one named by its IP.
func TestHandlersOfOnePolicyThatOrderTheirKeyersApartShareBuckets(t *testing.T) {
	a, b := freePort(t), freePort(t)
	cfg, err := adaptCaddyfile(fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 2 1/h {
		name keyer_order
		key header X-A
		key header X-B
	}
	respond "a"
}
http://127.0.0.1:%d {
	rate_limit 2 1/h {
		name keyer_order
		key header X-B
	}
	respond "b"
}`, a, b))
	if err != nil {
		t.Fatal(err)
	}
	s := serveConfig(t, a, cfg)
	other := *s
	other.base = fmt.Sprintf("http://127.0.0.1:%d", b)
	for _, client := range [][]string{{"X-B: bee"}, {}} {
		codes := fmt.Sprint(s.get("/", client...).status, s.get("/", client...).status, other.get("/", client...).status)
		if codes != "200 200 429" {
			t.Errorf("client %q: two to a, then one to b: %s; want 200 200 429, one bucket", client, codes)
		}
	}
}
