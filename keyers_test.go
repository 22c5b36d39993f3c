package ratelimit

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// A remote address that does not parse as an IP (a listener wrapper or
// another module set it) names the client by itself: such clients do not
// share one bucket.
func TestUnparseableRemoteAddressesGetTheirOwnBuckets(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandler(t, `{"name":"odd-addr","tiers":[{"name":"default","capacity":1,"refill":"1/h"}]}`)
	defer done()
	take := func(remote string) bool {
		r := benchRequest("") // no client_ip: the remote address decides
		r.RemoteAddr = remote
		return h.ServeHTTP(&headerSink{h: make(http.Header)}, r, nopHandler) == nil
	}
	for _, remote := range []string{"peer-a", "peer-b", "[garbage]:1"} {
		if !take(remote) {
			t.Errorf("first request from %q was refused: it shares a bucket with another client", remote)
		}
	}
	if take("peer-a") {
		t.Errorf("second request from peer-a was allowed by a bucket of capacity 1")
	}
}

// On a Unix socket every client's remote address is "@". Without
// trusted_proxies_unix the client IP cannot name anyone, so the config is
// refused; with it, Caddy reads the client IP from the proxy's header and
// each client has its own bucket.
func TestUnixSocketListener(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "edge.sock")
	caddyfile := func(serverOpts string) string {
		return fmt.Sprintf(`{
	admin off
	skip_install_trust
	servers {
		%s
	}
}
http:// {
	bind unix/%s
	rate_limit 1 1/h
	respond "ok"
}`, serverOpts, sock)
	}

	cfg, err := adaptCaddyfile(caddyfile("max_header_size 1MB"))
	if err != nil {
		t.Fatal(err)
	}
	err = loadAndStop(cfg)
	if err == nil {
		t.Fatal("a Unix socket listener without trusted_proxies_unix loaded; want an error")
	}
	for _, want := range []string{"Unix socket", "trusted_proxies_unix"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}

	cfg, err = adaptCaddyfile(caddyfile("trusted_proxies_unix"))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("loading with trusted_proxies_unix: %v", err)
	}
	t.Cleanup(func() { _ = caddy.Stop(); _ = os.Remove(sock) })
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return new(net.Dialer).DialContext(ctx, "unix", sock)
	}}}
	status := func(ip string) int {
		req, _ := http.NewRequest(http.MethodGet, "http://edge/", nil)
		req.Header.Set("X-Forwarded-For", ip)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if a, b, again := status("127.0.0.2"), status("127.0.0.3"), status("127.0.0.2"); a != 200 || b != 200 || again != 429 {
		t.Errorf("over the socket: client A %d, client B %d, A again %d; want 200 200 429", a, b, again)
	}
}

func TestHeaderKeyerGivesEachKeyItsBucketAndFallsBackToIP(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/h {
		key header X-API-Key
	}
	respond "ok"`)
	s.expectSteps([]step{
		{"127.0.0.9", "/", "X-API-Key: alpha", 200},
		{"127.0.0.9", "/", "X-API-Key: alpha", 429},
		{"127.0.0.9", "/", "X-API-Key: beta", 200}, // its own bucket
		// No key: the client IP names the client, one bucket per address.
		{"127.0.0.2", "/", "", 200},
		{"127.0.0.2", "/", "", 429},
		{"127.0.0.3", "/", "", 200},
	})
}

func TestCookieAndPlaceholderKeyers(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/h {
		key cookie session
		key placeholder {http.request.uri.query.user}
	}
	respond "ok"`)
	s.expectSteps([]step{
		{"127.0.0.9", "/", "Cookie: theme=dark; session=s1", 200},
		{"127.0.0.9", "/", "Cookie: session=s1", 429},
		{"127.0.0.9", "/", "Cookie: session=\"s2\"; theme=dark", 200},
		{"127.0.0.9", "/?user=ann", "Cookie: theme=dark", 200},
		{"127.0.0.9", "/?user=ann", "Cookie: other=s1", 429},
		{"127.0.0.9", "/?user=bob", "Cookie: session=", 200},
	})
}

