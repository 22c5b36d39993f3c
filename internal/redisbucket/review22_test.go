package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
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
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("take %d: %+v, %v; want allowed (waiting)", i, res, err)
		}
	}
	// The 12th would wait 1.1 s: refused, retry in about 100 ms, and the
	// deny cache remembers it.
	res, err := s.takeLimit(bg, key, l, 1)
	if err != nil || res.Allowed {
		t.Fatalf("12th take: %+v, %v; want refused", res, err)
	}
	// The 5 last waiters hang up: each gives its token back, as the
	// handler does (a give-back is at most one capacity).
	for range 5 {
		if err := s.GiveBack(bg, key, oneLimit(l), 1, 1, 0); err != nil {
			t.Fatal(err)
		}
	}
	// Redis now lets the client's next request wait ~0.6 s for them.
	res, err = s.takeLimit(bg, key, l, 1)
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

// Defect: with leases, a waiter's give-back goes into this node's lease
// (giveBackHeld) although its tokens came from the shared bucket, where
// the queue keeps their deficit: the node then admits the next requests
// at once, with no wait, while one bucket (strict mode, same history)
// makes them wait their turn. Breaks: "leases: ... takes its tokens there
// as strict mode does; never more admitted than strict mode", and "the
// origin never sees two of that client's requests closer than the rate
// allows" after a hang-up.
func TestReview22LeaseModeHangUpGiveBackIsSpentAtOnceUnlikeStrictMode(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	// capacity 10, 10/s, max_wait 1s; leases of 50%.
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	ls := []bucket.Limit{l}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	key := []byte("review22-lease")
	strict := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	take := func(what string) (lease, one bucket.Result) {
		t.Helper()
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		var out [1]bucket.Result
		strict.Take(clock.now(), ls, 1, out[:])
		return res, out[0]
	}
	// 20 at once: 10 now, 10 waiting up to 1 s, in both modes.
	var waits []int64
	for i := range 20 {
		res, one := take("burst")
		if !res.Allowed || !one.Allowed {
			t.Fatalf("request %d of the burst: leases %+v, one bucket %+v; want both allowed", i, res, one)
		}
		waits = append(waits, res.Wait)
	}
	// At 250 ms, the 5 last waiters hang up: 5 tokens back.
	clock.advance(250 * time.Millisecond)
	rest := node.giveBackHeld(key, 5)
	m.mu.Lock()
	m.bucket(string(key), 1).GiveBack(clock.now(), ls, rest)
	m.mu.Unlock()
	strict.GiveBack(clock.now(), ls, 5)
	// At 300 ms, the next request: one bucket makes it wait its turn
	// behind the 5 waiters left.
	clock.advance(50 * time.Millisecond)
	res, one := take("after")
	t.Logf("burst waits %v; given back into the lease %d of 5", waits, 5-rest)
	if !one.Allowed || one.Wait == 0 {
		t.Fatalf("one bucket: %+v; want allowed, waiting", one)
	}
	if res.Allowed && res.Wait < one.Wait {
		t.Fatalf("leases admit the request after the give-back waiting %d µs, one bucket (strict mode) makes it wait %d µs: the give-back went into the node's lease, spendable at once, while the queue's deficit stays in the shared bucket", res.Wait, one.Wait)
	}
}

// The same as TestReview22LeaseModeHangUpGiveBackIsSpentAtOnceUnlikeStrictMode,
// on a real redis-server through Store: after a burst that queued waiters
// in the shared bucket, 5 tokens given back (5 waiters hung up) let the
// next requests through at once, though the shared bucket's level is still
// below zero and strict mode would make each wait its turn.
func TestReview22RedisLeaseGiveBackOfWaitersAdmitsWithoutWaiting(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second, Lease: "50%"})
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 1_000_000}
	key := bucketFor("review22-lease-redis")
	waiting := 0
	for i := range 20 {
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d of the burst: %+v, %v; want allowed", i, res, err)
		}
		if res.Wait > 0 {
			waiting++
		}
	}
	if waiting < 5 {
		t.Fatalf("%d of the burst wait; want at least 5", waiting)
	}
	// 5 waiters hang up.
	if err := s.GiveBack(bg, key, oneLimit(l), 5, 5, 0); err != nil {
		t.Fatal(err)
	}
	// The shared bucket still lacks tokens: one bucket would make every
	// next request wait.
	var out [1]bucket.Result
	if _, _, err := s.decideAt(bg, "peek", string(key), bucket.Tier{Limits: []bucket.Limit{l}}, 0, out[:], false); err != nil {
		t.Fatal(err)
	}
	atOnce := 0
	for range 5 {
		res, err := s.takeLimit(bg, key, l, 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed && res.Wait == 0 {
			atOnce++
		}
	}
	if atOnce > 0 {
		t.Fatalf("after the give-back, %d of 5 requests were admitted at once although the shared bucket holds nothing now (peek %+v) and %d requests wait in it: the give-back went into this node's lease", atOnce, out[0], waiting-5)
	}
}

// Defect: with leases, a request the lease does not cover is refused from
// memory when the node's hold-off (the time until the shared bucket covers
// a whole lease, plus jitter) is longer than max_wait, although the shared
// bucket's retry time for its own cost is within max_wait and strict mode
// admits it, waiting (lease.go take: RetryAfter from e.result includes
// holdUntil). Breaks: "when the shared bucket's retry time is within
// max_wait it takes its tokens there as strict mode does".
func TestReview22LeaseHoldOffRefusesARequestStrictModeLetsWait(t *testing.T) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	m := &sharedModel{now: clock.now, states: map[string]*buckettest.Shared{}}
	// capacity 10, 10/s, max_wait 200 ms; leases of 50% (5 tokens).
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 100_000}, MaxWait: 200_000}
	ls := []bucket.Limit{l}
	node := newModelTable(m, LeaseSize{percent: 50}, time.Second)
	defer node.close()
	key := []byte("review22-holdoff")
	strict := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	for i := range 60 {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		tableSync(node)
		if err != nil {
			t.Fatal(err)
		}
		var out [1]bucket.Result
		strict.Take(clock.now(), ls, 1, out[:])
		one := out[0]
		if res.Allowed != one.Allowed {
			e := node.shard(key).m[string(key)]
			t.Fatalf("request %d at %d ms: leases %+v, strict mode %+v (node holds %d, hold-off %d µs more, shared level %d)", i, (clock.now()-1_000_000)/1000, res, one, e.tokens, e.holdUntil-clock.now(), m.level(string(key), l))
		}
		if !res.Allowed {
			// Strict refuses too: keep the histories the same.
			clock.advance(10 * time.Millisecond)
			continue
		}
		clock.advance(10 * time.Millisecond)
	}
}
