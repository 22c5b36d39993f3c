package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
)

// adminView is GET /rate_limit/buckets's answer, with each limit's and
// quota's retry_after.
type adminView struct {
	RetryAfter int64 `json:"retry_after"`
	ResetAfter int64 `json:"reset_after"`
	Remaining  int64 `json:"remaining"`
	Limits     []struct {
		Remaining  int64 `json:"remaining"`
		RetryAfter int64 `json:"retry_after"`
		ResetAfter int64 `json:"reset_after"`
	} `json:"limits"`
	Quotas []struct {
		Left       int64 `json:"left"`
		RetryAfter int64 `json:"retry_after"`
		ResetAfter int64 `json:"reset_after"`
	} `json:"quotas"`
}

// GET shows, beside when the bucket is full again (reset_after), when a
// request of the tier's cost passes again (retry_after): what the
// refusal's Retry-After said, for each limit and quota and at the top
// level, in every store mode. Under the login page's ban the two are
// 4500 s and 11700 s apart.
// Regression test for issue 31 item 1.
func TestAdminBucketShowsWhenARequestPassesAgain(t *testing.T) {
	srv := startRedis(t)
	origin := streamingOrigin(t, "60")
	for ci, c := range []struct {
		name, body, query string
		// send makes the requests; the last is refused.
		send  func(s *testServer) response
		check func(t *testing.T, retry int64, got adminView)
	}{
		{"the login page's ban", `
	rate_limit 3 1/h {
		name %s
		key header X-User
		count_status 401
		ban 15m
		%s
	}
	@wrong header X-Password wrong
	respond @wrong 401
	respond "welcome"`, "&keyer=header&value=ann",
			func(s *testServer) (r response) {
				for range 4 {
					r = s.get("/", "X-User: ann", "X-Password: wrong")
				}
				return r
			},
			func(t *testing.T, retry int64, got adminView) {
				if retry < 4499 || retry > 4500 {
					t.Errorf("Retry-After %d, want the ban's 900 s and an hour's token: 4500", retry)
				}
				if got.ResetAfter < 11699 || got.ResetAfter > 11700 {
					t.Errorf("reset_after %d, want the ban and three hours' tokens: 11700", got.ResetAfter)
				}
			}},
		// 100 at 1/s, two requests the origin says used 60 each: 22 in
		// debt; the third request waits out the debt and its cost.
		{"a debt", `
	rate_limit {
		name %s
		tier llm 100 1/s {
			cost_from_response X-Tokens-Used
		}
		%s
	}
	reverse_proxy ` + origin, "&tier=llm&value=127.0.0.2",
			func(s *testServer) (r response) {
				for range 3 {
					r = s.from("127.0.0.2", "/?header=1")
				}
				return r
			},
			func(t *testing.T, retry int64, got adminView) {
				if retry < 22 || retry > 24 || got.ResetAfter < retry+99-2 || got.ResetAfter > retry+99+1 {
					t.Errorf("Retry-After %d, reset_after %d; want about 23, and 99 s more", retry, got.ResetAfter)
				}
			}},
		// The minute's limit refuses the fourth request; the second's
		// passes it now.
		{"a tier refused by its second limit", `
	rate_limit {
		name %s
		tier api {
			limit 100 1/s
			limit 3 1/m
		}
		%s
	}
	respond "ok"`, "&tier=api&value=127.0.0.2",
			func(s *testServer) (r response) {
				for range 4 {
					r = s.from("127.0.0.2", "/")
				}
				return r
			},
			func(t *testing.T, retry int64, got adminView) {
				if len(got.Limits) != 2 || got.Limits[0].RetryAfter != 0 || got.Limits[1].RetryAfter != got.RetryAfter {
					t.Errorf("limits %+v; want the first passing (0), the second as the top level (%d)", got.Limits, got.RetryAfter)
				}
			}},
		// The day's quota refuses the third request until midnight; the
		// rate limit passes it now.
		{"a quota", `
	rate_limit {
		name %s
		timezone UTC
		tier plan 100 10/s {
			quota 2/day
		}
		%s
	}
	respond "ok"`, "&tier=plan&value=127.0.0.2",
			func(s *testServer) (r response) {
				for range 3 {
					r = s.from("127.0.0.2", "/")
				}
				return r
			},
			func(t *testing.T, retry int64, got adminView) {
				if len(got.Quotas) != 1 || len(got.Limits) != 1 {
					t.Fatalf("GET: %+v; want one limit and one quota", got)
				}
				if q := got.Quotas[0]; q.Left != 0 || q.RetryAfter != q.ResetAfter || q.RetryAfter != got.RetryAfter {
					t.Errorf("quota %+v; want none left, passing again at the period's end, as the top level (%d)", q, got.RetryAfter)
				}
				if got.Limits[0].RetryAfter != 0 {
					t.Errorf("limit %+v; want it passing now (0)", got.Limits[0])
				}
			}},
	} {
		for i, mode := range storeModes(srv) {
			t.Run(c.name+"/"+mode.name, func(t *testing.T) {
				useFakeClock(t)
				srv.do("FLUSHALL")
				name := fmt.Sprint("admin_retry_", ci, "_", i)
				s, admin := serveWithAdmin(t, fmt.Sprintf(c.body, name, mode.store))
				r := c.send(s)
				if r.status != 429 {
					t.Fatalf("the last request: %d, want 429", r.status)
				}
				retry, _ := strconv.ParseInt(r.header.Get("Retry-After"), 10, 64)
				var got adminView
				if status := getJSON(t, admin+"/rate_limit/buckets?policy="+name+c.query, &got); status != 200 {
					t.Fatalf("GET: %d", status)
				}
				// Redis's clock runs on: its GET may come a second later.
				if got.RetryAfter < retry-1 || got.RetryAfter > retry {
					t.Errorf("retry_after %d, want the refusal's Retry-After, %d", got.RetryAfter, retry)
				}
				for _, l := range got.Limits {
					if l.ResetAfter < l.RetryAfter {
						t.Errorf("limit %+v: full before a request passes", l)
					}
				}
				if len(got.Quotas) == 0 && got.ResetAfter < got.RetryAfter {
					t.Errorf("reset_after %d before retry_after %d: full before a request passes", got.ResetAfter, got.RetryAfter)
				}
				c.check(t, retry, got)
			})
		}
	}
}

