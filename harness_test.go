package ratelimit

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// The end-to-end tests run real Caddyfiles through this process's Caddy,
// one config at a time, on loopback ports (serveConfig). They run one at
// a time, without t.Parallel(): Caddy has one config, and useFakeClock
// sets the clocks of the handlers it loads (systemClocks). Every other
// test, a handler provisioned alone (provisionedHandlerOn, with its own
// clocks and policy name), a Redis store on its own redis-server, a fleet
// of Caddy processes, a check of the docs, runs in parallel.

// testServer is a Caddy config loaded for one test.
type testServer struct {
	t      testing.TB
	base   string // http://127.0.0.1:port
	port   int
	client *http.Client
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort(t testing.TB) int {
	t.Helper()
	return redistest.FreePort(t)
}

// serve loads a site on a free loopback port whose body is directives, and
// trusts 127.0.0.1 as a proxy, so that tests name clients by sending
// X-Forwarded-For with other loopback addresses.
func serve(t testing.TB, directives string) *testServer {
	t.Helper()
	return serveWithGlobals(t, "admin off", directives)
}

// serveWithAdmin is serve with Caddy's admin API on another free loopback
// port, whose base URL it returns too.
func serveWithAdmin(t testing.TB, directives string) (*testServer, string) {
	t.Helper()
	admin := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	return serveWithGlobals(t, "admin "+admin, directives), "http://" + admin
}

// serveWithGlobals is serve with the global options given.
func serveWithGlobals(t testing.TB, globals, directives string) *testServer {
	t.Helper()
	port := freePort(t)
	return serveCaddyfile(t, port, siteCaddyfile(globals, port, directives))
}

// siteCaddyfile is a Caddyfile of the global options given, trusting
// 127.0.0.1 as a proxy, and one site on 127.0.0.1:port whose body is
// directives.
func siteCaddyfile(globals string, port int, directives string) string {
	return fmt.Sprintf(`{
	%s
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
%s
}
`, globals, port, directives)
}

// serveCaddyfile adapts and loads a whole Caddyfile that listens on
// 127.0.0.1:port, and stops Caddy when the test ends.
func serveCaddyfile(t testing.TB, port int, caddyfile string) *testServer {
	t.Helper()
	cfg, err := adaptCaddyfile(caddyfile)
	if err != nil {
		t.Fatalf("adapting Caddyfile: %v\n%s", err, caddyfile)
	}
	return serveConfig(t, port, cfg)
}

// serveConfig loads Caddy's JSON config cfg, which listens on
// 127.0.0.1:port, and stops Caddy when the test ends. Every test that
// serves through Caddy comes here: Caddy runs one config at a time, so
// these tests run one at a time.
func serveConfig(t testing.TB, port int, cfg []byte) *testServer {
	t.Helper()
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading config: %v\n%s", err, cfg)
	}
	transport := &http.Transport{MaxIdleConnsPerHost: 64}
	s := &testServer{
		t:      t,
		base:   fmt.Sprintf("http://127.0.0.1:%d", port),
		port:   port,
		client: &http.Client{Transport: transport, Timeout: 10 * time.Second},
	}
	t.Cleanup(func() {
		transport.CloseIdleConnections()
		if err := caddy.Stop(); err != nil {
			t.Errorf("stopping Caddy: %v", err)
		}
	})
	return s
}

// adaptCaddyfile turns a Caddyfile into Caddy's JSON, as `caddy adapt` does.
func adaptCaddyfile(caddyfile string) ([]byte, error) {
	cfg, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfile), map[string]any{"filename": "Caddyfile"})
	if err != nil {
		return nil, err
	}
	for _, w := range warnings {
		if !strings.Contains(w.Message, "formatted") {
			return nil, fmt.Errorf("warning: %s", w.String())
		}
	}
	return cfg, nil
}

// response is what a test request got back.
type response struct {
	status int
	header http.Header
	body   string
}

// get sends a GET for path, with header lines given as "Name: value".
func (s *testServer) get(path string, headers ...string) response {
	s.t.Helper()
	return s.do(http.MethodGet, path, "", headers...)
}

