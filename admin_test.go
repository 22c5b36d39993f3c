package ratelimit

import (
	"fmt"
	"strconv"
	"testing"
	"time"
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

// GET on a banned bucket says it is full when the ban ends, as Retry-After
// does, in every store mode: it said one refill of the capacity from now
// (a minute here), as if the hour's ban were not there.
func TestAdminBucketUnderABanResetsWhenTheBanEnds(t *testing.T) {
	srv := startRedis(t)
	for i, mode := range storeModes(srv) {
		t.Run(mode.name, func(t *testing.T) {
			useFakeClock(t)
			srv.do("FLUSHALL")
			name := fmt.Sprint("admin_ban_", i)
			s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 2 1/m {
		name %s
		ban 1h
		%s
	}
	respond "ok"`, name, mode.store))
			var retry int
			for range 3 {
				r := s.from("127.0.0.2", "/")
				retry, _ = strconv.Atoi(r.header.Get("Retry-After"))
			}
			if retry <= 3600 {
				t.Fatalf("the third request's Retry-After %d, want the ban's hour and more", retry)
			}
			var got adminBucket
			if status := getJSON(t, admin+"/rate_limit/buckets?policy="+name+"&value=127.0.0.2", &got); status != 200 {
				t.Fatalf("GET: %d", status)
			}
			if got.Remaining != 0 || got.ResetAfter < 3600 || got.ResetAfter > int64(retry)+60 {
				t.Errorf("GET under the ban: %+v; want 0 remaining, full again when the ban ends (Retry-After %d)", got.adminLimit, retry)
			}
		})
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