// adminDo sends a request to the admin API, and returns its status and
// body.
func adminDo(t *testing.T, method, url string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// With Redis unreachable, GET answers 502 with an error that says the
// store failed and what DELETE still does; DELETE answers 502 with the
// layers it reset and those it could not, and no bucket fields, since
// none was read.
// Regression test for issue 31 item 1.
func TestAdminBucketDuringARedisOutage(t *testing.T) {
	useFakeClock(t)
	_, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 2 1/h {
		name admin_outage
		store redis {
			address redis://127.0.0.1:%d
		}
		on_store_error local
	}
	respond "ok"`, freePort(t))) // nothing listens there
	url := admin + "/rate_limit/buckets?policy=admin_outage&value=127.0.0.61"

	status, body := adminDo(t, http.MethodGet, url)
	var e struct {
		Error string `json:"error"`
	}
	if err := json.Unmarshal([]byte(body), &e); err != nil || status != http.StatusBadGateway ||
		!strings.HasPrefix(e.Error, "reading the bucket: the store redis failed: ") || !strings.Contains(e.Error, "DELETE") {
		t.Errorf("GET with Redis down: %d %s; want 502 and an error that names the store and what DELETE still resets", status, body)
	}

	status, body = adminDo(t, http.MethodDelete, url)
	var reply map[string]any
	if err := json.Unmarshal([]byte(body), &reply); err != nil || status != http.StatusBadGateway {
		t.Fatalf("DELETE with Redis down: %d %s; want 502 and JSON", status, body)
	}
	for _, field := range []string{"capacity", "refill", "remaining", "reset", "reset_after", "retry_after"} {
		if _, ok := reply[field]; ok {
			t.Errorf("DELETE with Redis down answered %s: %q, a field of a bucket it did not read", body, field)
		}
	}
	if reply["deleted"] != false || reply["key_id"] == nil || reply["layers_reset"] == nil || reply["layers_failed"] == nil {
		t.Errorf("DELETE with Redis down answered %s; want deleted false, the key_id and the layers reset and failed", body)
	}
}

// untilPasses, from a peek alone, says when a take of the cost passes: a
// take then is allowed, and one 2 µs before is refused (a peek hides the
// part of a microsecond already refilled). Random traces of takes,
// debts (cost_from_response) and bans, with and without max_wait; a
// bucket with both a ban and max_wait is only held to the first, since
// waiters queued past empty read as a ban. Two broken variants must be
// caught: the time until full (what reset_after says), and one blind to
// max_wait.
func TestAdminRetryAfterIsWhenATakePasses(t *testing.T) {
	t.Parallel()
	check := func(until func(bucket.Limit, bucket.Result, int64) int64) (checked int, failure string) {
		rng := rand.New(rand.NewPCG(31, 1))
		for range 300 {
			tr := buckettest.RandomTrace(rng)
			l := tr.Limit
			if rng.IntN(3) == 0 {
				l.Ban = 1 + rng.Int64N(2*l.Units()/l.Rate.Tokens+1)
			}
			var s bucket.State
			now := int64(1_000_000)
			for i, gap := range tr.Gaps {
				now += gap
				cost := tr.Costs[i]
				r := until(l, bucket.Peek(s, now, l), cost)
				if _, res := bucket.Take(s, now+r, l, cost); !res.Allowed {
					return checked, fmt.Sprintf("limit %+v, state %+v at %d: a take of %d %d µs later is refused", l, s, now, cost, r)
				}
				if r >= 2 && !(l.Ban > 0 && l.MaxWait > 0) {
					if _, res := bucket.Take(s, now+r-2, l, cost); res.Allowed {
						return checked, fmt.Sprintf("limit %+v, state %+v at %d: a take of %d passes before %d µs", l, s, now, cost, r)
					}
				}
				checked++
				s, _ = bucket.Take(s, now, l, cost)
				if rng.IntN(8) == 0 {
					s = bucket.Charge(s, now, l, rng.Int64N(3*l.Capacity))
				}
			}
		}
		return checked, ""
	}
	if n, failure := check(untilPasses); failure != "" || n < 50_000 {
		t.Fatalf("after %d checks: %s", n, failure)
	}
	for name, broken := range map[string]func(bucket.Limit, bucket.Result, int64) int64{
		"until full": func(_ bucket.Limit, res bucket.Result, _ int64) int64 { return res.ResetAfter },
		"blind to max_wait": func(l bucket.Limit, res bucket.Result, cost int64) int64 {
			l.MaxWait = 0
			return untilPasses(l, res, cost)
		},
	} {
		if _, failure := check(broken); failure == "" {
			t.Errorf("the variant %q passes the property", name)
		}
	}
}

// GET's retry_after is "0 when one would pass now", else what a refused
// request's Retry-After says (docs/operating.md), on the node that
// answers it: read before each request of one client, it says whether
// that request passes, in every store mode. With a lease, the node's
// tokens pass requests that the shared bucket alone would refuse.
func TestAdminRetryAfterSaysWhetherTheNextRequestPassesInEveryStoreMode(t *testing.T) {
	srv := startRedis(t)
	modes := append(storeModes(srv), storeMode{"redis lease 5", "store redis {\n address " + srv.url() + "\n timeout 2s\n lease 5\n }"})
	for i, mode := range modes {
		t.Run(mode.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			policy := fmt.Sprintf("next_passes_%d", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit 10 1/h {
		name %s
		key header X-Key
		%s
	}
	respond "ok"`, policy, mode.store))
			url := admin + "/rate_limit/buckets?policy=" + policy + "&keyer=header&value=ann"
			var trace []string
			for n := 1; n <= 12; n++ {
				var got adminView
				if status := getJSON(t, url, &got); status != 200 {
					t.Fatalf("GET: %d", status)
				}
				r := s.get("/", "X-Key: ann")
				retry, _ := strconv.ParseInt(r.header.Get("Retry-After"), 10, 64)
				trace = append(trace, fmt.Sprintf("GET retry_after %d remaining %d, then %d (Retry-After %d)", got.RetryAfter, got.Remaining, r.status, retry))
				passes := got.RetryAfter == 0
				if passes != (r.status == 200) || !passes && (retry < got.RetryAfter-1 || retry > got.RetryAfter+1) {
					t.Fatalf("request %d: GET's retry_after does not say what the request got:\n%s", n, strings.Join(trace, "\n"))
				}
			}
		})
	}
}

