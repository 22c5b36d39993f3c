package ratelimit

import (
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// adminLimit is one limit of GET /rate_limit/buckets's answer, as JSON.
type adminLimit struct {
	Capacity   int64  `json:"capacity"`
	Refill     string `json:"refill"`
	Remaining  int64  `json:"remaining"`
	Reset      int64  `json:"reset"`
	ResetAfter int64  `json:"reset_after"`
}

// adminBucket is GET /rate_limit/buckets's answer, as JSON.
type adminBucket struct {
	adminLimit
	Limits []adminLimit `json:"limits"`
}

// GET on a bucket of a tier of several limits shows every limit, read from
// where the requests took (in Redis, the key of the tier's limits), and
// the binding one, the least remaining, at the top as the X- headers do.
func TestAdminBucketShowsEveryLimit(t *testing.T) {
	srv := startRedis(t)
	for _, store := range []struct{ name, block string }{
		{"local", ""},
		{"redis", "store redis {\n address " + srv.url() + "\n timeout 2s\n }"},
	} {
		t.Run(store.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit {
		name admin_limits
		tier api {
			limit 5 1/h
			limit 3 1/m
		}
		%s
	}
	respond "ok"`, store.block))
			s.from("127.0.0.2", "/")
			s.from("127.0.0.2", "/")
			var got adminBucket
			before := time.Now().Unix()
			if status := getJSON(t, admin+"/rate_limit/buckets?policy=admin_limits&value=127.0.0.2", &got); status != 200 {
				t.Fatalf("GET: %d", status)
			}
			// Redis refills by its own clock: the minute's limit may have
			// gained a token since.
			want := []adminLimit{{5, "1/h", 3, 0, 7200}, {3, "1/m", 1, 0, 120}}
			if len(got.Limits) != 2 {
				t.Fatalf("limits %+v, want two", got.Limits)
			}
			for i, l := range got.Limits {
				w := want[i]
				if l.Capacity != w.Capacity || l.Refill != w.Refill || l.Remaining < w.Remaining || l.Remaining > w.Remaining+1 || l.ResetAfter > w.ResetAfter || l.ResetAfter < w.ResetAfter-60 {
					t.Errorf("limit %d: %+v, want %+v", i+1, l, w)
				}
				if l.Reset < before+l.ResetAfter-1 || l.Reset > before+l.ResetAfter+2 {
					t.Errorf("limit %d: reset %d, want about now (%d) + reset_after %d", i+1, l.Reset, before, l.ResetAfter)
				}
			}
			if got.adminLimit != got.Limits[1] {
				t.Errorf("top level %+v, want the binding limit's %+v", got.adminLimit, got.Limits[1])
			}
		})
	}
}

// GET says a bucket is full when it really is, and never before the
// client may come back (Retry-After), in every store mode: under a ban, in
// debt, and for a tier of several limits, where the top level is the
// binding limit's. It said one refill of the capacity from now (two
// minutes for an hour's ban), and a refused tier's top level was its first
// limit's, however full (the review of issue 27's tests).
func TestAdminResetCoversRetryAfter(t *testing.T) {
	srv := startRedis(t)
	origin := streamingOrigin(t, "60")
	for ci, c := range []struct {
		name, body, query string
		requests          int
		// check sees the last request's answer and Retry-After, and GET's.
		check func(t *testing.T, r response, retry int, got adminBucket)
	}{
		{"one limit banned an hour", "rate_limit 2 1/m {\n name %s\n ban 1h\n %s\n }\n respond \"ok\"", "", 3,
			func(t *testing.T, r response, retry int, got adminBucket) {
				if retry <= 3600 {
					t.Fatalf("the third request's Retry-After %d, want the ban's hour and more", retry)
				}
				if got.Remaining != 0 || got.ResetAfter < 3600 || got.ResetAfter > int64(retry)+60 {
					t.Errorf("GET under the ban: %+v; want 0 remaining, full again when the ban ends", got.adminLimit)
				}
			}},
		// 100 at 1/s, two requests that the origin says used 60 each:
		// 22 in debt. The refusal says 23 s (the debt and the cost); GET
		// about 122 s, the debt and then the whole capacity.
		{"22 tokens in debt", "rate_limit {\n name %s\n tier llm 100 1/s {\n cost_from_response X-Tokens-Used\n }\n %s\n }\n reverse_proxy " + origin, "&tier=llm", 3,
			func(t *testing.T, r response, retry int, got adminBucket) {
				if r.status != 429 || retry < 22 || retry > 24 {
					t.Fatalf("third request %d, Retry-After %d; want 429 and about 23", r.status, retry)
				}
				if got.Remaining != 0 || got.ResetAfter < int64(retry)+99-3 || got.ResetAfter > int64(retry)+99+3 {
					t.Errorf("GET in debt: %+v; want 0 remaining, full in about %d s (Retry-After %d + 99)", got.adminLimit, retry+99, retry)
				}
			}},
		// The fourth request is refused by the minute's limit: the top
		// level is that limit's, as X-RateLimit-* report.
		{"a tier refused by its second limit", "rate_limit {\n name %s\n tier api {\n limit 100 1/s\n limit 3 1/m\n }\n %s\n }\n respond \"ok\"", "&tier=api", 4,
			func(t *testing.T, r response, retry int, got adminBucket) {
				if r.status != 429 || retry < 58 || r.header.Get("X-RateLimit-Remaining") != "0" {
					t.Fatalf("fourth request %d, Retry-After %d, remaining %q; want 429, about 60 s, 0", r.status, retry, r.header.Get("X-RateLimit-Remaining"))
				}
				if len(got.Limits) != 2 || got.Limits[1].Remaining != 0 || got.Limits[1].ResetAfter < 170 {
					t.Fatalf("limits %+v; want the minute's empty, full in about 180 s", got.Limits)
				}
				if got.adminLimit != got.Limits[1] || got.ResetAfter < int64(retry) {
					t.Errorf("top level %+v; want the binding limit's %+v (Retry-After %d)", got.adminLimit, got.Limits[1], retry)
				}
			}},
		// Every limit is empty for the ban and refills after it: the
		// hour's first token is back in 2 h (Retry-After), and the hour's
		// limit is full in 11 h.
		{"a banned tier of two limits", "rate_limit {\n name %s\n ban 1h\n tier api {\n limit 2 1/m\n limit 10 1/h\n }\n %s\n }\n respond \"ok\"", "&tier=api", 3,
			func(t *testing.T, r response, retry int, got adminBucket) {
				if r.status != 429 || retry < 7190 {
					t.Fatalf("third request %d, Retry-After %d; want 429 and the ban's hour plus the hour's token", r.status, retry)
				}
				for j, l := range got.Limits {
					if l.Remaining != 0 || l.ResetAfter < 3600 {
						t.Errorf("limit %d under the ban: %+v; want 0 remaining, full after the ban", j+1, l)
					}
				}
				if got.Remaining != 0 || got.ResetAfter < int64(retry) {
					t.Errorf("top level under the ban %+v: full in %d s, before the client may come back (Retry-After %d); limits %+v", got.adminLimit, got.ResetAfter, retry, got.Limits)
				}
			}},
	} {
		for i, mode := range storeModes(srv) {
			t.Run(c.name+"/"+mode.name, func(t *testing.T) {
				useFakeClock(t)
				srv.do("FLUSHALL")
				// A policy of its own: the local store keeps buckets
				// across a reload that keeps the name.
				name := fmt.Sprint("admin_reset_", ci, "_", i)
				s, admin := serveWithAdmin(t, fmt.Sprintf(c.body, name, mode.store))
				var r response
				for range c.requests {
					r = s.from("127.0.0.2", "/?header=1")
				}
				retry, _ := strconv.Atoi(r.header.Get("Retry-After"))
				var got adminBucket
				if status := getJSON(t, admin+"/rate_limit/buckets?policy="+name+c.query+"&value=127.0.0.2", &got); status != 200 {
					t.Fatalf("GET: %d", status)
				}
				c.check(t, r, retry, got)
			})
		}
	}
}

// A tier of one limit, given by a limit line alone, shows that limit's
// refill; its answer has no list of limits.
func TestAdminBucketOfATierOfOneLimitLine(t *testing.T) {
	useFakeClock(t)
	s, admin := serveWithAdmin(t, `
	rate_limit {
		name admin_limit_line
		tier api {
			limit 4 1/m
		}
	}
	respond "ok"`)
	s.from("127.0.0.2", "/")
	var got adminBucket
	if status := getJSON(t, admin+"/rate_limit/buckets?policy=admin_limit_line&value=127.0.0.2", &got); status != 200 {
		t.Fatalf("GET: %d", status)
	}
	if got.Capacity != 4 || got.Refill != "1/m" || got.Remaining != 3 || got.Limits != nil {
		t.Errorf("GET: %+v; want capacity 4, refill 1/m, remaining 3 and no list", got)
	}
}

// GET /rate_limit/policies shows a per-request cost as its placeholder,
// not as the cost of 1 it is not.
func TestPoliciesShowACostPlaceholder(t *testing.T) {
	_, admin := serveWithAdmin(t, `
	rate_limit {
		name admin_cost
		tier batch 10 1/s {
			cost {http.request.header.X-Batch}
		}
	}
	respond "ok"`)
	var views []map[string]any
	getJSON(t, admin+"/rate_limit/policies", &views)
	for _, v := range views {
		if v["policy"] != "admin_cost" {
			continue
		}
		tier := v["tiers"].([]any)[0].(map[string]any)
		if tier["cost_placeholder"] != "{http.request.header.X-Batch}" || tier["cost"] != nil {
			t.Errorf("tier %v: want cost_placeholder {http.request.header.X-Batch} and no cost", tier)
		}
		return
	}
	t.Errorf("policy admin_cost not in %v", views)
}

// TestPoliciesShowTheSentinelMaster serves a policy whose Redis is found
// through Sentinel: GET /rate_limit/policies names the master in use.
// Regression test for issue 31 item 12.
func TestPoliciesShowTheSentinelMaster(t *testing.T) {
	skipUnderShort(t, "Sentinel")
	st := startSentinel(t)
	_, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 10 1/s {
		name sentinel_master
		store redis {
			sentinel %s %s
		}
	}
	respond "ok"`, st.name, st.sentinelAddresses[0]))
	var master any
	waitFor(t, 5*time.Second, "the policy to name the master", func() bool {
		var views []map[string]any
		getJSON(t, admin+"/rate_limit/policies", &views)
		for _, v := range views {
			if v["policy"] == "sentinel_master" {
				master = v["redis_master"]
			}
		}
		return master == st.master.addr()
	})
}

// TestPoliciesKeysCountTheRunningConfigsLiveBuckets fills on_store_error
// local's buckets while Redis is down: keys counts them while they are
// not full, not once they have refilled, and not an earlier config's
// after a reload.
// Regression test for issue 31 item 13.
func TestPoliciesKeysCountTheRunningConfigsLiveBuckets(t *testing.T) {
	clock := useFakeClock(t)
	port, admin, dead := freePort(t), "127.0.0.1:"+strconv.Itoa(freePort(t)), freePort(t)
	config := func(capacity int) string {
		return fmt.Sprintf(`{
	admin %s
	skip_install_trust
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
http://127.0.0.1:%d {
	rate_limit %d 1/s {
		name fallback_keys
		store redis {
			address redis://127.0.0.1:%d
		}
	}
	respond "ok"
}`, admin, port, capacity, dead)
	}
	s := serveCaddyfile(t, port, config(3))
	keys := func() any {
		var views []map[string]any
		getJSON(t, "http://"+admin+"/rate_limit/policies", &views)
		for _, v := range views {
			if v["policy"] == "fallback_keys" {
				return v["keys"]
			}
		}
		return nil
	}
	for i := range 4 {
		if r := s.from("127.0.2."+strconv.Itoa(i+1), "/"); r.status != 200 {
			t.Fatalf("request %d with Redis down: %d, want 200 from the local fallback", i, r.status)
		}
	}
	if got := keys(); got != 4.0 {
		t.Fatalf("keys with four clients limited by the fallback: %v, want 4", got)
	}
	clock.advance(2 * time.Second) // every bucket is full again
	if got := keys(); got != 0.0 {
		t.Errorf("keys once the fallback's buckets have refilled: %v, want 0", got)
	}
	for i := range 2 {
		s.from("127.0.3."+strconv.Itoa(i+1), "/")
	}
	cfg, err := adaptCaddyfile(config(4))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	if got := keys(); got != 0.0 {
		t.Errorf("keys after a reload, counting the earlier config's two live buckets: %v, want 0", got)
	}
}

// A login keyed by `key form username normalize` (docs/logins.md) puts
// "Alice" in alice's bucket. An operator who unblocks the user by the
// name as she typed it, `value=Alice`, must reset that bucket, as the
// value of an ip keyer gets the keyer's prefix: DELETE names the bucket
// the keyer would, and her next attempt passes.
func TestAdminValueIsNormalizedAsTheKeyerDoes(t *testing.T) {
	useFakeClock(t)
	s, admin := serveWithAdmin(t, `rate_limit 5 1/5m {
		name login_normalized
		key form username normalize
		key json user.name normalize
	}
	respond "ok"`)
	attempt := func() int {
		return s.do(http.MethodPost, "/login", "username=Alice", "Content-Type: application/x-www-form-urlencoded").status
	}
	for range 5 {
		attempt()
	}
	if got := attempt(); got != 429 {
		t.Fatalf("the sixth attempt on Alice: %d, want 429", got)
	}
	url := admin + "/rate_limit/buckets?policy=login_normalized&keyer=form&value=Alice"
	var got bucketState
	if status := getJSON(t, url, &got); status != 200 || got.Remaining != 0 {
		t.Errorf("GET value=Alice: %d, remaining %d; want the locked-out bucket, 0 remaining (key_id %s)", status, got.Remaining, got.KeyID)
	}
	if status, body := adminDo(t, http.MethodDelete, url); status != 200 {
		t.Fatalf("DELETE: %d %s", status, body)
	}
	if got := attempt(); got != 200 {
		t.Errorf("after DELETE value=Alice, Alice's next attempt: %d, want 200", got)
	}
}
