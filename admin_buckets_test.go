package ratelimit

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/caddyserver/caddy/v2"
	"github.com/golang-jwt/jwt/v5"
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

// A request's bucket, whichever keyer names the client (each kind, and
// the client IP when none does) and whichever tier a matcher or the
// keyer's kind picks for it, is the one the admin endpoint names by
// tier, keyer and value: GET shows what the requests spent, and after
// DELETE the bucket is full and the client's next request is its first.
func TestTheAdminEndpointNamesTheBucketOfEveryKeyerAndTier(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	const secret = "a jwt secret of thirty-two bytes!"
	s, admin := serveWithAdmin(t, `
	route {
		rate_limit 100 1/h {
			name admin_every_keyer_outer
			key header X-Key
		}
		rate_limit {
			name admin_every_keyer
			key jwt sub
			key header X-Key
			key cookie sid
			key json user.name
			key form username
			key placeholder {query.k}
			jwt {
				secret "`+secret+`"
				issuer https://issuer.test
				audience api
			}
			tier gold 9 1/h {
				match {
					header X-Plan gold
				}
			}
			tier crumbs 8 1/h {
				keyer cookie
			}
			tier default 7 1/h
		}
		respond "{http.rate_limit.policy} {http.rate_limit.tier} {http.rate_limit.key_id} {http.rate_limit.remaining}"
	}`)
	capacity := map[string]int64{"gold": 9, "crumbs": 8, "default": 7}
	for _, c := range []struct {
		keyer string
		// send makes one request of the client named by value.
		send func(value string, headers ...string) response
	}{
		{"jwt", func(v string, hs ...string) response {
			tok := sign(t, jwt.SigningMethodHS256, []byte(secret), "", claimsAt(v, "gold"))
			return s.do(http.MethodGet, "/", "", append(hs, bearer(tok))...)
		}},
		{"header", func(v string, hs ...string) response {
			return s.do(http.MethodGet, "/", "", append(hs, "X-Key: "+v)...)
		}},
		{"cookie", func(v string, hs ...string) response {
			return s.do(http.MethodGet, "/", "", append(hs, "Cookie: sid="+v)...)
		}},
		{"json", func(v string, hs ...string) response {
			return s.do(http.MethodPost, "/", `{"user":{"name":"`+v+`"}}`, append(hs, "Content-Type: application/json")...)
		}},
		{"form", func(v string, hs ...string) response {
			return s.do(http.MethodPost, "/", "username="+v, append(hs, "Content-Type: application/x-www-form-urlencoded")...)
		}},
		{"placeholder", func(v string, hs ...string) response {
			return s.do(http.MethodGet, "/?k="+v, "", hs...)
		}},
		{"ip", func(v string, hs ...string) response {
			return s.do(http.MethodGet, "/", "", append(hs, "X-Forwarded-For: "+v)...)
		}},
	} {
		for pi, plan := range []string{"gold", ""} {
			t.Run(c.keyer+"/"+cmp.Or(plan, "no plan"), func(t *testing.T) {
				value := c.keyer + strconv.Itoa(pi)
				if c.keyer == "ip" {
					value = "127.0.4." + strconv.Itoa(pi+1)
				}
				var headers []string
				if plan != "" {
					headers = append(headers, "X-Plan: "+plan)
				}
				tier := "default"
				switch {
				case plan == "gold":
					tier = "gold"
				case c.keyer == "cookie":
					tier = "crumbs"
				}
				var last []string
				for range 3 {
					r := c.send(value, headers...)
					last = strings.Fields(r.body)
					if r.status != 200 || len(last) != 4 || last[0] != "admin_every_keyer" || last[1] != tier {
						t.Fatalf("request: %d %q; want 200 on tier %s", r.status, r.body, tier)
					}
				}
				url := admin + "/rate_limit/buckets?policy=admin_every_keyer&tier=" + tier + "&keyer=" + c.keyer + "&value=" + value
				var got bucketState
				if status := getJSON(t, url, &got); status != 200 || got.Remaining != capacity[tier]-3 || got.KeyID != last[2] {
					t.Fatalf("GET after 3 requests: %d, remaining %d, key_id %s; want 200, %d, the requests' key_id %s",
						status, got.Remaining, got.KeyID, capacity[tier]-3, last[2])
				}
				if status, body := adminDo(t, http.MethodDelete, url); status != 200 {
					t.Fatalf("DELETE: %d %s", status, body)
				}
				if status := getJSON(t, url, &got); status != 200 || got.Remaining != capacity[tier] {
					t.Errorf("GET after DELETE: %d, remaining %d; want the bucket full, %d", status, got.Remaining, capacity[tier])
				}
				r := c.send(value, headers...)
				if want := strconv.FormatInt(capacity[tier]-1, 10); r.status != 200 || !strings.HasSuffix(r.body, " "+want) {
					t.Errorf("the request after DELETE: %d %q; want 200 and %s remaining, the bucket's first request", r.status, r.body, want)
				}
			})
		}
	}
}