// The admin API's read of a tier of several limits changes nothing: with
// ban and max_wait, a client in debt (cost_from_response) beyond max_wait
// that the admin API read is let in once it waits its debt out, as the
// client nobody read is; the read starts no ban.
// Regression test for 1b00d1d.
func TestAnAdminReadOfSeveralLimitsStartsNoBan(t *testing.T) {
	skipUnderShort(t, "real-time")
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			policy := fmt.Sprintf("admin_read_ban_%d", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name %s
		key header X-Key
		tier api {
			limit 5 5/s
			limit 1000 1/h
			cost_from_response X-Used
		}
		max_wait 1s
		ban 1h
		%s
	}
	header X-Used 20
	respond ok`, policy, mode.store))
			for _, k := range []string{"read", "control"} {
				if r := s.get("/", "X-Key: "+k); r.status != 200 {
					t.Fatalf("first request of %s: %d", k, r.status)
				}
			}
			// Charged 20: limit 1 lacks 21 of 5 tokens at 5/s, 3.4 s of debt
			// beyond the one token the next request takes, 2.4 s past max_wait.
			resp, err := http.Get(admin + "/rate_limit/buckets?policy=" + policy + "&tier=api&keyer=header&value=read")
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("admin GET: %d", resp.StatusCode)
			}
			time.Sleep(3600 * time.Millisecond)
			if r := s.get("/", "X-Key: control"); r.status != 200 {
				t.Fatalf("control, unread, after its debt: %d (Retry-After %s), want 200", r.status, r.header.Get("Retry-After"))
			}
			if r := s.get("/", "X-Key: read"); r.status != 200 {
				t.Errorf("the client the admin API read, after its debt: %d, Retry-After %s; want 200 as the unread client got: the admin read started a ban", r.status, r.header.Get("Retry-After"))
			}
		})
	}
}
