package redisbucket

import (
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A node far from the store refuses a request from memory only while the
// last answer showed the shared level unable to cover that request's
// cost: a call for a costly request that leaves a few tokens does not
// refuse a cheaper request those tokens cover, which one bucket admits.
func TestAFarNodeDoesNotRefuseACheapRequestTheSharedLevelCovers(t *testing.T) {
	t.Parallel()
	// A token refills in 100 ms; a call takes 200 ms: far. Another node
	// took half the bucket.
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 10, Interval: 1_000_000}}
	clock, m := newModelStore()
	m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, 10, make([]bucket.Result, 1))
	node := newLeaseTable(slowRemote{m, clock, 200 * time.Millisecond}, m.now, LeaseSize{tokens: 10}, 2*time.Second, time.Second, 1000, nopLogger)
	node.jitter = func(int64) int64 { return 0 }
	defer node.close()
	key := []byte("k")
	res, err := node.take(bg, key, oneLimit(l), 8, nil)
	tableSync(node)
	if err != nil || !res.Allowed {
		t.Fatalf("a request of 8 on a bucket of 10 tokens: %+v, %v", res, err)
	}
	e := node.snapshot(key)
	if e.tokens != 0 || e.level < 1 || e.level >= 8 {
		t.Fatalf("after the call, the node holds %d tokens and saw a level of %d; want none, and a level under 8 that covers 1", e.tokens, e.level)
	}
	res, err = node.take(bg, key, oneLimit(l), 1, nil)
	tableSync(node)
	if err != nil || !res.Allowed {
		t.Errorf("a request of 1 right after, the shared level last seen holding %d: %+v, %v; want allowed, as one bucket would", e.level, res, err)
	}
}

// A lease answer refuses the requests that waited on it only when the
// level it shows cannot cover each one's own cost: a cheap request that
// waited on a costly one's call, which left a few tokens, asks again and
// is admitted, as one bucket would admit it.
func TestACheapWaiterIsNotRefusedByACostlyCallThatLeftItsCost(t *testing.T) {
	t.Parallel()
	clock, m := newModelStore()
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	m.bucket("k", 1).Take(clock.now(), []bucket.Limit{l}, 10, make([]bucket.Result, 1)) // 10 left
	node := newModelTable(m, LeaseSize{tokens: 10}, time.Second)
	defer node.close()
	key := []byte("k")
	gate := make(chan struct{})
	m.gate = gate
	costly := make(chan bucket.Result, 1)
	go func() {
		res, err := node.take(bg, key, oneLimit(l), 8, nil)
		if err != nil {
			t.Error(err)
		}
		costly <- res
	}()
	joined := func() bool {
		sh := node.shard(key)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m[string(key)]
		return e != nil && e.call != nil && e.call.joined == 1
	}
	redistest.WaitFor(t, 5*time.Second, "the costly request's call to be out", func() bool {
		sh := node.shard(key)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e := sh.m[string(key)]
		return e != nil && e.call != nil
	})
	cheap := make(chan bucket.Result, 1)
	go func() {
		res, err := node.take(bg, key, oneLimit(l), 1, nil)
		if err != nil {
			t.Error(err)
		}
		cheap <- res
	}()
	redistest.WaitFor(t, 5*time.Second, "the cheap request to wait on the call", joined)
	close(gate)
	if res := <-costly; !res.Allowed {
		t.Fatalf("the request of 8 on a bucket of 10 tokens: %+v", res)
	}
	res := <-cheap
	tableSync(node)
	if !res.Allowed {
		t.Errorf("a request of 1 that waited on the call, which left 2 tokens: %+v; want allowed, as one bucket would", res)
	}
}
