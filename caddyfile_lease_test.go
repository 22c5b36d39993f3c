package ratelimit

import (
	"strings"
	"testing"
	"time"
)

func TestLeaseCaddyfile(t *testing.T) {
	t.Parallel()
	cfg, err := adaptSite(`rate_limit 200 50/s {
		store redis {
			address redis://127.0.0.1:6379
			lease 10%
			lease_ttl 2s
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	store := handlerJSON(t, cfg)["store"].(map[string]any)
	if store["lease"] != "10%" || store["lease_ttl"] != float64(2*time.Second) {
		t.Errorf("store JSON %v, want lease 10%% and lease_ttl 2s", store)
	}
	for _, tt := range []struct{ lines, want string }{
		{"lease 0", `lease "0"`},
		{"lease 150%", `lease "150%"`},
		{"lease", "lease: want exactly one value"},
		{"lease 5\n lease 6", "lease: given twice"},
		{"lease_ttl 0s", "lease_ttl"},
	} {
		_, err := adaptSite("rate_limit 10 1/s {\n store redis {\n " + tt.lines + "\n }\n }")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.lines, err, tt.want)
		}
	}
}
