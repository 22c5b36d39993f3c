package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// The measured claims of issue 24 (calendar quotas) on real processes, and
// the cost of a quota on the allowed path.

// quotaNode is one Caddy process of the quota test.
type quotaNode struct{ port, admin int }

func (n quotaNode) base() string      { return fmt.Sprintf("http://127.0.0.1:%d", n.port) }
func (n quotaNode) adminBase() string { return fmt.Sprintf("http://127.0.0.1:%d", n.admin) }

// quotaCaddyfile is a node's config, on one redis-server at redisURL:
//   - /rl: policy quota_rl, `tier all 5 1/m { quota 8/day }`, respond ok;
//   - anything else: policy quota_fleet, `tier all 1000 1000/s { quota
//     50/day }`, in front of origin.
//
// Both key by X-Key; /ready is outside the limits. A store error answers
// 503, so that it cannot pass for an admission or a quota refusal.
func quotaCaddyfile(node quotaNode, redisURL, origin string) string {
	return fmt.Sprintf(`{
	admin 127.0.0.1:%d
	persist_config off
}
http://127.0.0.1:%d {
	bind 127.0.0.1
	handle /ready {
		respond "ready"
	}
	handle /rl {
		rate_limit {
			name quota_rl
			headers both
			key header X-Key
			tier all 5 1/m {
				quota 8/day
			}
			store redis {
				address %s
				timeout 5s
			}
			on_store_error deny
		}
		respond "ok"
	}
	handle {
		rate_limit {
			name quota_fleet
			key header X-Key
			tier all 1000 1000/s {
				quota 50/day
			}
			store redis {
				address %s
				timeout 5s
			}
			on_store_error deny
		}
		reverse_proxy %s
	}
}
`, node.admin, node.port, redisURL, redisURL, origin)
}

// quotaAnswer is one request as the client saw it.
type quotaAnswer struct {
	status                  int // 0: a transport error
	retryAfter, limit, ietf string
	at                      time.Time // when the answer came
	err                     error
}

func quotaGet(client *http.Client, url, key string) quotaAnswer {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return quotaAnswer{err: err}
	}
	req.Header.Set("X-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return quotaAnswer{err: err, at: time.Now()}
	}
	_, err = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return quotaAnswer{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), limit: resp.Header.Get("X-Ratelimit-Limit"), ietf: resp.Header.Get("RateLimit"), at: time.Now(), err: err}
}

// untilUTCMidnight is the time from t to the next midnight UTC.
func untilUTCMidnight(t time.Time) time.Duration {
	u := t.UTC()
	return time.Date(u.Year(), u.Month(), u.Day()+1, 0, 0, 0, 0, time.UTC).Sub(t)
}