// A reload that reorders the keyers and tiers, and adds one of each,
// keeps every client in its bucket: one named by a keyer that moved, one
// on a tier that moved, one named by the client IP, which comes after
// one more keyer. The admin endpoint names the bucket as the new config
// does.
func TestAReloadThatReordersKeyersAndTiersKeepsEachClientsBucket(t *testing.T) {
	useFakeClock(t)
	port := freePort(t)
	globals := fmt.Sprintf("admin 127.0.0.1:%d", freePort(t))
	admin := "http://" + strings.TrimPrefix(globals, "admin ")
	const body = `
	rate_limit {
		name reload_order
		%s
		%s
		tier default 2 1/h
	}
	respond "{http.rate_limit.tier} {http.rate_limit.remaining}"`
	const gold = `tier gold 3 1/h {
			match {
				header X-Plan gold
			}
		}`
	clients := []struct {
		name    string
		headers []string
		tier    string
		query   string
	}{
		{"named by X-B, on gold", []string{"X-B: bee", "X-Plan: gold", "X-Forwarded-For: 127.0.5.1"}, "gold", "tier=gold&keyer=header/X-B&value=bee"},
		{"named by X-A", []string{"X-A: ay", "X-Forwarded-For: 127.0.5.2"}, "default", "tier=default&keyer=header/X-A&value=ay"},
		{"named by its IP", []string{"X-Forwarded-For: 127.0.5.3"}, "default", "tier=default&keyer=ip&value=127.0.5.3"},
	}
	s := serveCaddyfile(t, port, siteCaddyfile(globals, port, fmt.Sprintf(body, "key header X-A\n\t\tkey header X-B", gold)))
	for _, c := range clients {
		for i := 0; ; i++ {
			r := s.get("/", c.headers...)
			if r.status == 429 {
				break
			}
			if r.status != 200 || !strings.HasPrefix(r.body, c.tier+" ") || i > 5 {
				t.Fatalf("%s, request %d: %d %q; want 200 on %s until it is refused", c.name, i+1, r.status, r.body, c.tier)
			}
		}
	}
	s = serveCaddyfile(t, port, siteCaddyfile(globals, port, fmt.Sprintf(body,
		"key header X-B\n\t\tkey header X-A\n\t\tkey header X-C",
		"tier silver 5 1/h {\n\t\t\tmatch {\n\t\t\t\theader X-Plan silver\n\t\t\t}\n\t\t}\n\t\t"+gold)))
	for _, c := range clients {
		if r := s.get("/", c.headers...); r.status != 429 {
			t.Errorf("%s, after the reload: %d %q; want 429, its bucket still empty", c.name, r.status, r.body)
		}
		url := admin + "/rate_limit/buckets?policy=reload_order&" + c.query
		var got bucketState
		if status := getJSON(t, url, &got); status != 200 || got.Remaining != 0 {
			t.Errorf("%s, GET after the reload: %d, remaining %d; want its empty bucket", c.name, status, got.Remaining)
		}
		if status, body := adminDo(t, http.MethodDelete, url); status != 200 {
			t.Fatalf("%s: DELETE: %d %s", c.name, status, body)
		}
		if r := s.get("/", c.headers...); r.status != 200 {
			t.Errorf("%s, after DELETE: %d %q; want 200", c.name, r.status, r.body)
		}
	}
}

