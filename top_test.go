package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// getJSON GETs an admin URL and decodes its JSON answer into v.
func getJSON(t *testing.T, url string, v any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %d, decoding: %v", url, resp.StatusCode, err)
	}
	return resp.StatusCode
}

func TestTopListsTheBucketsDeniedMost(t *testing.T) {
	useFakeClock(t)
	s, admin := serveWithAdmin(t, `
	rate_limit 1 1/h {
		name top_policy
	}
	respond "{http.rate_limit.key_id}"`)
	ids := map[string]string{}
	for client, requests := range map[string]int{"127.0.0.2": 31, "127.0.0.3": 11, "127.0.0.4": 6, "127.0.0.5": 1} {
		ids[client] = s.from(client, "/").body // the allowed first request shows the key_id
		for range requests - 1 {
			s.from(client, "/")
		}
	}
	var top []topDenied
	if status := getJSON(t, admin+"/rate_limit/top?policy=top_policy&n=2", &top); status != 200 {
		t.Fatalf("GET /rate_limit/top: %d", status)
	}
	if len(top) != 2 {
		t.Fatalf("top 2: %d rows: %+v", len(top), top)
	}
	for i, want := range []struct {
		client string
		denied int64
	}{{"127.0.0.2", 30}, {"127.0.0.3", 10}} {
		got := top[i]
		if got.KeyID != ids[want.client] || got.Denied != want.denied || got.Tier != "default" || got.Keyer != "ip/32/64" || got.LastDenied.IsZero() {
			t.Errorf("row %d: %+v; want %s (key_id %s) denied %d times", i, got, want.client, ids[want.client], want.denied)
		}
	}
	var e map[string]any
	if status := getJSON(t, admin+"/rate_limit/top?policy=nope", &e); status != 404 || e["error"] == nil {
		t.Errorf("unknown policy: %d %v, want 404 with a JSON error", status, e)
	}
	if status := getJSON(t, admin+"/rate_limit/top?policy=top_policy&n=0", &e); status != 400 {
		t.Errorf("n=0: %d, want 400", status)
	}
}

// A flood of distinct denied keys keeps the record bounded: the sketch
// holds at most topEntries buckets, the exceeded set at most maxExceeded,
// and a bucket denied far more than the flood's keys stays on top.
func TestTopStaysBoundedUnderAFloodOfDistinctKeys(t *testing.T) {
	d := &denials{cur: sketch{}, prev: sketch{}, exceeded: map[denialKey]int64{}}
	now := time.Unix(1_800_000_000, 0)
	heavy := denialKey{tier: "default", keyer: "ip/32/64", keyID: "heavy"}
	flood := 1_000_000
	if raceEnabled || testing.Short() {
		flood = 100_000
	}
	for i := range flood {
		if i%100 == 0 {
			d.record(heavy, now, 1, time.Hour)
		}
		d.record(denialKey{tier: "default", keyer: "ip/32/64", keyID: strconv.Itoa(i)}, now, 1, time.Hour)
	}
	if len(d.cur) > topEntries || len(d.prev) > topEntries || len(d.exceeded) > maxExceeded {
		t.Fatalf("after %d distinct keys: sketches %d and %d, exceeded %d; want at most %d and %d", flood, len(d.cur), len(d.prev), len(d.exceeded), topEntries, maxExceeded)
	}
	top := d.top(now, 1)
	if len(top) != 1 || top[0].KeyID != "heavy" || top[0].Denied < int64(flood/100) {
		t.Errorf("top after the flood: %+v; want the heavy bucket with at least %d denials", top, flood/100)
	}
}