func TestIPPrefixGroupsClients(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 1 1/h {
		key ip /24
	}
	respond "ok"`)
	s.expectSteps([]step{
		{"127.0.5.1", "/", "", 200},
		{"127.0.5.200", "/", "", 429}, // the same /24
		{"127.0.6.1", "/", "", 200},   // another /24
	})
}

func TestForwardedForIsIgnoredWithoutTrustedProxies(t *testing.T) {
	useFakeClock(t)
	port := freePort(t)
	s := serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	rate_limit 1 1/h
	respond "ok"
}`, port))
	s.from("127.0.0.2", "/")
	if r := s.from("127.0.0.3", "/"); r.status != 429 {
		t.Fatalf("a forged X-Forwarded-For got a fresh bucket: %d, want 429", r.status)
	}
}

// escapeSome writes REAL with the letters that the bits of i pick as
// octal escapes, which Python's http.cookies decodes: "R\105AL" is REAL.
func escapeSome(i int) string {
	var b strings.Builder
	for j, c := range "REAL" {
		if i&(1<<j) != 0 {
			fmt.Fprintf(&b, `\%03o`, c)
		} else {
			b.WriteRune(c)
		}
	}
	return b.String()
}

// Regression test for issue 32 item 2: Python's http.cookies reads the last
// of two cookies of one name, splits on spaces and decodes escapes.
func TestACookieThatParsersCouldReadTwoWaysNamesNobody(t *testing.T) {
	useFakeClock(t)
	for _, c := range []struct {
		name    string
		cookies func(i int) []string
	}{
		{"twice in one line", func(i int) []string { return []string{fmt.Sprintf("Cookie: session=junk%d; session=REAL", i)} }},
		{"in two lines", func(i int) []string {
			return []string{fmt.Sprintf("Cookie: session=junk%d", i), "Cookie: session=REAL"}
		}},
		{"a space before the equals sign", func(i int) []string {
			return []string{fmt.Sprintf("Cookie: session=junk%d; session =REAL", i)}
		}},
		{"in another case", func(i int) []string { return []string{fmt.Sprintf("Cookie: session=junk%d; Session=REAL", i)} }},
		{"after a comma", func(i int) []string { return []string{fmt.Sprintf("Cookie: session=junk%d, session=REAL", i)} }},
		{"after a space", func(i int) []string { return []string{fmt.Sprintf("Cookie: session=junk%d; a=1 session=REAL", i)} }},
		{"escaped", func(i int) []string { return []string{`Cookie: session="` + escapeSome(i+1) + `"`} }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, o := guessSite(t, "cookie session")
			if got := sendGuesses(t, s, o, 10, func(i int) guess { return guess{headers: c.cookies(i)} }); got > 3 {
				t.Errorf("%d of 10 guesses on one session reached the origin, want at most the bucket's 3", got)
			}
		})
	}
}

// Regression test for issue 32 item 3: origins differ on which of two
// lines wins.
func TestARepeatedHeaderNamesNobody(t *testing.T) {
	useFakeClock(t)
	s, o := guessSite(t, "header X-API-Key")
	got := sendGuesses(t, s, o, 10, func(i int) guess {
		return guess{headers: []string{fmt.Sprintf("X-API-Key: junk%d", i), "X-API-Key: REAL"}}
	})
	if got > 3 {
		t.Errorf("%d of 10 guesses on one key reached the origin, want at most the bucket's 3", got)
	}
}

