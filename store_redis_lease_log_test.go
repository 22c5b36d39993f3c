package ratelimit

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// A lease share above half a capacity is capped at half, since the tokens
// out on lease never pass it: a config that asks for more says so in the
// log once, as it loads, naming the setting and the cap; one within the
// cap logs nothing of it. Nothing needs to listen on Redis's address: a
// store's provision never calls it.
// Regression test for issue 31 item 5.
func TestLeaseShareAboveHalfIsLoggedAsCapped(t *testing.T) {
	for _, tt := range []struct {
		lease  string
		logged bool
	}{
		{"80%", true},
		{"50%", false},
		{"10%", false},
	} {
		t.Run(tt.lease, func(t *testing.T) {
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			port := freePort(t)
			serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
	log {
		output file %s
		level INFO
	}
}

http://127.0.0.1:%d {
	rate_limit 10 1/s {
		name lease_log
		store redis {
			address redis://127.0.0.1:%d
			lease %s
		}
	}
	respond "ok"
}
`, logFile, port, freePort(t), tt.lease))
			data, err := os.ReadFile(logFile)
			if err != nil {
				t.Fatal(err)
			}
			var capped []string
			for _, line := range strings.Split(string(data), "\n") {
				if strings.Contains(line, "capped") {
					capped = append(capped, line)
				}
			}
			if !tt.logged {
				if len(capped) > 0 {
					t.Errorf("lease %s logged a cap: %q", tt.lease, capped)
				}
				return
			}
			if len(capped) != 1 || !strings.Contains(capped[0], "lease "+tt.lease) || !strings.Contains(capped[0], "50%") {
				t.Errorf("lease %s logged %q; want one line that names the setting and the cap, 50%%\n%s", tt.lease, capped, data)
			}
		})
	}
}

// A lease given as a number of tokens is capped the same way: `lease 8`
// on a tier of capacity 10 takes at most 5 at once. The config says so in
// the log as it loads, as a share above 50% does.
func TestLeaseOfTokensAboveHalfACapacityIsLoggedAsCapped(t *testing.T) {
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	port := freePort(t)
	serveCaddyfile(t, port, fmt.Sprintf(`{
	admin off
	log {
		output file %s
		level INFO
	}
}

http://127.0.0.1:%d {
	rate_limit 10 1/s {
		name lease_tokens_log
		store redis {
			address redis://127.0.0.1:%d
			lease 8
		}
	}
	respond "ok"
}
`, logFile, port, freePort(t)))
	data, err := os.ReadFile(logFile)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), "capped") {
		t.Errorf("lease 8 on a capacity of 10 logged no cap:\n%s", data)
	}
}
