package ratelimit

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// serveLoggingTo is serve with Caddy's default log going to a file at
// INFO, whose path it returns.
func serveLoggingTo(t *testing.T, directives string) (*testServer, string) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "caddy.log")
	port := freePort(t)
	s := serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
	skip_install_trust
	log {
		output file %s
		level INFO
	}
}
http://127.0.0.1:%d {
%s
}
`, file, port, directives))
	return s, file
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
				if strings.Contains(line, "503") || strings.Contains(line, "store") || strings.Contains(line, "redis") || strings.Contains(line, `"error"`) {
					about = append(about, line)
				}
			}
			if len(about) > 10 {
				t.Fatalf("%d log lines about 200 refusals with Redis down, want a few; the first:\n%s", len(about), strings.Join(about[:3], "\n"))
			}
		})
	}
}
