package ratelimit

import (
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// Defect: the RateLimit (IETF) field of a request that waited is rendered
// with the reset time computed before the wait: t= (seconds until full)
// is stale by the whole wait. Breaks DESIGN section 4 ("t is seconds until
// full") for max_wait's waited requests (section 12).
func TestReview22IETFResetOfAWaitedRequestIsStaleByItsWait(t *testing.T) {
	skipUnderShort(t, "real-time")
	h, done := provisionedHandler(t, `{"name":"review22_ietf","headers":"both","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":2000000000,"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`)
	defer done()
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	// The second request waits 1 s for its token; when it goes on, the
	// bucket is full again 1 s later.
	w := httptest.NewRecorder()
	start := time.Now()
	if err := h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	waited := time.Since(start)
	full := start.Add(2 * time.Second)
	got := w.Header().Get("RateLimit")
	want := fmt.Sprintf(`"default";r=0;t=%d`, int((time.Until(full)+time.Second-1)/time.Second))
	if waited < 900*time.Millisecond {
		t.Fatalf("the second request waited %v, want about 1 s", waited)
	}
	if got != want {
		t.Fatalf("after waiting %v, RateLimit: %s; want %s (the bucket is full %v after the response)", waited.Round(time.Millisecond), got, want, time.Until(full).Round(time.Millisecond))
	}
}

// Defect: max_wait below a microsecond (500ns) is accepted at adapt time
// but truncated to 0 µs in validateWait (wait.go:49), which silently
// turns waiting off: the handler refuses instead of waiting, and the
// listing shows no max_wait. Breaks: "bad values (max_wait 0 ...) are
// adapt errors naming the value".
func TestReview22SubMicrosecondMaxWaitSilentlyMeansNoWait(t *testing.T) {
	site := fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit 1 10/s {\n\t\tmax_wait 500ns\n\t}\n\trespond ok\n}\n", freePort(t))
	cfg, err := adaptCaddyfile(site)
	if err != nil {
		return // refused at adapt: fine
	}
	hs := findHandlers(t, cfg)
	if len(hs) != 1 {
		t.Fatalf("adapted: %s", cfg)
	}
	if hs[0].MaxWait == 0 {
		return
	}
	if hs[0].Tiers[0].maxWait == 0 {
		t.Fatalf("max_wait %v adapts without error (%s), but the tier's max_wait is 0 µs: no request will ever wait", time.Duration(hs[0].MaxWait), strings.TrimSpace(string(cfg)))
	}
}

// Defect: in Redis strict mode, the deny cache keeps refusing a client
// after its waiters hung up and gave their tokens back, though Redis
// would let the next request wait for them (store.go Take; GiveBack does
// not forget the key's denial). Breaks: "A waiter whose client goes away
// gives its tokens back at once, so the next request may take them".
func TestReview22HungUpWaitersTokensAreRefusedByTheDenyCache(t *testing.T) {
	srv := startRedis(t)
	// 1/s, capacity 1, max_wait 10s: 11 fit, the 12th is refused for 1 s.
	h, done := provisionedHandler(t, fmt.Sprintf(`{"name":"review22_deny","keys":[{"keyer":"header","field":"X-Key"}],"max_wait":10000000000,"store":{"store":"redis","addresses":[%q],"timeout":2000000000},"tiers":[{"name":"default","capacity":1,"refill":"1/s"}]}`, srv.addr()))
	defer done()
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err != nil {
		t.Fatal(err)
	}
	stay, leave := context.WithCancel(context.Background())
	gone, hangUp := context.WithCancel(context.Background())
	defer leave()
	defer hangUp()
	var wg sync.WaitGroup
	for i := range 10 {
		ctx := stay
		if i >= 5 {
			ctx = gone
		}
		wg.Go(func() {
			_ = h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")).WithContext(ctx), nopHandler)
		})
	}
	defer wg.Wait()
	for deadline := time.Now().Add(5 * time.Second); h.waiting.Load() != 10; {
		if time.Now().After(deadline) {
			t.Fatalf("%d waiting, want 10", h.waiting.Load())
		}
		time.Sleep(time.Millisecond)
	}
	if err := h.ServeHTTP(httptest.NewRecorder(), keyed(benchRequest("127.0.0.1")), nopHandler); err == nil {
		t.Fatal("the 12th request: allowed, want refused (it would wait 11 s)")
	}
	// 5 waiters hang up: 5 tokens back.
	hangUp()
	for h.waiting.Load() != 5 {
		time.Sleep(time.Millisecond)
	}
	// The next request would wait about 6 s: allowed, and waiting.
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	w := httptest.NewRecorder()
	go func() { errc <- h.ServeHTTP(w, keyed(benchRequest("127.0.0.1")).WithContext(ctx), nopHandler) }()
	time.Sleep(200 * time.Millisecond)
	cancel()
	err := <-errc
	leave()
	if err != nil {
		t.Fatalf("after 5 waiters hung up and gave their tokens back, the next request: %v (Retry-After %q); want it to wait for them", err, w.Header().Get("Retry-After"))
	}
}