// With Redis down, the on_store_error local fallback decides, on the tier
// itself or on its scaled copy for a share: DELETE, which answers 502 for
// Redis, resets the fallback's bucket of the client, named by a keyer or
// by its IP, and the client's next request passes.
func TestAnAdminDeleteDuringARedisOutageEmptiesTheFallbacksBucket(t *testing.T) {
	for i, share := range []string{"", "1/2"} {
		t.Run(cmp.Or(share, "whole"), func(t *testing.T) {
			useFakeClock(t)
			name := fmt.Sprint("outage_delete_", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 4 1/h {
		name %s
		key header X-Key
		store redis {
			address redis://127.0.0.1:%d
		}
		on_store_error local %s
	}
	respond "ok"`, name, freePort(t), share)) // nothing listens there
			for _, c := range []struct {
				who     string
				headers []string
				query   string
			}{
				{"named by X-Key", []string{"X-Key: kay", "X-Forwarded-For: 127.0.6.1"}, "keyer=header&value=kay"},
				{"named by its IP", []string{"X-Forwarded-For: 127.0.6.2"}, "keyer=ip&value=127.0.6.2"},
			} {
				allowed := 0
				for s.get("/", c.headers...).status == 200 {
					if allowed++; allowed > 4 {
						t.Fatalf("%s: more than the tier's 4 allowed", c.who)
					}
				}
				if allowed == 0 {
					t.Fatalf("%s: the fallback allowed nothing", c.who)
				}
				status, body := adminDo(t, http.MethodDelete, admin+"/rate_limit/buckets?policy="+name+"&"+c.query)
				var reply resetReport
				if err := json.Unmarshal([]byte(body), &reply); err != nil || status != http.StatusBadGateway || !slices.Contains(reply.LayersReset, "local_fallback") {
					t.Fatalf("%s: DELETE: %d %s; want 502 with local_fallback reset", c.who, status, body)
				}
				again := 0
				for s.get("/", c.headers...).status == 200 && again <= 4 {
					again++
				}
				if again != allowed {
					t.Errorf("%s: %d allowed after DELETE, %d before; want the fallback's bucket full again", c.who, again, allowed)
				}
			}
		})
	}
}

// A quota count used up, given back (count_status), used up again, kept
// through a flood of other clients ten times max_keys, and reloaded to a
// higher and then a lower N: each request passes as the count and the
// running N say, and GET shows the count as it stands (used, left,
// retry_after), whatever mark eviction keeps beside it.
func TestAdminShowsAUsedUpQuotaCountThroughGiveBacksFloodsAndReloads(t *testing.T) {
	clock := useFakeClock(t)
	// Near the real clock: a give-back names its period from the moment
	// the handler read it (decision.countedAt).
	now := time.Now().UTC()
	clock.micros.Store(now.UnixMicro())
	tomorrow := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)
	resetAfter := bucket.CeilDiv(tomorrow.UnixMicro()-now.UnixMicro(), 1_000_000)
	const maxKeys = 20
	admin := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	port := freePort(t)
	site := func(n int) string {
		return siteCaddyfile("admin "+admin, port, fmt.Sprintf(`
	rate_limit {
		name quota_marks
		key header X-Key
		quota %d/day
		count_status 401
		store local {
			max_keys %d
		}
	}
	@wrong header X-Password wrong
	respond @wrong 401
	respond "ok"`, n, maxKeys))
	}
	s := serveCaddyfile(t, port, site(3))
	reload := func(n int) {
		t.Helper()
		cfg, err := adaptCaddyfile(site(n))
		if err != nil {
			t.Fatal(err)
		}
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatal(err)
		}
	}
	attempt := func(key, password string) int {
		return s.get("/", "X-Key: "+key, "X-Password: "+password).status
	}
	check := func(when string, status, want, used, left int) {
		t.Helper()
		if status != want {
			t.Fatalf("%s: %d, want %d", when, status, want)
		}
		var got struct {
			Quotas []quotaView `json:"quotas"`
		}
		if code := getJSON(t, "http://"+admin+"/rate_limit/buckets?policy=quota_marks&keyer=header&value=bob", &got); code != 200 || len(got.Quotas) != 1 {
			t.Fatalf("%s: GET %d, quotas %+v", when, code, got.Quotas)
		}
		q := got.Quotas[0]
		wantRetry := int64(0)
		if left == 0 {
			wantRetry = q.ResetAfter
		}
		if q.Used != int64(used) || q.Left != int64(left) || q.RetryAfter != wantRetry || q.ResetAfter != resetAfter {
			t.Fatalf("%s: GET shows %+v, want used %d, left %d, retry_after %d, reset_after %d", when, q, used, left, wantRetry, resetAfter)
		}
	}
	flood := func() {
		t.Helper()
		for i := range 10 * maxKeys {
			if got := attempt("flood-"+strconv.Itoa(i), "wrong"); got != 401 {
				t.Fatalf("flood key %d: %d, want 401", i, got)
			}
		}
	}
	check("the first wrong password", attempt("bob", "wrong"), 401, 1, 2)
	check("the second", attempt("bob", "wrong"), 401, 2, 1)
	// Counted to 3, used up, then given back: the response is not a 401.
	check("the right password", attempt("bob", "right"), 200, 2, 1)
	check("the third wrong password", attempt("bob", "wrong"), 401, 3, 0)
	check("the fourth", attempt("bob", "wrong"), 429, 3, 0)
	flood()
	check("after a flood", attempt("bob", "right"), 429, 3, 0)
	reload(5)
	check("after a reload to 5 a day", attempt("bob", "wrong"), 401, 4, 1)
	// A count of 4 that a reload to 3 uses up. GET shows a count past N as
	// N used (N less what is left).
	reload(3)
	check("after a reload to 3 a day", attempt("bob", "right"), 429, 3, 0)
	flood()
	check("after another flood", attempt("bob", "right"), 429, 3, 0)
	clock.micros.Store(tomorrow.UnixMicro())
	if got := attempt("bob", "right"); got != 200 {
		t.Fatalf("the next day: %d, want 200", got)
	}
}
