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
