package ratelimit

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Fuzz targets for the keyers that read headers and Caddy's variables. Each
// checks the same invariants: no panic; the same request gives the same key
// twice; a key never comes from a source the request does not have; a key
// reported as found is never empty.

// keyTwice runs the keyer twice on the request and fails when the runs
// disagree, or when a found key is empty.
func keyTwice(t *testing.T, k Keyer, r *http.Request) ([]byte, bool) {
	t.Helper()
	v1, ok1 := k.Key(r, nil)
	v2, ok2 := k.Key(r, []byte("prefix:"))
	if ok1 != ok2 || ok2 && !bytes.Equal(v2, append([]byte("prefix:"), v1...)) {
		t.Fatalf("the same request keyed twice: %q %v, then %q %v", v1, ok1, v2, ok2)
	}
	if !ok1 && len(v1) != 0 {
		t.Fatalf("nothing found, but %q appended", v1)
	}
	if ok1 && len(v1) == 0 {
		t.Fatal("an empty key reported as found")
	}
	return v1, ok1
}

// withClientIP is the request as Caddy hands it to handlers, with the
// client_ip variable set to ip ("" leaves it unset).
func withClientIP(r *http.Request, ip string) *http.Request {
	vars := map[string]any{}
	if ip != "" {
		vars[caddyhttp.ClientIPVarKey] = ip
	}
	return r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
}

func FuzzIPKeyer(f *testing.F) {
	f.Add("127.0.0.1:1234", "", uint8(32), uint8(64))
	f.Add("127.0.0.1:1234", "203.0.113.9", uint8(24), uint8(48))
	f.Add("[::1]:80", "2001:db8::1%eth0", uint8(32), uint8(64))
	f.Add("[::ffff:10.0.0.1]:80", "::ffff:10.0.0.1", uint8(8), uint8(128))
	f.Add("garbage", "also garbage", uint8(0), uint8(200))
	f.Add("", "", uint8(1), uint8(1))
	f.Fuzz(func(t *testing.T, remote, clientIP string, v4, v6 uint8) {
		k := &IPKeyer{IPv4Prefix: int(v4), IPv6Prefix: int(v6)}
		if err := k.Provision(caddy.Context{}); err != nil {
			return
		}
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		r.RemoteAddr = remote
		r.Header.Set("X-Forwarded-For", "198.51.100.1") // never read
		r = withClientIP(r, clientIP)
		v, ok := keyTwice(t, k, r)

		// The address the keyer should have read: client_ip, else the
		// connection's peer.
		src := clientIP
		if src == "" {
			src = remote
			if host, _, err := net.SplitHostPort(remote); err == nil {
				src = host
			}
		}
		addr, err := netip.ParseAddr(src)
		if err != nil {
			if ok {
				t.Fatalf("key %q from no address (remote %q, client_ip %q)", v, remote, clientIP)
			}
			return
		}
		if !ok {
			t.Fatalf("no key from address %s", addr)
		}
		got, err := netip.ParseAddr(string(v))
		if err != nil {
			t.Fatalf("key %q is not an address", v)
		}
		addr = addr.Unmap().WithZone("")
		bits := k.IPv6Prefix
		if addr.Is4() {
			bits = k.IPv4Prefix
		}
		want, _ := addr.Prefix(bits)
		if got != want.Addr() {
			t.Fatalf("key %s for %s, want the network %s", got, addr, want)
		}
		if string(v) == "198.51.100.1" && src != "198.51.100.1" {
			t.Fatal("the key came from X-Forwarded-For")
		}
	})
}

func FuzzHeaderKeyer(f *testing.F) {
	f.Add("X-API-Key", "key-1", "")
	f.Add("x-api-key", "", "second")
	f.Add("X-Api-Key", strings.Repeat("k", 4096), "")
	f.Add("Other", "v", "w")
	f.Add("X-API-Key", "junk", "REAL")
	f.Add("", "\x00\xff", "")
	k := &HeaderKeyer{Field: "X-API-Key"}
	if err := k.Provision(caddy.Context{}); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, name, first, second string) {
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		r.Header = http.Header{}
		if name != "" {
			r.Header.Add(name, first)
			if second != "" {
				r.Header.Add(name, second)
			}
		}
		v, ok := keyTwice(t, k, r)
		values := r.Header.Values("X-Api-Key")
		switch {
		case len(values) != 1 || values[0] == "":
			if ok {
				t.Fatalf("key %q, but the request has not one X-Api-Key value (header %q: %q)", v, name, values)
			}
		case !ok || string(v) != values[0]:
			t.Fatalf("key %q %v, want the one value %q", v, ok, values[0])
		}
	})
}

