package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// on_store_error local reconcile: what a node admitted alone while the
// store failed is charged to the shared bucket once the store answers.

// sharedRemaining reads the shared bucket of the client ip through the
// handler's store, as the admin API does: its first limit's remaining.
func sharedRemaining(t *testing.T, h *Handler, ip string) int64 {
	t.Helper()
	r := benchRequest(ip)
	d := h.newDecision(r)
	if err := nameAndChoose(h, r, d); err != nil {
		t.Fatal(err)
	}
	out := make([]bucket.Result, d.tier.shape().Parts())
	if err := h.store.peek(context.Background(), &d.bucket, d.tier.shape(), out); err != nil {
		return -1
	}
	return out[0].Remaining
}

// failing answers 500 to requests whose path is /fail, so that count_status
// 2xx gives their tokens back.
var failing = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
	if r.URL.Path == "/fail" {
		return caddyhttp.Error(http.StatusInternalServerError, errors.New("origin failed"))
	}
	return nil
})

func requestTo(ip, path string) *http.Request {
	r := benchRequest(ip)
	r.URL.Path = path
	return r
}

// TestReconcileChargesTheSharedBucketOnceWithWhatTheNodeAdmittedAlone cuts
// a node from Redis, lets its fallback admit (and give back) requests,
// restores the link, and reads the shared bucket: it is charged what the
// node kept (taken minus given back), once, and the fallback's refusal
// did not reach the deny cache.
func TestReconcileChargesTheSharedBucketOnceWithWhatTheNodeAdmittedAlone(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-once",
		"store": {"store": "redis", "addresses": ["redis://%s"], "timeout": "100ms", "breaker_cooldown": "50ms"},
		"on_store_error": "local", "on_store_error_share": "1/2", "on_store_error_reconcile": true,
		"count_status": ["2xx"],
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, proxy.Addr()))
	defer done()
	const client, prober = "192.0.2.20", "192.0.2.21"

	proxy.Cut()
	// The fallback holds 5 (10 x 1/2): 3 kept, 2 given back (500), 2
	// kept, then one refused.
	for i, c := range []struct {
		path string
		want int
	}{{"/", 200}, {"/", 200}, {"/", 200}, {"/fail", 500}, {"/fail", 500}, {"/", 200}, {"/", 200}, {"/", 429}} {
		if w, _ := serveOne(h, requestTo(client, c.path), failing); w.Code != c.want {
			t.Fatalf("cut off, request %d to %s: %d, want %d from the fallback", i+1, c.path, w.Code, c.want)
		}
	}
	proxy.Restore()

	// A request of another client reaches Redis once the breaker lets one
	// through; the node then charges the client's bucket what it kept.
	const kept = 5
	waitFor(t, 5*time.Second, "the shared bucket charged what the node admitted alone", func() bool {
		serveOne(h, benchRequest(prober), nopHandler)
		return sharedRemaining(t, h, client) == 10-kept
	})
	for range 5 {
		serveOne(h, benchRequest(prober), nopHandler)
	}
	if h.owed != nil {
		h.owed.wait()
	}
	if got := sharedRemaining(t, h, client); got != 10-kept {
		t.Fatalf("after more calls that succeeded: the shared bucket has %d left; want %d: charged once", got, 10-kept)
	}
	// The fallback refused the client, but Redis has tokens for it.
	if w, _ := serveOne(h, benchRequest(client), nopHandler); w.Code != http.StatusOK {
		t.Fatalf("the client once the store answers: %d, want 200 (a fallback refusal is no denial of the shared bucket's)", w.Code)
	}
}

