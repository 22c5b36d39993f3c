package ratelimit

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestExampleCaddyfile runs example.Caddyfile as the README does, on free
// ports: a TLS edge with tiers in front of an origin.
func TestExampleCaddyfile(t *testing.T) {
	src, err := os.ReadFile("example.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	edge, origin, httpPort := freePort(t), freePort(t), freePort(t)
	cfg := strings.NewReplacer(
		"admin 127.0.0.1:2019", "admin off",
		"8443", strconv.Itoa(edge),
		"9080", strconv.Itoa(origin),
		"http_port 8080", "http_port "+strconv.Itoa(httpPort),
	).Replace(string(src))
	useFakeClock(t)
	serveCaddyfile(t, edge, cfg)

	// Like curl -k https://localhost:<edge>/, but always to 127.0.0.1.
	transport := &http.Transport{
		TLSClientConfig: &tls.Config{ServerName: "localhost", InsecureSkipVerify: true},
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, "127.0.0.1:"+strconv.Itoa(edge))
		},
	}
	defer transport.CloseIdleConnections()
	client := &http.Client{Transport: transport, Timeout: 10 * time.Second}
	// On a machine where Caddy has never run, the local CA issues the
	// certificate for localhost after the server starts; a handshake
	// before that fails. Wait for it with handshakes alone, which take no
	// token.
	waitFor(t, 30*time.Second, "the certificate for localhost", func() bool {
		conn, err := tls.Dial("tcp", "127.0.0.1:"+strconv.Itoa(edge), &tls.Config{ServerName: "localhost", InsecureSkipVerify: true})
		if err != nil {
			return false
		}
		conn.Close()
		return true
	})
	get := func(headers ...string) (int, http.Header, string) {
		req, _ := http.NewRequest("GET", "https://localhost:"+strconv.Itoa(edge)+"/", nil)
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(body)
	}

	var codes []string
	for range 7 {
		code, _, _ := get()
		codes = append(codes, strconv.Itoa(code))
	}
	if got := strings.Join(codes, " "); got != "200 200 200 200 200 429 429" {
		t.Errorf("anonymous burst: %s, want 5 × 200 then 429s", got)
	}
	code, hdr, body := get()
	if code != 429 || hdr.Get("Retry-After") != "10" || hdr.Get("X-RateLimit-Limit") != "5" || hdr.Get("X-RateLimit-Remaining") != "0" {
		t.Errorf("rejection: %d, Retry-After %q, Limit %q, Remaining %q; want 429, 10, 5, 0", code, hdr.Get("Retry-After"), hdr.Get("X-RateLimit-Limit"), hdr.Get("X-RateLimit-Remaining"))
	}
	checkProblem(t, hdr, body, problem{
		Type: "about:blank", Title: "Too Many Requests", Status: 429,
		Detail: "Rate limit exceeded on tier default: retry in 10 s.",
		Policy: "edge", Tier: "default", Limit: 5, RetryAfter: 10,
	})
	if code, _, body := get("X-API-Key", "demo-key-1"); code != 200 || body != "origin: limit=20 remaining=19\n" {
		t.Errorf("api tier: %d %q, want 200 and the origin's echo of the api tier's headers", code, body)
	}
	var botCodes []string
	for range 3 {
		code, _, _ := get("User-Agent", "examplebot/1.0")
		botCodes = append(botCodes, strconv.Itoa(code))
	}
	if got := strings.Join(botCodes, " "); got != "200 200 429" {
		t.Errorf("bots: %s, want 200 200 429", got)
	}
	_, hdr, body = get("User-Agent", "examplebot/1.0")
	checkProblem(t, hdr, body, problem{
		Type: "about:blank", Title: "Too Many Requests", Status: 429,
		Detail: "Rate limit exceeded on tier bots: retry in 60 s.",
		Policy: "edge", Tier: "bots", Limit: 2, RetryAfter: 60,
	})
}

// problem is the RFC 9457 body that example.Caddyfile's handle_errors 429
// answers a refusal with.
type problem struct {
	Type       string `json:"type"`
	Title      string `json:"title"`
	Status     int    `json:"status"`
	Detail     string `json:"detail"`
	Policy     string `json:"policy"`
	Tier       string `json:"tier"`
	Limit      int    `json:"limit"`
	RetryAfter int    `json:"retry_after"`
}

// checkProblem checks that a refusal's body is application/problem+json,
// with the fields want has and no others.
func checkProblem(t *testing.T, hdr http.Header, body string, want problem) {
	t.Helper()
	if ct := hdr.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("refusal's Content-Type %q, want application/problem+json", ct)
	}
	dec := json.NewDecoder(strings.NewReader(body))
	dec.DisallowUnknownFields()
	var got problem
	if err := dec.Decode(&got); err != nil {
		t.Fatalf("refusal's body is not the problem object: %v\n%s", err, body)
	}
	if got != want {
		t.Errorf("refusal's body %+v, want %+v", got, want)
	}
	if ra := hdr.Get("Retry-After"); ra != strconv.Itoa(want.RetryAfter) {
		t.Errorf("Retry-After %q, want the body's retry_after %d", ra, want.RetryAfter)
	}
}