func FuzzCookieKeyer(f *testing.F) {
	f.Add("session=abc", "")
	f.Add("a=1; session=\"quoted\"; b=2", "session=second")
	f.Add("session=; session=x", "")
	f.Add("sessionx=1;xsession=2", "session=3")
	f.Add(";;;=;session", "")
	f.Add("session=\"", "")
	f.Add(strings.Repeat("c=1; ", 1000)+"session=last", "")
	f.Add("session=junk; session=REAL", "")
	f.Add("session=junk, session=REAL", "")
	f.Add("session=junk; a=1 session=REAL", "")
	f.Add(`session="R\105AL"`, "")
	f.Add("session=junk; Session=REAL", "session =REAL")
	f.Add("sess%69on=REAL; session=junk", "")
	f.Add("session=%52E%41L", "")
	f.Add("session=R%zzEAL", "")
	f.Add("session%00=REAL; session=junk", "")
	f.Add("session=a+b", "session.sig=x; .AspNetCore.Session=y")
	k := &CookieKeyer{Name: "session"}
	if err := k.Provision(caddy.Context{}); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, line1, line2 string) {
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		r.Header = http.Header{}
		for _, l := range []string{line1, line2} {
			if l != "" {
				r.Header.Add("Cookie", l)
			}
		}
		v, ok := keyTwice(t, k, r)
		all := strings.Join(r.Header["Cookie"], ";")
		if !strings.Contains(all, "session") {
			if ok {
				t.Fatalf("key %q from cookies with no session cookie: %q", v, all)
			}
			return
		}
		if !ok {
			return
		}
		// The key is the value of the one session pair, quotes aside and
		// percent-decoded (a space read as "+"); no other pair could be
		// read as the session cookie, not even cut at a NUL byte.
		var values []string
		for part := range strings.SplitSeq(all, ";") {
			name, value, _ := strings.Cut(strings.TrimSpace(part), "=")
			name, value = strings.TrimSpace(name), strings.TrimSpace(value)
			decoded, err := url.QueryUnescape(name)
			decoded, _, _ = strings.Cut(decoded, "\x00")
			switch {
			case name == "session":
				values = append(values, value)
			case strings.EqualFold(name, "session") || strings.ContainsAny(value, " ,") && strings.Contains(value, "session"),
				err == nil && strings.EqualFold(strings.TrimSpace(decoded), "session"):
				t.Fatalf("key %q, but the pair %q could be read as the session cookie", v, part)
			}
		}
		if len(values) != 1 {
			t.Fatalf("key %q, but the session pairs of %q are %q: want one", v, all, values)
		}
		want := values[0]
		if len(want) >= 2 && want[0] == '"' && want[len(want)-1] == '"' {
			want = want[1 : len(want)-1]
		}
		if strings.Contains(want, "%") {
			d, err := url.PathUnescape(want)
			if err != nil {
				t.Fatalf("key %q from a value with a malformed escape, %q", v, values[0])
			}
			want = strings.ReplaceAll(d, " ", "+")
		}
		if string(v) != want {
			t.Fatalf("key %q, but the session pair of %q is %q, which reads as %q", v, all, values[0], want)
		}
		if strings.ContainsAny(values[0], " ,\\") {
			t.Fatalf("key %q from a value that lenient parsers split or unescape", v)
		}
	})
}

func FuzzPlaceholderKeyer(f *testing.F) {
	f.Add("{http.request.header.X-User}", "alice", true)
	f.Add("{http.request.header.X-User}", "", true)
	f.Add("{http.request.header.X-User}", "{http.request.uri}", true)
	f.Add("{http.request.header.X-User}-{http.request.method}", "bob", false)
	f.Add("{unknown.placeholder}", "x", true)
	f.Add("{", "x", true)
	f.Add("{{}}{http.request.header.X-User", "x", true)
	f.Add("\\{http.request.header.X-User}", "x", true)
	f.Fuzz(func(t *testing.T, template, user string, setUser bool) {
		k := &PlaceholderKeyer{Value: template}
		if err := k.Provision(caddy.Context{}); err != nil {
			return
		}
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		if setUser {
			r.Header.Set("X-User", user)
		}
		// Without a replacer there is nothing to read.
		if v, ok := k.Key(r, nil); ok {
			t.Fatalf("key %q from a request without a replacer", v)
		}
		repl := caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
		v, ok := keyTwice(t, k, r)
		if template != "{http.request.header.X-User}" {
			return
		}
		// The single header placeholder: the header's value, verbatim
		// (never expanded again), or nothing when it is absent or empty.
		got := r.Header.Get("X-User")
		if got == "" && ok || got != "" && (!ok || string(v) != got) {
			t.Fatalf("key %q %v for X-User %q", v, ok, got)
		}
	})
}