// from sends a GET as the client at the given loopback address.
func (s *testServer) from(ip, path string, headers ...string) response {
	s.t.Helper()
	return s.get(path, append(headers, "X-Forwarded-For: "+ip)...)
}

func (s *testServer) do(method, path, body string, headers ...string) response {
	s.t.Helper()
	req, err := http.NewRequest(method, s.base+path, strings.NewReader(body))
	if err != nil {
		s.t.Fatal(err)
	}
	for _, h := range headers {
		name, value, ok := strings.Cut(h, ":")
		if !ok {
			s.t.Fatalf("header %q: want Name: value", h)
		}
		req.Header.Add(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	resp, err := s.client.Do(req)
	if err != nil {
		s.t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return response{status: resp.StatusCode, header: resp.Header, body: string(b)}
}

// serveOne runs one request through a handler provisioned alone, with
// next as the rest of the route, and returns what the client gets and the
// handler's error: a refusal's status (a caddyhttp.HandlerError's) is the
// response's Code, any other error makes it 500, as Caddy answers. It
// fails no test itself, so a request may run in a goroutine of its own.
func serveOne(h *Handler, r *http.Request, next caddyhttp.Handler) (*httptest.ResponseRecorder, error) {
	w := httptest.NewRecorder()
	err := h.ServeHTTP(w, r, next)
	if he := (caddyhttp.HandlerError{}); errors.As(err, &he) {
		w.Code = he.StatusCode
	} else if err != nil {
		w.Code = http.StatusInternalServerError
	}
	return w, err
}

// fakeClock is a clock that moves only when a test moves it.
type fakeClock struct{ micros atomic.Int64 }

func (c *fakeClock) now() int64              { return c.micros.Load() }
func (c *fakeClock) advance(d time.Duration) { c.micros.Add(d.Microseconds()) }

// clocks are the clocks of a handler that reads c, for the local buckets
// and the record of denials alike.
func (c *fakeClock) clocks() clocks { return clocks{now: c.now, wall: c.now} }

// newFakeClock is a fake clock at 1 s, to hand to a handler provisioned
// alone (provisionedHandlerOn).
func newFakeClock() *fakeClock {
	c := new(fakeClock)
	c.micros.Store(1_000_000)
	return c
}

// useFakeClock makes the handlers provisioned from now on that no test
// handed a clock, those Caddy loads, read a fake clock until the test
// ends. Call it before loading a config. It sets the package's
// systemClocks, so its tests run one at a time (they load Caddy's one
// config anyway); a test of a handler alone passes its clock in
// (provisionedHandlerOn) and may run in parallel.
func useFakeClock(t testing.TB) *fakeClock {
	c := newFakeClock()
	old := systemClocks
	systemClocks = c.clocks()
	t.Cleanup(func() { systemClocks = old })
	return c
}

// loadAndStop loads a config that a test expects to be refused, and stops
// Caddy again if it loaded after all.
func loadAndStop(cfg []byte) error {
	if err := caddy.Load(cfg, true); err != nil {
		return err
	}
	return caddy.Stop()
}

// step is one request of a scripted test and the status it must get.
type step struct {
	from, path, header string // header "" sends none
	want               int
}

// expectSteps sends the steps in order, each as the client at its loopback
// address, and reports every status that differs.
func (s *testServer) expectSteps(steps []step) {
	s.t.Helper()
	for i, st := range steps {
		var headers []string
		if st.header != "" {
			headers = append(headers, st.header)
		}
		if r := s.from(st.from, st.path, headers...); r.status != st.want {
			s.t.Errorf("step %d (%s %s %q): %d, want %d", i+1, st.from, st.path, st.header, r.status, st.want)
		}
	}
}

// skipUnderShort skips a heavy load, fault-injection or long test under
// -short, the inner loop; CI runs everything.
func skipUnderShort(t *testing.T, kind string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("%s test: skipped under -short", kind)
	}
}

// raceEnabled is false in a build without -race (hostile_norace_test.go),
// where floods run at full size.
var raceEnabled = true
