package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Hostile input: what an attacker controls is the number of keys and the
// size and shape of everything in a request. None of it may exhaust memory,
// hang a request, cause a 5xx, or get a request past its limit.

// hostileSite serves a policy of capacity 3, 1/h, that names the client by
// a verified JWT, a header, a cookie, a JSON or form field, then the IP, on
// a server that accepts headers up to 2 MB (Caddy's default is 16 KiB).
func hostileSite(t *testing.T) *testServer {
	t.Helper()
	port := freePort(t)
	s := serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
		max_header_size 2MB
	}
}
http://127.0.0.1:%d {
	rate_limit 3 1/h {
		key jwt sub
		key header X-API-Key
		key cookie session
		key json user.name
		key form username
		jwt {
			secret "a secret the attacker does not know"
		}
	}
	respond "ok"
}
`, port))
	s.client.Timeout = 20 * time.Second
	return s
}

// TestHostileRequestsAreAnsweredAndLimitedExactly sends, for each kind of
// hostile request, five in a row from one client: each is answered within
// the client's timeout, never with a 5xx, and exactly three pass.
func TestHostileRequestsAreAnsweredAndLimitedExactly(t *testing.T) {
	s := hostileSite(t)
	mb := strings.Repeat("k", 1<<20)
	huge := strings.Repeat("x", 8<<20)
	forged := "eyJhbGciOiJIUzI1NiJ9." + strings.Repeat("A", 1<<20) + ".sig"
	none := "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0.eyJzdWIiOiJ2aWN0aW0ifQ."
	for i, c := range []struct {
		name    string
		method  string
		body    string
		headers []string
	}{
		{"1 MB API key", "GET", "", []string{"X-API-Key: " + mb}},
		{"1 MB cookie", "GET", "", []string{"Cookie: session=" + mb}},
		{"a thousand cookies", "GET", "", []string{"Cookie: " + strings.Repeat("c=1; ", 1000) + "session=last"}},
		{"1 MB forged JWT", "GET", "", []string{"Authorization: Bearer " + forged}},
		{"unsigned JWT", "GET", "", []string{"Authorization: Bearer " + none}},
		{"many headers", "GET", "", manyHeaders(2000)},
		{"8 MB JSON body", "POST", `{"user":{"name":"` + huge + `"}}`, []string{"Content-Type: application/json"}},
		{"malformed JSON", "POST", `{"user":{"name":`, []string{"Content-Type: application/json"}},
		{"deep JSON", "POST", strings.Repeat(`{"user":`, 10000), []string{"Content-Type: application/json"}},
		{"8 MB form", "POST", "username=" + huge, []string{"Content-Type: application/x-www-form-urlencoded"}},
		{"malformed multipart", "POST", "--b\r\nContent-Disposition: form-data; name=\"username\"\r\n\r\nalice", []string{"Content-Type: multipart/form-data; boundary=b"}},
		{"multipart without boundary", "POST", "x", []string{"Content-Type: multipart/form-data"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Each case is its own client, so that those keyed by IP
			// get their own bucket.
			ip := "127.0.3." + strconv.Itoa(i+1)
			allowed := 0
			for n := range 5 {
				start := time.Now()
				r := s.do(c.method, "/", c.body, append(c.headers, "X-Forwarded-For: "+ip)...)
				if r.status >= 500 {
					t.Fatalf("request %d: status %d %q", n+1, r.status, r.body)
				}
				if d := time.Since(start); d > 10*time.Second {
					t.Fatalf("request %d took %s", n+1, d)
				}
				switch r.status {
				case 200:
					allowed++
				case 429:
				default:
					t.Fatalf("request %d: status %d %q, want 200 or 429", n+1, r.status, r.body)
				}
			}
			if allowed != 3 {
				t.Fatalf("%d of 5 allowed, want exactly the capacity 3", allowed)
			}
		})
	}
}

// TestHeadersOverTheServersLimitGet431 shows that what the server refuses
// to read is refused before the limiter, with a 4xx: never a 5xx, never a
// hang.
func TestHeadersOverTheServersLimitGet431(t *testing.T) {
	s := hostileSite(t)
	for _, h := range []string{"X-API-Key: " + strings.Repeat("k", 3<<20), "Cookie: session=" + strings.Repeat("c", 3<<20)} {
		r := s.do("GET", "/", "", h)
		if r.status != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("a 3 MB header: status %d, want 431", r.status)
		}
	}
}

func manyHeaders(n int) []string {
	h := make([]string, n)
	for i := range h {
		h[i] = fmt.Sprintf("X-Junk-%d: %s", i, strings.Repeat("j", 100))
	}
	return h
}
