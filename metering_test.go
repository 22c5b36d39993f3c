package ratelimit

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
)

// A per-request cost from a placeholder: a whole number from 0 to the
// capacity takes that much; anything else is answered 400 and takes
// nothing. In the local store and in Redis.
func TestCostFromAPlaceholder(t *testing.T) {
	srv := startRedis(t)
	for _, tt := range storeModes(srv) {
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

// A request must fit every limit of its tier and takes from all or none,
// whichever order the limits come in: a denial by one limit leaves the
// others as they were. Local and Redis alike.
func TestSeveralLimitsTakeFromAllOrNone(t *testing.T) {
	srv := startRedis(t)
	for _, store := range storeModes(srv) {
		for _, order := range []struct{ name, limits, want string }{
			{"small first", "limit 3 1/h\n limit 10 1/h", `"default";r=0;t=10800, "default-2";r=7;t=10800`},
			{"big first", "limit 10 1/h\n limit 3 1/h", `"default";r=7;t=10800, "default-2";r=0;t=10800`},
		} {
			t.Run(store.name+"/"+order.name, func(t *testing.T) {
				useFakeClock(t)
				srv.do("FLUSHALL")
				s := serve(t, fmt.Sprintf(`
	rate_limit {
		%s
		headers both
		%s
	}
	respond "ok"`, order.limits, store.store))
				var statuses []int
				var last response
				for range 6 {
					last = s.from("127.0.0.2", "/")
					statuses = append(statuses, last.status)
				}
				if fmt.Sprint(statuses) != "[200 200 200 429 429 429]" {
					t.Errorf("statuses %v, want three allowed by the smaller limit", statuses)
				}
				// The denials took nothing from the larger limit.
				if got := last.header.Get("RateLimit"); got != order.want {
					t.Errorf("RateLimit %q, want %q", got, order.want)
				}
				if got := last.header.Get("X-RateLimit-Limit"); got != "3" {
					t.Errorf("X-RateLimit-Limit %q, want 3, the limit that binds", got)
				}
			})
		}
	}
}

// A tier of four limits: the least of them binds, the IETF fields list
// all four by name, and with Redis each request is one script call.
func TestFourLimitTier(t *testing.T) {
	srv := startRedis(t)
	s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier api {
			limit 4 4/s
			limit 6 1/m
			limit 100 100/h
			limit 1000 1000/24h
		}
		headers both
		store redis {
			address %s
			timeout 2s
		}
	}
	respond "ok"`, srv.url()))
	calls := func() int64 {
		var n int64
		fmt.Sscanf(srv.info("commandstats", "cmdstat_evalsha"), "calls=%d", &n)
		return n
	}
	before := calls()
	r := s.from("127.0.0.2", "/")
	if r.status != 200 || r.header.Get("X-RateLimit-Limit") != "4" || r.header.Get("X-RateLimit-Remaining") != "3" {
		t.Fatalf("first request: %d, limit %q, remaining %q; want 200, 4, 3", r.status, r.header.Get("X-RateLimit-Limit"), r.header.Get("X-RateLimit-Remaining"))
	}
	if got, want := r.header.Get("RateLimit-Policy"), `"api";q=4;w=1, "api-2";q=6;w=360, "api-3";q=100;w=3600, "api-4";q=1000;w=86400`; got != want {
		t.Errorf("RateLimit-Policy %q, want %q", got, want)
	}
	if got := calls() - before; got != 1 {
		t.Errorf("one request made %d script calls, want 1", got)
	}
}

func TestSeveralLimitsMistakes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ block, want string }{
		{"limit 0 1/s", "limit: capacity 0"},
		{"limit 5", "limit: want <capacity> <refill>"},
		{"limit 5 fast", `refill "fast"`},
		{"tier batch 5 1/s {\n cost many\n }", `cost "many"`},
	} {
		_, err := adaptSite("rate_limit {\n " + tt.block + "\n }")
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: error %v, want one containing %q", tt.block, err, tt.want)
		}
	}
}

// streamingOrigin answers in chunks and reports the tokens it used in a
// trailer, as a model server streaming its answer does; with ?header=1 it
// reports them in a header instead, and with ?unannounced=1 in a trailer it
// did not announce before the body.
func streamingOrigin(t *testing.T, used string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Query().Get("header") != "" {
			w.Header().Set("X-Tokens-Used", used)
			fmt.Fprint(w, "answer")
			return
		}
		unannounced := r.URL.Query().Get("unannounced") != ""
		if !unannounced {
			w.Header().Set("Trailer", "X-Tokens-Used")
		}
		for _, part := range []string{"an", "sw", "er"} {
			fmt.Fprint(w, part)
			w.(http.Flusher).Flush()
		}
		if unannounced {
			w.Header().Set(http.TrailerPrefix+"X-Tokens-Used", used)
			return
		}
		w.Header().Set("X-Tokens-Used", used)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// cost_from_response: a request takes its cost to go on, then what the
// origin reports, from a trailer of a streamed answer or a header; the
// bucket goes into debt, and the client is refused until it has refilled
// to the cost. A malformed report takes nothing more.
func TestCostFromResponse(t *testing.T) {
	srv := startRedis(t)
	for _, store := range storeModes(srv) {
		for _, via := range []string{"trailer", "header"} {
			t.Run(store.name+"/"+via, func(t *testing.T) {
				useFakeClock(t)
				srv.do("FLUSHALL")
				origin := streamingOrigin(t, "60")
				s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier llm 100 1/s {
			cost_from_response X-Tokens-Used
		}
		%s
	}
	reverse_proxy %s`, store.store, origin))
				path := "/"
				if via == "header" {
					path = "/?header=1"
				}
				for i, want := range []struct {
					status    int
					remaining string
				}{
					{200, "99"}, // then 60 more: 39 left
					{200, "38"}, // then 60 more: 22 in debt
					{429, "0"},
				} {
					r := s.from("127.0.0.2", path)
					if r.status != want.status || r.header.Get("X-RateLimit-Remaining") != want.remaining {
						t.Fatalf("request %d: %d, remaining %q; want %d, %q", i+1, r.status, r.header.Get("X-RateLimit-Remaining"), want.status, want.remaining)
					}
					if i == 0 && want.status == 200 && r.body != "answer" {
						t.Fatalf("body %q, want the origin's whole answer", r.body)
					}
					if i == 2 {
						// 22 tokens of debt and 1 for the request, at 1/s.
						if after, _ := strconv.Atoi(r.header.Get("Retry-After")); after < 22 || after > 24 {
							t.Errorf("Retry-After %q, want about 23 s: the debt, then the cost", r.header.Get("Retry-After"))
						}
					}
				}
			})
		}
	}
}