func TestPoliciesShowWhatRuns(t *testing.T) {
	srv := startRedis(t)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`
	route /local/* {
		rate_limit 5 1/s {
			name local_policy
			key header X-Key
			tier bots 2 1/m {
				match {
					header User-Agent *bot*
				}
			}
		}
		respond "ok"
	}
	route /shared/* {
		rate_limit 100 10/s {
			name shared_policy
			store redis {
				address %s
				lease 10%%
				breaker_failures 1
				breaker_cooldown 1h
				timeout 500ms
			}
		}
		respond "ok"
	}`, srv.url()))
	s.from("127.0.0.2", "/local/", "X-Key: a")
	s.from("127.0.0.2", "/local/", "X-Key: b")
	s.from("127.0.0.2", "/shared/")
	s.from("127.0.0.2", "/shared/") // the second lease is 2 tokens: one held

	var views []policyView
	if status := getJSON(t, admin+"/rate_limit/policies", &views); status != 200 || len(views) < 2 {
		t.Fatalf("GET /rate_limit/policies: %d, %+v", status, views)
	}
	byName := map[string]policyView{}
	for _, v := range views {
		byName[v.Policy] = v
	}
	local, shared := byName["local_policy"], byName["shared_policy"]
	if got := fmt.Sprintf("%v %s %d", local.Keyers, local.Store, local.Keys); got != "[header/X-Key ip/32/64] local 2" {
		t.Errorf("local policy: keyers, store, keys %q; want [header/X-Key ip/32/64] local 2", got)
	}
	if got := fmt.Sprintf("%+v", local.Tiers); got != "[{Name:bots Limits:[{Capacity:2 Refill:1/m}] Cost:1 CostPlaceholder: Unlimited:false Deny:false} {Name:default Limits:[{Capacity:5 Refill:1/s}] Cost:1 CostPlaceholder: Unlimited:false Deny:false}]" {
		t.Errorf("local policy tiers: %s", got)
	}
	if shared.Store != "redis" || shared.Breaker != "closed" || shared.Leases != 1 {
		t.Errorf("shared policy: store %q, breaker %q, leases %d; want redis, closed, 1", shared.Store, shared.Breaker, shared.Leases)
	}

	srv.kill()
	for i := range 3 { // new clients, which hold no lease, must ask Redis
		s.from("127.0.1."+strconv.Itoa(i+1), "/shared/")
	}
	getJSON(t, admin+"/rate_limit/policies", &views)
	for _, v := range views {
		if v.Policy == "shared_policy" && (v.Breaker != "open" || v.Keys == 0) {
			t.Errorf("with Redis killed: breaker %q, fallback keys %d; want open and the on_store_error local buckets", v.Breaker, v.Keys)
		}
	}
}

// exceededRecorder is an events handler that keeps what it hears.
type exceededRecorder struct{}

var heardExceeded = struct {
	sync.Mutex
	events []map[string]any
}{}

func (exceededRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.rate_limit_test_recorder", New: func() caddy.Module { return exceededRecorder{} }}
}

func (exceededRecorder) Handle(_ context.Context, e caddy.Event) error {
	heardExceeded.Lock()
	heardExceeded.events = append(heardExceeded.events, e.Data)
	heardExceeded.Unlock()
	return nil
}

func init() { caddy.RegisterModule(exceededRecorder{}) }

var _ caddyevents.Handler = exceededRecorder{}

// A flood of denials emits rate_limit_exceeded once per bucket that starts
// being denied, never once per request, and again once the bucket could
// have allowed in between.
func TestExceededEventOncePerBucket(t *testing.T) {
	clock := useFakeClock(t)
	port := freePort(t)
	cfg, err := adaptCaddyfile(fmt.Sprintf("{\n\tadmin off\n\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}\n}\nhttp://127.0.0.1:%d {\n\trate_limit 2 1/s {\n\t\tname events_policy\n\t}\n\trespond \"ok\"\n}\n", port))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(cfg, &doc); err != nil {
		t.Fatal(err)
	}
	doc["apps"].(map[string]any)["events"] = map[string]any{"subscriptions": []any{map[string]any{
		"events": []string{"rate_limit_exceeded"}, "handlers": []any{map[string]any{"handler": "rate_limit_test_recorder"}},
	}}}
	cfg, _ = json.Marshal(doc)
	heardExceeded.Lock()
	heardExceeded.events = nil
	heardExceeded.Unlock()
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	s := &testServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port), port: port, client: &http.Client{Timeout: 10 * time.Second}}

	const buckets, perBucket = 5, 40
	for c := range buckets {
		for range perBucket {
			s.from("127.0.2."+strconv.Itoa(c+1), "/")
		}
	}
	heardExceeded.Lock()
	events := append([]map[string]any(nil), heardExceeded.events...)
	heardExceeded.Unlock()
	if len(events) != buckets {
		t.Fatalf("%d denied requests over %d buckets emitted %d events; want %d", buckets*(perBucket-2), buckets, len(events), buckets)
	}
	for _, e := range events {
		if e["policy"] != "events_policy" || e["tier"] != "default" || e["keyer"] != "ip/32/64" || len(fmt.Sprint(e["key_id"])) != 16 || e["retry_after"] != 1 {
			t.Errorf("event data %v", e)
		}
	}
	// Once the retry time has passed, a bucket denied again starts a new
	// episode.
	clock.advance(2 * time.Second)
	for range 4 {
		s.from("127.0.2.1", "/")
	}
	heardExceeded.Lock()
	defer heardExceeded.Unlock()
	if len(heardExceeded.events) != buckets+1 {
		t.Errorf("after the bucket refilled and was denied again: %d events, want %d", len(heardExceeded.events), buckets+1)
	}
}