// A client that sends another client's IP address as its API key gets a
// bucket of its own, not that address's: keyers name clients in their own
// namespaces.
func TestAHeaderValueEqualToAnIPDoesNotShareItsBucket(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	rate_limit 2 1/h {
		key header X-API-Key
	}
	respond "ok"`)
	s.expectSteps([]step{
		{"127.0.0.9", "/", "X-API-Key: 127.0.0.5", 200},
		{"127.0.0.9", "/", "X-API-Key: 127.0.0.5", 200},
		{"127.0.0.9", "/", "X-API-Key: 127.0.0.5", 429},
		{"127.0.0.5", "/", "", 200}, // the address's own bucket is full
		{"127.0.0.5", "/", "", 200},
		{"127.0.0.5", "/", "", 429},
	})
}

// The header and cookie keyers check for repeated and lenient spellings
// without allocating, so that the common path costs what it did.
func TestHeaderAndCookieKeyersDoNotAllocate(t *testing.T) {
	hk, ck := &HeaderKeyer{Field: "X-API-Key"}, &CookieKeyer{Name: "session"}
	if err := hk.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	if err := ck.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	r, _ := http.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
	r.Header.Set("X-API-Key", "key-1")
	r.Header.Set("Cookie", `theme=dark; session="s1"; lang=en-GB`)
	buf := make([]byte, 0, 64)
	for _, k := range []Keyer{hk, ck} {
		if v, ok := k.Key(r, buf); !ok || len(v) == 0 {
			t.Fatalf("%s: no key", k.ID())
		}
		if n := testing.AllocsPerRun(100, func() { k.Key(r, buf) }); n != 0 {
			t.Errorf("%s: %v allocations a request, want 0", k.ID(), n)
		}
	}
}

// pctSome writes REAL with the letters that the bits of i pick
// percent-encoded, which Express's cookie parser and PHP decode.
func pctSome(i int) string {
	var b strings.Builder
	for j, c := range "REAL" {
		if i&(1<<j) != 0 {
			fmt.Fprintf(&b, "%%%02X", c)
		} else {
			b.WriteRune(c)
		}
	}
	return b.String()
}

// Express's cookie parser and PHP percent-decode cookie values, and PHP
// ends a cookie's name at a NUL byte and keeps the first of two: each
// spelling here is the one session REAL to them.
func TestSpellingsOfOneCookieGetNoFreshBuckets(t *testing.T) {
	useFakeClock(t)
	for _, c := range []struct {
		name    string
		cookies func(i int) string
	}{
		{"percent-encoded", func(i int) string { return "Cookie: session=" + pctSome(i+1) }},
		{"a NUL byte after the name", func(i int) string { return fmt.Sprintf("Cookie: session%%00=REAL; session=junk%d", i) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, o := guessSite(t, "cookie session")
			if got := sendGuesses(t, s, o, 10, func(i int) guess { return guess{headers: []string{c.cookies(i)}} }); got > 3 {
				t.Errorf("%d of 10 guesses on one session reached the origin, want at most the bucket's 3", got)
			}
		})
	}
}

// RFC 2109's $Version and $Path attributes do not hide a second cookie of
// the name from the keyer.
func TestACookieBesideRFC2109AttributesStillCountsTwice(t *testing.T) {
	useFakeClock(t)
	s, o := guessSite(t, "cookie session")
	got := sendGuesses(t, s, o, 10, func(i int) guess {
		return guess{headers: []string{fmt.Sprintf(`Cookie: $Version="1"; session=junk%d; $Path="/"; session=REAL; $Path="/"`, i)}}
	})
	if got > 3 {
		t.Errorf("%d of 10 guesses on one session reached the origin, want at most the bucket's 3", got)
	}
}

// The cookies that frameworks set beside a session, and a session value
// that a client percent-encodes, leave the session named: Express's
// cookie-session signs session in session.sig, ASP.NET Core names its own
// cookies with dots.
func TestCookiesBesideASessionStillLetItNameTheClient(t *testing.T) {
	t.Parallel()
	k := &CookieKeyer{Name: "session"}
	if err := k.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ cookies, want string }{
		{"session=eyJ1IjoxfQ==; session.sig=abc", "eyJ1IjoxfQ=="},
		{".AspNetCore.Session=x; .AspNetCore.Antiforgery.a1=y; session=s1", "s1"},
		{"_ga=GA1.2.3; sessionid=z; session_token=w; session=s1", "s1"},
		{"session=a%2Fb%3D", "a/b="},
		{"session=a+b", "a+b"},
		{"session=a%20b", "a+b"},
	} {
		r, _ := http.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		r.Header.Set("Cookie", c.cookies)
		if got, ok := k.Key(r, nil); !ok || string(got) != c.want {
			t.Errorf("%q: Key = %q, %v; want %q", c.cookies, got, ok, c.want)
		}
	}
}
