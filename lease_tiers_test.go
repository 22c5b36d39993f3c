package ratelimit

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
)

// Leases on a tier of two limits and a quota, through Caddy and a real
// Redis (issue 25): a client gets exactly what the tightest allows, in
// fewer script calls than requests; the IETF fields name each limit's and
// the quota's own remaining; the admin API shows every limit and quota,
// and DELETE starts all of them over, the node's lease included.
func TestLeasesOnATierOfLimitsAndAQuotaThroughCaddy(t *testing.T) {
	srv := startRedis(t)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`rate_limit {
		name lease_tier
		headers ietf
		key header X-Key
		tier all 20 1/h {
			limit 12 1/h
			quota 9/month
		}
		store redis {
			address %s
			timeout 2s
			lease 50%%
		}
	}
	respond ok`, srv.url()))
	// The quota binds first: 9 of 20 requests, then refusals.
	before := scriptCalls(srv)
	allowed := 0
	var last response
	for range 20 {
		r := s.get("/", "X-Key: ann")
		if r.status == 200 {
			allowed++
			last = r
		}
	}
	calls := scriptCalls(srv) - before
	t.Logf("20 requests, %d allowed, %d script calls", allowed, calls)
	if allowed != 9 {
		t.Fatalf("%d of 20 allowed, want the quota's 9", allowed)
	}
	if calls >= 20 {
		t.Errorf("%d script calls for 20 requests: the leases did not serve them", calls)
	}
	// After the 9th: 20-9 and 12-9 left in the limits, 0 in the quota.
	if got := stripResets(last.header.Get("RateLimit")); got != `"all";r=11, "all-2";r=3, "all-month";r=0` {
		t.Errorf("the 9th request's RateLimit %q; want each limit's and the quota's own remaining", got)
	}
	var got bucketState
	url := admin + "/rate_limit/buckets?policy=lease_tier&keyer=header&value=ann"
	if status := getJSON(t, url, &got); status != 200 || len(got.Limits) != 2 || len(got.Quotas) != 1 {
		t.Fatalf("GET: %d, %+v", status, got)
	}
	// Redis sees what the node leased as taken: at most the 12-token
	// limit's half on lease beside the 9 spent.
	if q := got.Quotas[0]; q.Used < 9 || q.Used+q.Left != 9 {
		t.Errorf("the quota: %+v; want 9 used (the leased tokens counted too)", q)
	}
	for i, l := range got.Limits {
		if l.Remaining > []int64{11, 3}[i] || l.ResetAfter == 0 {
			t.Errorf("limit %d: %+v; want at most %d left, and a reset", i, l, []int64{11, 3}[i])
		}
	}
	req, _ := http.NewRequest(http.MethodDelete, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if status := getJSON(t, url, &got); status != 200 || got.Quotas[0].Used != 0 || got.Limits[0].Remaining != 20 || got.Limits[1].Remaining != 12 {
		t.Fatalf("after DELETE: %d, %+v %+v", status, got.Limits, got.Quotas)
	}
	if r := s.get("/", "X-Key: ann"); r.status != 200 || !strings.Contains(r.header.Get("RateLimit"), `"all-month";r=8`) {
		t.Errorf("after DELETE: %d, RateLimit %q; want allowed, 8 of the quota left", r.status, r.header.Get("RateLimit"))
	}
}