// A malformed or missing report takes nothing more than the cost.
func TestCostFromResponseIgnoresBadReports(t *testing.T) {
	useFakeClock(t)
	for _, used := range []string{"", "lots", "-5"} {
		t.Run(strconv.Quote(used), func(t *testing.T) {
			origin := streamingOrigin(t, used)
			s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier llm 100 1/s {
			cost_from_response X-Tokens-Used
		}
	}
	reverse_proxy %s`, origin))
			s.from("127.0.0.2", "/?header=1")
			if r := s.from("127.0.0.2", "/?header=1"); r.status != 200 || r.header.Get("X-RateLimit-Remaining") != "98" {
				t.Errorf("report %q: %d, remaining %q; want 200, 98: only the costs taken", used, r.status, r.header.Get("X-RateLimit-Remaining"))
			}
		})
	}
}

// A cost placeholder is checked against the smallest capacity of the
// tier's limits, not only the first: a cost no limit could ever hold is
// answered 400 and takes nothing, instead of 429 with a Retry-After that
// never comes true (or, for a huge cost, an overflow).
func TestCostPlaceholderFitsEveryLimit(t *testing.T) {
	type costStep struct {
		cost      string
		status    int
		remaining string
	}
	for _, tt := range []struct {
		name, limits string
		steps        []costStep
	}{
		{"small limit second", "limit 100 10/s\n limit 20 20/h", []costStep{
			{"50", 400, ""},
			{"21", 400, ""},
			{"20", 200, "0"}, // nothing was taken by the 400s
			{"1", 429, "0"},
		}},
		{"a cost that would overflow", "limit 1000000 1000/s\n limit 10 1/365d", []costStep{
			{"1000000", 400, ""},
			{"10", 200, "0"},
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier api {
			%s
			cost {http.request.header.X-Cost}
		}
	}
	respond "ok"`, tt.limits))
			for i, st := range tt.steps {
				r := s.from("127.0.0.2", "/", "X-Cost: "+st.cost)
				if r.status != st.status || r.header.Get("X-RateLimit-Remaining") != st.remaining {
					t.Errorf("step %d, X-Cost %s: %d, remaining %q; want %d, %q", i+1, st.cost, r.status, r.header.Get("X-RateLimit-Remaining"), st.status, st.remaining)
				}
			}
		})
	}
}