// TestAFallbackBucketBeyondTheBoundIsCountedLost: the counts are bounded;
// a bucket first admitted once the bound is reached loses its count, and
// the metric says how many tokens.
func TestAFallbackBucketBeyondTheBoundIsCountedLost(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	h, done := provisionedHandlerWith(t, fmt.Sprintf(`{
		"name": "reconcile-lost",
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms"},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, freePort(t)), func(h *Handler) { h.clocks, h.owedMax = clock.clocks(), 1 })
	defer done()
	lost := reconcileLostTokens.WithLabelValues("reconcile-lost")
	before := counterValue(t, lost)
	for _, ip := range []string{"192.0.2.30", "192.0.2.31", "192.0.2.31"} {
		if w, _ := serveOne(h, benchRequest(ip), nopHandler); w.Code != http.StatusOK {
			t.Fatalf("cut off: %d, want 200 from the fallback", w.Code)
		}
	}
	if got := counterValue(t, lost) - before; got != 2 {
		t.Fatalf("lost tokens: %v; want 2, the second bucket's (the bound is 1 bucket)", got)
	}
}

// TestAConfigThatUnloadsDuringACutCountsWhatItCouldNotCharge: drain, at
// unload, charges within the store's timeout; with the store still down,
// every count is lost, and counted.
func TestAConfigThatUnloadsDuringACutCountsWhatItCouldNotCharge(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-unload",
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms"},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, freePort(t)))
	lost := reconcileLostTokens.WithLabelValues("reconcile-unload")
	before := counterValue(t, lost)
	for range 3 {
		serveOne(h, benchRequest("192.0.2.40"), nopHandler)
	}
	start := time.Now()
	done()
	if took := time.Since(start); took > 2*time.Second {
		t.Errorf("unloading took %s; want about the store's timeout", took)
	}
	if got := counterValue(t, lost) - before; got != 3 {
		t.Fatalf("lost tokens at unload with the store down: %v; want 3", got)
	}
}

// TestACaddyfileShareAndReconcileWorkThroughCaddy loads the setting as a
// Caddyfile into Caddy: cut off from Redis, the node enforces a quarter of
// the limit and says so in its headers; once Redis answers, the admin API
// shows the shared bucket charged what the node admitted.
func TestACaddyfileShareAndReconcileWorkThroughCaddy(t *testing.T) {
	useFakeClock(t)
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit 8 1/h {
		name reconcile_caddy
		store redis {
			address redis://%s
			timeout 100ms
			breaker_cooldown 50ms
		}
		on_store_error local 1/4 reconcile
	}
	respond "ok"`, proxy.Addr()))
	const client, prober = "127.0.0.70", "127.0.0.71"

	proxy.Cut()
	for i, want := range []int{200, 200, 429} {
		r := s.from(client, "/")
		if r.status != want || r.header.Get("X-RateLimit-Limit") != "2" {
			t.Fatalf("cut off, request %d: %d with X-RateLimit-Limit %q; want %d and 2 (8 x 1/4)", i+1, r.status, r.header.Get("X-RateLimit-Limit"), want)
		}
	}
	proxy.Restore()

	url := admin + "/rate_limit/buckets?policy=reconcile_caddy&value=" + client
	var got struct {
		Remaining int64 `json:"remaining"`
	}
	waitFor(t, 5*time.Second, "the admin API to show the shared bucket charged 2", func() bool {
		s.from(prober, "/")
		return getJSON(t, url, &got) == http.StatusOK && got.Remaining == 6
	})
}

// TestAnAdminResetForgetsWhatTheFallbackOwes: a bucket reset through the
// admin API during a cut is not charged its earlier count once the store
// answers: the reset forgave it.
func TestAnAdminResetForgetsWhatTheFallbackOwes(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-reset",
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms"},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, freePort(t)))
	lost := reconcileLostTokens.WithLabelValues("reconcile-reset")
	before := counterValue(t, lost)
	r := benchRequest("192.0.2.50")
	for range 2 {
		serveOne(h, r, nopHandler)
	}
	d := h.newDecision(r)
	if err := nameAndChoose(h, r, d); err != nil {
		t.Fatal(err)
	}
	resetBucket(context.Background(), h, &d.bucket)
	done() // the store is still down: whatever is owed is lost, and counted
	if got := counterValue(t, lost) - before; got != 0 {
		t.Fatalf("tokens still owed after an admin reset: %v; want 0", got)
	}
}

