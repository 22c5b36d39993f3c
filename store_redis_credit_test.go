package ratelimit

import (
	"strings"
	"testing"
)

// `credit <k>` in `store redis` (issue 35): it needs lease, and refuses a
// tier with a quota, each at adapt with the reason.
func TestCreditCaddyfile(t *testing.T) {
	t.Parallel()
	cfg, err := adaptSite(`rate_limit 200 50/s {
		store redis {
			address redis://127.0.0.1:6379
			lease 10%
			credit 2
		}
	}`)
	if err != nil {
		t.Fatal(err)
	}
	store := handlerJSON(t, cfg)["store"].(map[string]any)
	if store["credit"] != float64(2) {
		t.Errorf("store JSON %v, want credit 2", store)
	}
	for _, tt := range []struct{ site, want string }{
		{"rate_limit 10 1/s {\n store redis {\n credit 2\n }\n }", "credit 2 needs lease"},
		{"rate_limit 10 1/s {\n store redis {\n lease 1\n credit 2\n }\n }", "credit 2 needs lease"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit -1\n }\n }", "credit -1: want 0 to"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit\n }\n }", "credit: want exactly one number"},
		{"rate_limit 10 1/s {\n store redis {\n lease 5\n credit 1\n credit 2\n }\n }", "credit: given twice"},
		{"rate_limit 10 1/s {\n quota 1000/day\n store redis {\n lease 5\n credit 1\n }\n }", "a quota is never in debt"},
	} {
		_, err := adaptSite(tt.site)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.site, err, tt.want)
		}
	}
}