// The field cost_from_response names is a header name, so its case does not
// matter: a trailer the origin did not announce, which reaches the handler
// under http.TrailerPrefix, is found whatever case the Caddyfile wrote.
func TestCostFromResponseFieldIgnoresCase(t *testing.T) {
	origin := streamingOrigin(t, "60")
	for _, field := range []string{"x-tokens-used", "X-TOKENS-USED", "X-Tokens-Used"} {
		for _, path := range []string{"/", "/?unannounced=1", "/?header=1"} {
			t.Run(field+path, func(t *testing.T) {
				useFakeClock(t)
				s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier llm 100 1/s {
			cost_from_response %s
		}
	}
	reverse_proxy %s`, field, origin))
				if r := s.from("127.0.0.2", path); r.status != 200 || r.body != "answer" {
					t.Fatalf("first request: %d %q, want 200 and the whole answer", r.status, r.body)
				}
				if r := s.from("127.0.0.2", path); r.header.Get("X-RateLimit-Remaining") != "38" {
					t.Errorf("second request: remaining %q, want 38: the first took 1 and then the 60 reported", r.header.Get("X-RateLimit-Remaining"))
				}
			})
		}
	}
}

// {http.rate_limit.limit} is the capacity of the limit the X- headers
// report: the binding one, wherever it stands in the tier.
func TestLimitPlaceholderShowsTheBindingLimit(t *testing.T) {
	for _, limits := range []string{"limit 10 1/h\n limit 3 1/h", "limit 3 1/h\n limit 10 1/h", "limit 3 1/h"} {
		t.Run(limits, func(t *testing.T) {
			useFakeClock(t)
			s := serve(t, fmt.Sprintf(`
	rate_limit {
		%s
	}
	respond "{http.rate_limit.limit}"`, limits))
			r := s.from("127.0.0.2", "/")
			if r.body != "3" || r.header.Get("X-RateLimit-Limit") != "3" {
				t.Errorf("placeholder %q, X-RateLimit-Limit %q; want both 3, the binding limit's capacity", r.body, r.header.Get("X-RateLimit-Limit"))
			}
		})
	}
}

// Every limit line in the rate_limit block at once, for the catch-all
// tier, in every store mode (lease 10% too): two limits, a cost from a
// placeholder, a cost from the response, a quota and concurrency. The
// headers, the admin GET and a DELETE agree with what was taken.
func TestTheCatchAllTierOfEveryLimitLineInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	origin := streamingOrigin(t, "2")
	modes := append(storeModes(srv), storeMode{"redis lease 10%", "store redis {\n address " + srv.url() + "\n timeout 2s\n lease 10%\n }"})
	for i, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			policy := fmt.Sprintf("every_line_%d", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		key header X-Key
		limit 10 1/h
		limit 100 1/h
		cost {http.request.header.X-Cost}
		cost_from_response X-Tokens-Used
		quota 50/day
		concurrency 2
		%s
	}
	reverse_proxy %s`, policy, mode.store, origin))
			// Each request takes its X-Cost, then the origin's 2.
			r := s.get("/?header=1", "X-Key: ann", "X-Cost: 3")
			if r.status != 200 || r.header.Get("X-Ratelimit-Limit") != "10" || r.header.Get("X-Ratelimit-Remaining") != "7" {
				t.Fatalf("the first request: %d, X-RateLimit-Limit %q, -Remaining %q; want 200, 10 and 7", r.status, r.header.Get("X-Ratelimit-Limit"), r.header.Get("X-Ratelimit-Remaining"))
			}
			r = s.get("/?header=1", "X-Key: ann", "X-Cost: 1")
			if r.status != 200 || r.header.Get("X-Ratelimit-Remaining") != "4" {
				t.Fatalf("the second request: %d, X-RateLimit-Remaining %q; want 200 and 4 (10 - 3 - 2 - 1)", r.status, r.header.Get("X-Ratelimit-Remaining"))
			}
			r = s.get("/?header=1", "X-Key: ann", "X-Cost: 9")
			if r.status != 429 {
				t.Fatalf("a request of cost 9 with 2 left: %d, want 429", r.status)
			}
			url := admin + "/rate_limit/buckets?policy=" + policy + "&keyer=header&value=ann"
			var got bucketState
			if status := getJSON(t, url, &got); status != 200 {
				t.Fatalf("GET: %d", status)
			}
			if len(got.Limits) != 2 || got.Limits[0].Remaining != 2 || got.Limits[1].Remaining != 92 ||
				len(got.Quotas) != 1 || got.Quotas[0].Used != 8 || got.Quotas[0].Left != 42 ||
				got.Concurrency != 2 || got.InFlight == nil || *got.InFlight != 0 {
				b, _ := json.Marshal(got)
				t.Errorf("GET: %s; want limits at 2 and 92, the quota 8 used and 42 left, concurrency 2 and nothing in flight", b)
			}
			if status, body := adminDo(t, http.MethodDelete, url); status != 200 {
				t.Fatalf("DELETE: %d %s", status, body)
			}
			getJSON(t, url, &got)
			if len(got.Limits) != 2 || got.Limits[0].Remaining != 10 || got.Limits[1].Remaining != 100 || len(got.Quotas) != 1 || got.Quotas[0].Used != 0 {
				b, _ := json.Marshal(got)
				t.Errorf("GET after DELETE: %s; want every limit full and the quota unused", b)
			}
			if r := s.get("/?header=1", "X-Key: ann", "X-Cost: 8"); r.status != 200 || r.header.Get("X-Ratelimit-Remaining") != "2" {
				t.Errorf("after DELETE, a request of cost 8: %d, X-RateLimit-Remaining %q; want 200 and 2", r.status, r.header.Get("X-Ratelimit-Remaining"))
			}
		})
	}
}
