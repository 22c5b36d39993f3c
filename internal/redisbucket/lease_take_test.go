package redisbucket

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// gatedGiveBacks is the shared model whose give-backs, once gate is set,
// are held until it closes, as a slow link would hold them; reserve notes
// whether a give-back was still held when it was asked.
type gatedGiveBacks struct {
	*sharedModel
	gate     chan struct{}
	sent     chan struct{}
	held     atomic.Int32
	reserves atomic.Int32
	early    atomic.Int32
	opened   sync.Once
}

// open lets the give-backs held, and those after, through.
func (r *gatedGiveBacks) open() { r.opened.Do(func() { close(r.gate) }) }

func (r *gatedGiveBacks) giveBack(node string, back []leaseReturn) (int64, error) {
	r.held.Add(1)
	defer r.held.Add(-1)
	select {
	case r.sent <- struct{}{}:
	default:
	}
	<-r.gate
	return r.sharedModel.giveBack(node, back)
}

func (r *gatedGiveBacks) reserve(ctx context.Context, key string, tr bucket.Tier, cost int64) (bucket.Result, []bucket.Result, error) {
	r.reserves.Add(1)
	if r.held.Load() > 0 {
		r.early.Add(1)
	}
	return r.sharedModel.reserve(ctx, key, tr, cost)
}

// banWaitTier is a tier with a ban and max_wait: a request the node's table
// refuses asks the shared bucket (leaseTable.takeNamed).
func banWaitTier() bucket.Tier {
	return oneLimit(bucket.Limit{Capacity: 8, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}, Ban: 60 * second, MaxWait: second})
}

// sendGiveBack leaves node refusing the bucket at key from memory (a ban
// it found), with the tokens it holds on their way back: what a lease call
// that found a ban leaves (lease_call.go's apply, LeaseResult.Drop).
func sendGiveBack(t *testing.T, node *leaseTable, remote *gatedGiveBacks, key []byte, tr bucket.Tier) {
	t.Helper()
	holdTokens(t, node, key, tr, nil)
	<-remote.sent
}

// holdTokens takes from the bucket at key until node holds tokens of it
// (a first lease is one request's), then leaves the node refusing it from
// memory (a ban it found), its tokens on their way back; before, when
// given, runs just before they are sent.
func holdTokens(t *testing.T, node *leaseTable, key []byte, tr bucket.Tier, before func()) {
	t.Helper()
	sh := node.shard(key)
	for i := 0; ; i++ {
		res, err := node.take(bg, key, tr, 1, nil)
		if err != nil || !res.Allowed {
			t.Fatalf("request %d: %+v, %v", i+1, res, err)
		}
		tableSync(node)
		sh.mu.Lock()
		if e := sh.m[string(key)]; e != nil && e.tokens > 0 && e.call == nil {
			e.banUntil = node.now() + 3_600*second
			if before != nil {
				before()
			}
			node.giveBackLater([]leaseReturn{e.takeBack()})
			sh.mu.Unlock()
			return
		}
		sh.mu.Unlock()
		if i == 3 {
			t.Fatalf("no tokens held after %d requests", i+1)
		}
	}
}

// A request with max_wait that the node's table refuses while a give-back
// of the bucket is out waits for it (its tokens cap the shared level until
// it lands), but never past its context: a cancelled request ends with its
// context's error, and asks the shared bucket nothing.
func TestARefusedRequestWaitingOnAGiveBackEndsWithItsContext(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	remote := &gatedGiveBacks{sharedModel: m, gate: make(chan struct{}), sent: make(chan struct{}, 1)}
	node := newLeaseTable(remote, m.now, LeaseSize{tokens: 4}, time.Minute, time.Minute, 1000, nopLogger)
	defer node.close()
	defer remote.open()
	key, tr := []byte("k"), banWaitTier()
	sendGiveBack(t, node, remote, key, tr)

	ctx, cancel := context.WithCancel(bg)
	cancel()
	type answer struct {
		res bucket.Result
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := node.take(ctx, key, tr, 1, nil)
		done <- answer{res, err}
	}()
	select {
	case a := <-done:
		if !errors.Is(a.err, context.Canceled) {
			t.Errorf("a cancelled request while the give-back is out: %+v, %v; want its context's error", a.res, a.err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a cancelled request still waits on a give-back that has not landed")
	}
	if n := remote.reserves.Load(); n != 0 {
		t.Errorf("the shared bucket was asked %d times before the give-back landed", n)
	}
}

// Once the give-back lands, the waiting request asks the shared bucket,
// after it and never before.
func TestARefusedRequestAsksTheSharedBucketOnlyOnceTheGiveBackLanded(t *testing.T) {
	t.Parallel()
	_, m := newModelStore()
	remote := &gatedGiveBacks{sharedModel: m, gate: make(chan struct{}), sent: make(chan struct{}, 1)}
	node := newLeaseTable(remote, m.now, LeaseSize{tokens: 4}, time.Minute, time.Second, 1000, nopLogger)
	defer node.close()
	defer remote.open()
	key, tr := []byte("k"), banWaitTier()
	sendGiveBack(t, node, remote, key, tr)

	done := make(chan error, 1)
	go func() {
		_, err := node.take(bg, key, tr, 1, nil)
		done <- err
	}()
	// Without the wait the request would ask at once: give it the time.
	select {
	case err := <-done:
		t.Fatalf("the request was answered (%v) before the give-back landed", err)
	case <-time.After(100 * time.Millisecond):
	}
	remote.open()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request still waits after the give-back landed")
	}
	if n, early := remote.reserves.Load(), remote.early.Load(); n != 1 || early != 0 {
		t.Errorf("the shared bucket was asked %d times, %d of them with the give-back out; want once, after it", n, early)
	}
}

// Through a real redis-server that stops answering (SIGSTOP) while the
// give-back is out, a refused request with max_wait ends, with an error,
// within the store's timeout, as a strict decision does
// (TestStrictTakesEndWithinTheTimeoutWhileRedisIsStopped): the wait for
// the give-back and its own call share it.
func TestARefusedRequestWaitingOnAGiveBackEndsWhileRedisIsStopped(t *testing.T) {
	skipUnderShort(t, "stops Redis")
	srv := redistest.Start(t)
	const timeout = time.Second
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: timeout, Lease: "4", BreakerFailures: 1000})
	node := s.leases
	key, tr := bucketFor("stopped"), banWaitTier()
	// Redis stops once the node holds tokens, before their give-back.
	holdTokens(t, node, key, tr, srv.Pause)
	defer srv.Resume()

	start := time.Now()
	done := make(chan error, 1)
	go func() {
		_, err := node.take(bg, key, tr, 1, nil)
		done <- err
	}()
	// The race detector and a loaded machine get some slack, under a
	// second timeout more.
	bound := timeout + 700*time.Millisecond
	select {
	case err := <-done:
		if err == nil {
			t.Error("answered while Redis was stopped")
		}
		if took := time.Since(start); took > bound {
			t.Errorf("the request took %s with a %s timeout", took, timeout)
		}
	case <-time.After(bound + 5*time.Second):
		t.Fatalf("the request still waits %s after it came, with a %s timeout", time.Since(start), timeout)
	}
}
