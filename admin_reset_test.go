package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
)

// TestAdminResetDuringARedisOutageResetsWhatItCan limits a client through
// the local fallback while Redis is down, then resets its bucket through
// the admin API. Redis cannot be reached, so the answer is a 502 that
// says so, but every layer this node holds is reset: the client gets
// through the fallback again at once.
func TestAdminResetDuringARedisOutageResetsWhatItCan(t *testing.T) {
	useFakeClock(t)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 2 1/h {
		name outage
		store redis {
			address redis://127.0.0.1:%d
		}
		on_store_error local
	}
	respond "ok"`, freePort(t))) // nothing listens there
	for i, want := range []int{200, 200, 429} {
		if r := s.from("127.0.0.60", "/"); r.status != want {
			t.Fatalf("request %d with Redis down: %d, want %d from the local fallback", i+1, r.status, want)
		}
	}

	req, _ := http.NewRequest(http.MethodDelete, admin+"/rate_limit/buckets?policy=outage&value=127.0.0.60", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusBadGateway {
		t.Errorf("DELETE with Redis down: %d %s; want 502", resp.StatusCode, body)
	}
	var got struct {
		Reset  []string          `json:"layers_reset"`
		Failed map[string]string `json:"layers_failed"`
	}
	if err := json.Unmarshal(body, &got); err != nil {
		t.Errorf("DELETE with Redis down: %v in %s", err, body)
	}
	if !slices.Contains(got.Reset, "deny_cache") || !slices.Contains(got.Reset, "local_fallback") ||
		!strings.Contains(got.Failed["redis"], "redis") {
		t.Errorf("DELETE with Redis down answered %s; want deny_cache and local_fallback reset, redis failed", body)
	}
	if r := s.from("127.0.0.60", "/"); r.status != 200 {
		t.Fatalf("after the DELETE: %d, want 200: the local fallback bucket was not reset", r.status)
	}
}