// TestReconcileChargesNoTokenALeaseCovered: with leases, requests a lease
// covers while Redis is cut off are decided by the lease table, which
// took those tokens from the shared bucket already; reconcile charges only
// what the fallback admitted after it.
func TestReconcileChargesNoTokenALeaseCovered(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 0)
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-lease",
		"store": {"store": "redis", "addresses": ["redis://%s"], "timeout": "100ms", "breaker_cooldown": "50ms",
			"lease": "8", "lease_ttl": "30s"},
		"on_store_error": "local", "on_store_error_share": "1/4", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 40, "refill": "1/h"}]
	}`, proxy.Addr()))
	defer done()
	const client, prober = "192.0.2.60", "192.0.2.61"
	r := benchRequest(client)
	d := h.newDecision(r)
	if err := nameAndChoose(h, r, d); err != nil {
		t.Fatal(err)
	}
	b := d.bucket
	b.Value = append([]byte(nil), b.Value...)

	admitted := 0
	for range 6 {
		if w, _ := serveOne(h, benchRequest(client), nopHandler); w.Code == http.StatusOK {
			admitted++
		}
	}
	// Until no lease call is in flight: one whose answer the cut lost
	// would hold tokens out on lease that no node spends.
	var last [2]int64
	var since time.Time
	waitFor(t, 5*time.Second, "the node to hold leased tokens, no lease call in flight", func() bool {
		now := [2]int64{h.store.(leaseHolder).held(&b), sharedRemaining(t, h, client)}
		if now != last {
			last, since = now, time.Now()
		}
		return now[0] > 0 && time.Since(since) > 200*time.Millisecond
	})
	heldAtCut := h.store.(leaseHolder).held(&b)
	t.Logf("%d admitted before the cut; %d tokens leased at the cut", admitted, heldAtCut)

	proxy.Cut()
	fromFallback := 0
	for i := 0; ; i++ {
		w, _ := serveOne(h, benchRequest(client), nopHandler)
		if w.Code != http.StatusOK {
			break
		}
		if int64(i) >= heldAtCut {
			fromFallback++
		}
		admitted++
	}
	if fromFallback != 40/4 {
		t.Fatalf("cut off with %d tokens leased: the fallback admitted %d after them; want %d (40 x 1/4)", heldAtCut, fromFallback, 40/4)
	}
	proxy.Restore()

	// Every admitted request took one token from the shared bucket, once:
	// from a lease, from Redis, or charged by reconcile.
	waitFor(t, 5*time.Second, "the shared bucket charged the fallback's count", func() bool {
		serveOne(h, benchRequest(prober), nopHandler)
		return sharedRemaining(t, h, client) == int64(40-admitted)
	})
	for range 5 {
		serveOne(h, benchRequest(prober), nopHandler)
	}
	h.owed.wait()
	if got := sharedRemaining(t, h, client); got != int64(40-admitted) {
		t.Fatalf("the shared bucket has %d left after %d admitted (%d from a lease while cut off); want %d", got, admitted, heldAtCut, 40-admitted)
	}
}

// What the fallback owes for a client named by a keyer after the first is
// forgiven by a reset of the bucket as the admin endpoint names it, from
// the policy, tier, keyer and value alone.
func TestAResetOfTheBucketAsTheAdminNamesItForgetsWhatTheFallbackOwes(t *testing.T) {
	t.Parallel()
	h, done := provisionedHandlerOn(t, newFakeClock().clocks(), fmt.Sprintf(`{
		"name": "reconcile-reset-named",
		"keys": [{"keyer": "header", "field": "X-First"}, {"keyer": "header", "field": "X-Key"}],
		"store": {"store": "redis", "addresses": ["redis://127.0.0.1:%d"], "timeout": "50ms"},
		"on_store_error": "local", "on_store_error_reconcile": true,
		"tiers": [{"name": "t", "capacity": 10, "refill": "1/h"}]
	}`, freePort(t)))
	lost := reconcileLostTokens.WithLabelValues("reconcile-reset-named")
	before := counterValue(t, lost)
	r := benchRequest("192.0.2.52")
	r.Header.Set("X-Key", "kay")
	for range 2 {
		if w, _ := serveOne(h, r, nopHandler); w.Code != http.StatusOK {
			t.Fatalf("a request the fallback decides: %d", w.Code)
		}
	}
	resetBucket(context.Background(), h, &Bucket{Policy: h.Name, Tier: "t", Keyer: "header/X-Key", Value: []byte("kay")})
	done() // the store is still down: whatever is owed is lost, and counted
	if got := counterValue(t, lost) - before; got != 0 {
		t.Fatalf("tokens still owed after a reset of the bucket as the admin names it: %v; want 0", got)
	}
}
