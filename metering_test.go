package ratelimit

import (
	"fmt"
	"testing"
)

// A per-request cost from a placeholder: a whole number from 0 to the
// capacity takes that much; anything else is answered 400 and takes
// nothing. In the local store and in Redis.
func TestCostFromAPlaceholder(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range []struct{ name, store string }{
		{"local", ""},
		{"redis", "store redis {\n address " + srv.url() + "\n timeout 2s\n }"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier batch 10 1/h {
			cost {http.request.header.X-Batch}
		}
		%s
	}
	respond "ok"`, tt.store))
			for i, st := range []struct {
				batch     string
				status    int
				remaining string
			}{
				{"4", 200, "6"},
				{"7", 429, "6"},
				{"0", 200, "6"},
				{"abc", 400, ""},
				{"11", 400, ""},
				{"-1", 400, ""},
				{"", 400, ""},
				{" 6 ", 200, "0"},
				{"1", 429, "0"},
			} {
				var headers []string
				if st.batch != "" {
					headers = append(headers, "X-Batch: "+st.batch)
				}
				r := s.from("127.0.0.2", "/", headers...)
				if r.status != st.status || r.header.Get("X-RateLimit-Remaining") != st.remaining {
					t.Errorf("step %d, X-Batch %q: %d, remaining %q; want %d, %q", i+1, st.batch, r.status, r.header.Get("X-RateLimit-Remaining"), st.status, st.remaining)
				}
			}
		})
	}
}
