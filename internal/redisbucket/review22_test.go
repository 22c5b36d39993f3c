package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Defect: in Redis strict mode, a waiter's give-back (hang-up, max_waiting
// overflow) does not clear the deny cache, so the next request of the
// client is refused from memory although Redis would let it wait for the
// given-back tokens. Breaks: "A waiter whose client goes away gives its
// tokens back at once, so the next request may take them" (issue 22), and
// the deny cache's own "denies only what Redis would".
func TestReview22GiveBackOfAWaiterIsHiddenByTheDenyCache(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	// rate 10/s, capacity 1, max_wait 1s: 11 fit (1 now, 10 waiting).
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	key := bucketFor("review22-denycache")
	for i := range 11 {
		res, err := s.Take(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("take %d: %+v, %v; want allowed (waiting)", i, res, err)
		}
	}
	// The 12th would wait 1.1 s: refused, retry in about 100 ms, and the
	// deny cache remembers it.
	res, err := s.Take(bg, key, l, 1)
	if err != nil || res.Allowed {
		t.Fatalf("12th take: %+v, %v; want refused", res, err)
	}
	// The 5 last waiters hang up: their tokens go back, in one call.
	if err := s.GiveBack(bg, key, l, 5); err != nil {
		t.Fatal(err)
	}
	// Redis itself now lets a request wait ~0.6 s for them...
	var out [1]bucket.Result
	if _, _, err := s.takeAll(bg, "peek", string(key), []bucket.Limit{l}, 0, out[:], false); err != nil {
		t.Fatal(err)
	}
	// ...so the client's next request must be allowed (waiting).
	res, err = s.Take(bg, key, l, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !res.Allowed {
		t.Fatalf("after 5 waiters gave their tokens back, the next request: %+v (deny cache hits %d); want allowed, waiting about 600 ms", res, s.DenyCacheHits())
	}
	if res.Wait > 700_000 {
		t.Fatalf("allowed with wait %d µs, want about 600 ms", res.Wait)
	}
}
