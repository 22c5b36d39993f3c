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
	forgetDenials("top_policy")
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
	latestHandler("top_policy").notes.flush()
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
	d := newDenials()
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
	if d.cur.Len() > topEntries || d.prev.Len() > topEntries || d.exceeded.Len() > maxExceeded {
		t.Fatalf("after %d distinct keys: sketches %d and %d, exceeded %d; want at most %d and %d", flood, d.cur.Len(), d.prev.Len(), d.exceeded.Len(), topEntries, maxExceeded)
	}
	top := d.top(now, 1)
	if len(top) != 1 || top[0].KeyID != "heavy" || top[0].Denied < int64(flood/100) {
		t.Errorf("top after the flood: %+v; want the heavy bucket with at least %d denials", top, flood/100)
	}
}

// The buckets followed through a denial episode are bounded. Episodes that
// have ended make room; when every one followed is still going, a new
// bucket is not followed (its event suppressed) rather than one of them
// forgotten and told of again.
func TestExceededFollowsEpisodesInBoundedMemory(t *testing.T) {
	d := newDenials()
	now := time.Unix(1_800_000_000, 0)
	key := func(i int) denialKey { return denialKey{tier: "default", keyer: "ip/32/64", keyID: strconv.Itoa(i)} }
	for i := range maxExceeded {
		retry := time.Hour
		if i%2 == 0 {
			retry = time.Second
		}
		if started, followed := d.record(key(i), now, 1, retry); !started || !followed {
			t.Fatalf("bucket %d, first denial: started %v, followed %v; want both", i, started, followed)
		}
	}
	// Full, every episode going on: a new bucket is not followed, and the
	// followed ones do not start again.
	if started, followed := d.record(key(maxExceeded), now, 2, time.Hour); started || followed {
		t.Errorf("new bucket while full: started %v, followed %v; want neither", started, followed)
	}
	for _, i := range []int{0, 1, maxExceeded - 1} {
		if started, _ := d.record(key(i), now, 3, time.Hour); started {
			t.Errorf("bucket %d, denied again within its episode: started again", i)
		}
	}
	// Two seconds on, the episodes of a second have ended (but for bucket
	// 0's, which its last denial extended): they make room.
	mono := int64(2_000_002)
	if started, followed := d.record(key(maxExceeded), now, mono, time.Hour); !started || !followed {
		t.Errorf("new bucket once episodes ended: started %v, followed %v; want both", started, followed)
	}
	if d.exceeded.Len() != maxExceeded/2+2 {
		t.Errorf("%d buckets followed, want %d: the ended episodes dropped", d.exceeded.Len(), maxExceeded/2+2)
	}
	if started, _ := d.record(key(2), now, mono, time.Hour); !started {
		t.Error("bucket 2, denied after its episode ended: not started again")
	}
	if started, _ := d.record(key(0), now, mono, time.Hour); started {
		t.Error("bucket 0, whose episode its last denial extended: started again")
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
	if got := fmt.Sprintf("%+v", local.Tiers); got != "[{Name:bots Limits:[{Capacity:2 Refill:1/m}] Cost:1 CostPlaceholder: MaxWait: Concurrency:0 Quotas:[] Timezone: Unlimited:false Deny:false} {Name:default Limits:[{Capacity:5 Refill:1/s}] Cost:1 CostPlaceholder: MaxWait: Concurrency:0 Quotas:[] Timezone: Unlimited:false Deny:false}]" {
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

// serveWithEvents is serve with Caddy's events app, whose handler (a test
// module) hears rate_limit_exceeded.
func serveWithEvents(t *testing.T, eventHandler, directives string) *testServer {
	t.Helper()
	port := freePort(t)
	cfg, err := adaptCaddyfile(fmt.Sprintf("{\n\tadmin off\n\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}\n}\nhttp://127.0.0.1:%d {\n%s\n}\n", port, directives))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(cfg, &doc); err != nil {
		t.Fatal(err)
	}
	doc["apps"].(map[string]any)["events"] = map[string]any{"subscriptions": []any{map[string]any{
		"events": []string{"rate_limit_exceeded"}, "handlers": []any{map[string]any{"handler": eventHandler}},
	}}}
	cfg, _ = json.Marshal(doc)
	heardExceeded.Lock()
	heardExceeded.events = nil
	heardExceeded.Unlock()
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	return &testServer{t: t, base: "http://127.0.0.1:" + strconv.Itoa(port), port: port, client: &http.Client{Timeout: 10 * time.Second}}
}

// forgetDenials drops a policy's record of denials, which outlives a
// config, so that a test run again starts from none. Call it before the
// config loads.
func forgetDenials(policy string) {
	policyDenials.Lock()
	delete(policyDenials.byPolicy, policy)
	policyDenials.Unlock()
}

// heard is a copy of the events heard so far.
func heard() []map[string]any {
	heardExceeded.Lock()
	defer heardExceeded.Unlock()
	return append([]map[string]any(nil), heardExceeded.events...)
}

// A flood of denials emits rate_limit_exceeded once per bucket that starts
// being denied, never once per request, and again once the bucket could
// have allowed in between.
func TestExceededEventOncePerBucket(t *testing.T) {
	clock := useFakeClock(t)
	forgetDenials("events_policy")
	s := serveWithEvents(t, "rate_limit_test_recorder", `
	rate_limit 2 1/s {
		name events_policy
	}
	respond "ok"`)
	h := latestHandler("events_policy")

	const buckets, perBucket = 5, 40
	for c := range buckets {
		for range perBucket {
			s.from("127.0.2."+strconv.Itoa(c+1), "/")
		}
	}
	h.notes.flush()
	events := heard()
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
	h.notes.flush()
	if events := heard(); len(events) != buckets+1 {
		t.Errorf("after the bucket refilled and was denied again: %d events, want %d", len(events), buckets+1)
	}
}

// floodIP is the i-th of many client addresses, as a keyer reads them.
func floodIP(i int) string {
	return fmt.Sprintf("127.%d.%d.%d", i>>16&255, i>>8&255, i&255)
}

// Ten thousand buckets denied at once, again and again: each emits
// rate_limit_exceeded at most once in its episode, even when there are more
// of them than the node follows (it then stays silent for the rest, rather
// than forgetting one and telling of it again).
func TestExceededEventOncePerBucketUnderAFloodOfBuckets(t *testing.T) {
	useFakeClock(t)
	forgetDenials("flood_events")
	serveWithEvents(t, "rate_limit_test_recorder", `
	rate_limit 1 1/h {
		name flood_events
	}
	respond "ok"`)
	h := latestHandler("flood_events")
	w := &headerSink{h: make(http.Header)}
	const buckets = 10_000
	for range 4 { // the first request of each bucket is allowed
		for i := range buckets {
			_ = h.ServeHTTP(w, benchRequest(floodIP(i)), nopHandler)
		}
		h.notes.flush()
	}
	events := heard()
	perKey := map[string]int{}
	again := 0
	for _, e := range events {
		if perKey[fmt.Sprint(e["key_id"])]++; perKey[fmt.Sprint(e["key_id"])] > 1 {
			again++
		}
	}
	if again > 0 {
		t.Errorf("%d events told again of a bucket in the same episode", again)
	}
	if len(events) < maxExceeded || len(events) > buckets {
		t.Errorf("%d events for %d buckets denied; want from %d (as many as the node follows) to %d", len(events), buckets, maxExceeded, buckets)
	}
	if len(events) < buckets && h.notes.suppressed.Load() == 0 {
		t.Errorf("%d events for %d buckets denied, and none counted as suppressed", len(events), buckets)
	}
}

// eventBlocker is an events handler that holds every event until the test
// releases it: a slow webhook, say.
type eventBlocker struct{}

// eventsHeld is closed to release the events eventBlocker holds.
var eventsHeld = struct {
	sync.Mutex
	release chan struct{}
}{}

func (eventBlocker) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.rate_limit_test_blocker", New: func() caddy.Module { return eventBlocker{} }}
}

func (eventBlocker) Handle(context.Context, caddy.Event) error {
	eventsHeld.Lock()
	release := eventsHeld.release
	eventsHeld.Unlock()
	<-release
	return nil
}

func init() { caddy.RegisterModule(eventBlocker{}) }

// Noting a denial never waits for the event's handlers, nor for the lock
// of the policy's record: a handler that blocks stalls no request. What
// the recorder cannot take meanwhile is dropped and counted.
func TestBlockedEventHandlerDoesNotStallRequests(t *testing.T) {
	useFakeClock(t)
	forgetDenials("blocked_events")
	release := make(chan struct{})
	eventsHeld.Lock()
	eventsHeld.release = release
	eventsHeld.Unlock()
	serveWithEvents(t, "rate_limit_test_blocker", `
	rate_limit 1 1/h {
		name blocked_events
	}
	respond "ok"`)
	t.Cleanup(func() { close(release) })
	h := latestHandler("blocked_events")
	const buckets = 10_000
	served := make(chan struct{})
	go func() {
		defer close(served)
		w := &headerSink{h: make(http.Header)}
		for range 2 {
			for i := range buckets {
				_ = h.ServeHTTP(w, benchRequest(floodIP(i)), nopHandler)
			}
		}
	}()
	select {
	case <-served:
	case <-time.After(30 * time.Second):
		t.Fatal("requests stalled behind an event handler that blocks")
	}
	if dropped := h.notes.dropped.Load(); dropped < 1 {
		t.Errorf("denials dropped: %d, want some counted while the recorder was held up", dropped)
	}
}