// TestQuotaThreeCaddyProcessesAdmitExactlyN runs three real Caddy
// processes on one redis-server with `quota 50/day` (and a rate limit that
// never binds) in front of an origin that counts hits: 300 requests of
// one key at once, spread over the three, get exactly 50 answers 200 and
// 250 answers 429 with Retry-After the seconds to the next midnight UTC
// (±2), and the origin sees exactly 50. Then, on a tier `5 1/m` with
// `quota 8/day`, a second key gets 5 admitted and 10 refused by the rate
// limit, and the quota reads 5 used (by the admin API of every node and
// the refusals' RateLimit header): the refused took nothing.
func TestQuotaThreeCaddyProcessesAdmitExactlyN(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process")
	// Both parts must fall in one day: not across midnight UTC.
	if d := untilUTCMidnight(time.Now()); d < time.Minute {
		t.Logf("%s to midnight UTC: waiting until the next day starts", d.Round(time.Second))
		time.Sleep(d + 2*time.Second)
	}
	const quota, requests = 50, 300
	srv := startRedis(t)
	var hits atomic.Int64
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Key") != "warm-up" {
			hits.Add(1)
		}
		_, _ = io.WriteString(w, "origin")
	}))
	t.Cleanup(origin.Close)
	var nodes []quotaNode
	for range 3 {
		node := quotaNode{port: freePort(t), admin: freePort(t)}
		nodes = append(nodes, node)
		startCaddyProcess(t, node.port, quotaCaddyfile(node, srv.url(), strings.TrimPrefix(origin.URL, "http://")))
	}
	transport := &http.Transport{MaxIdleConnsPerHost: requests}
	client := &http.Client{Transport: transport, Timeout: 20 * time.Second}
	t.Cleanup(transport.CloseIdleConnections)

	// Warm up every node on another key, so that the connections to Redis
	// and the origin are open and the script is loaded.
	for _, node := range nodes {
		for _, path := range []string{"/", "/rl"} {
			if a := quotaGet(client, node.base()+path, "warm-up"); a.status != 200 {
				t.Fatalf("warm-up of %s through node %d: %d %v", path, node.port, a.status, a.err)
			}
		}
	}

	// Part 1: 300 requests of one key at once over the three nodes.
	out := make([]quotaAnswer, requests)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range requests {
		node := nodes[i%len(nodes)]
		wg.Go(func() {
			<-start
			out[i] = quotaGet(client, node.base()+"/", "one-key")
		})
	}
	began := time.Now()
	close(start)
	wg.Wait()
	took := time.Since(began)
	statuses := map[int]int{}
	perNode := make([]int, len(nodes))
	var bad []string
	for i, a := range out {
		statuses[a.status]++
		switch a.status {
		case 200:
			perNode[i%len(nodes)]++
		case 429:
			want := int64(untilUTCMidnight(a.at).Seconds())
			got, err := strconv.ParseInt(a.retryAfter, 10, 64)
			if (err != nil || got < want-2 || got > want+2 || a.limit != strconv.Itoa(quota)) && len(bad) < 10 {
				bad = append(bad, fmt.Sprintf("request %d: 429 with Retry-After %q (want %d ±2, the seconds to midnight UTC) and X-RateLimit-Limit %q (want %d, the quota binding)", i, a.retryAfter, want, a.limit, quota))
			}
		default:
			if len(bad) < 10 {
				bad = append(bad, fmt.Sprintf("request %d: status %d, error %v", i, a.status, a.err))
			}
		}
	}
	t.Logf("%d requests of one key over %d Caddy processes in %s: statuses %v, admitted per node %v; the origin saw %d",
		requests, len(nodes), took.Round(time.Millisecond), statuses, perNode, hits.Load())
	if statuses[200] != quota || statuses[429] != requests-quota {
		t.Errorf("%d answered 200 and %d 429; want exactly %d and %d", statuses[200], statuses[429], quota, requests-quota)
	}
	if len(bad) > 0 {
		t.Errorf("want every request answered 200, or 429 until midnight UTC; got:\n%s", strings.Join(bad, "\n"))
	}
	if h := hits.Load(); h != quota {
		t.Errorf("the origin saw %d requests, want exactly %d", h, quota)
	}
	// The key lives until the day ends (by Redis's clock), no longer.
	var key string
	for _, k := range srv.do("KEYS", "rl:*").([]any) {
		if s := fmt.Sprint(k); !strings.HasSuffix(s, ":c") {
			if ttl := srv.do("PTTL", s).(int64); ttl <= 0 || ttl > untilUTCMidnight(time.Now()).Milliseconds()+3000 {
				t.Errorf("key %q lives %d ms; want until midnight UTC, %d ms", s, ttl, untilUTCMidnight(time.Now()).Milliseconds())
			}
			key = s
		}
	}
	if key == "" {
		t.Errorf("Redis holds no bucket key")
	}

	// Part 2: a refusal by the rate limit takes nothing from the quota.
	// 5 admitted, one after another over the nodes; then 10 at once over
	// the nodes, all refused by the rate limit (its next token is a minute
	// away).
	const second = "second-key"
	for i := range 5 {
		node := nodes[i%len(nodes)]
		if a := quotaGet(client, node.base()+"/rl", second); a.status != 200 {
			t.Fatalf("%s: request %d through node %d: %d %v; want 200 (5 fit the rate limit)", second, i, node.port, a.status, a.err)
		}
	}
	refused := make([]quotaAnswer, 10)
	start = make(chan struct{})
	for i := range refused {
		node := nodes[i%len(nodes)]
		wg.Go(func() {
			<-start
			refused[i] = quotaGet(client, node.base()+"/rl", second)
		})
	}
	close(start)
	wg.Wait()
	for i, a := range refused {
		ra, err := strconv.Atoi(a.retryAfter)
		// Refused by the rate limit: back within a minute, not at midnight;
		// the quota's item reports 3 left of 8.
		if a.status != 429 || err != nil || ra < 1 || ra > 60 || !strings.Contains(a.ietf, `"all-day";r=3;`) {
			t.Errorf("%s: refused request %d: %d, Retry-After %q, RateLimit %q, error %v; want 429 by the rate limit (Retry-After at most 60) with the quota's item at r=3", second, i, a.status, a.retryAfter, a.ietf, a.err)
		}
	}
	admin := &http.Client{Timeout: 5 * time.Second}
	for _, node := range nodes {
		resp, err := admin.Get(node.adminBase() + "/rate_limit/buckets?policy=quota_rl&tier=all&keyer=header&value=" + url.QueryEscape(second))
		if err != nil {
			t.Fatalf("admin GET on node %d: %v", node.port, err)
		}
		var got bucketState
		err = json.NewDecoder(resp.Body).Decode(&got)
		resp.Body.Close()
		if err != nil || resp.StatusCode != 200 || len(got.Quotas) != 1 {
			t.Fatalf("admin GET on node %d: %d, %+v, %v", node.port, resp.StatusCode, got, err)
		}
		q := got.Quotas[0]
		t.Logf("node %d's admin API: quota %+v, limits %+v", node.port, q, got.Limits)
		if q.Quota != "8/day" || q.Used != 5 || q.Left != 3 {
			t.Errorf("node %d's admin API: the quota %+v; want 8/day with 5 used and 3 left (the 10 the rate limit refused took nothing)", node.port, q)
		}
	}
}

// BenchmarkQuota is the allowed path of a tier with a rate limit and a
// monthly quota beside the same tier with the rate limit alone, in one
// run, for the local store and for Redis (one redis-server on loopback).
// Every request must be admitted: a refusal or a store error fails it.
func BenchmarkQuota(b *testing.B) {
	tiers := []struct{ name, tier string }{
		{"limit", `{"name":"default","capacity":1000000000,"refill":"1000000/s"}`},
		{"limit+quota", `{"name":"default","capacity":1000000000,"refill":"1000000/s","quotas":["1000000000/month"]}`},
	}
	run := func(b *testing.B, group, store string) {
		for _, tt := range tiers {
			b.Run(tt.name, func(b *testing.B) {
				h, done := provisionedHandler(b, `{"name":"bench-quota-`+group+`-`+tt.name+`","on_store_error":"deny"`+store+`,"tiers":[`+tt.tier+`]}`)
				defer done()
				benchServe(b, h)
			})
		}
	}
	b.Run("local", func(b *testing.B) { run(b, "local", "") })
	b.Run("redis", func(b *testing.B) {
		srv := startRedis(b)
		run(b, "redis", fmt.Sprintf(`,"store":{"store":"redis","addresses":[%q],"timeout":2000000000}`, srv.url()))
	})
}
