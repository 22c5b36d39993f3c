package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"runtime"
	"testing"
	"time"
	"weak"
)

// "No goroutine or timer leak after close": a config's lease table stops
// with the config (Cleanup closes it). The timer that prefetches when a
// hold-off ends (store_redis.go sets `after` to time.AfterFunc) is never
// stopped: it stays armed after close, for as long as the hold-off, which
// is up to the refused call's Retry-After (an hour for a limit of 1/h),
// and it holds the closed table, every entry of its 64 shards (up to
// deny_cache_size of them), until it fires. A node that reloads its config
// keeps every old table with a hold-off pending. With no hold-off pending,
// the closed table is collected at once (the control).
func TestReview2ClosedLeaseTableIsHeldByItsHoldOffTimer(t *testing.T) {
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 100, Rate: bucket.Rate{Tokens: 1, Interval: 3600 * second}} // 100 1/h
	for _, tt := range []struct {
		name    string
		holdOff bool
	}{{"no hold-off (control)", false}, {"a hold-off pending", true}} {
		t.Run(tt.name, func(t *testing.T) {
			srv.Do("FLUSHALL")
			plan, err := NewPlan(Options{Addresses: []string{srv.URL()}, Timeout: 500 * time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			conn := plan.Connect(nopLogger)
			defer conn.Close()
			s := NewStore(conn, StoreOptions{Lease: LeaseSize{tokens: 10}})
			b := bucketFor("held-by-its-timer")
			requests := 5
			if tt.holdOff {
				requests = 200
			}
			refused := 0
			for range requests {
				res, err := s.takeLimit(bg, b, l, 1)
				if err != nil {
					t.Fatal(err)
				}
				if !res.Allowed {
					refused++
				}
			}
			if tt.holdOff && refused == 0 {
				t.Fatal("no request refused: no hold-off")
			}
			table := weak.Make(s.leases)
			s.Close()
			s.leases = nil
			// A lease call in flight at Close may hold the table until it
			// answers, within the 500 ms timeout; an hour's timer holds it
			// longer.
			collected := false
			for deadline := time.Now().Add(1500 * time.Millisecond); time.Now().Before(deadline); {
				runtime.GC()
				if table.Value() == nil {
					collected = true
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if !collected {
				t.Errorf("the lease table closed by Cleanup is still reachable after GC (%d requests refused, a hold-off of up to an hour pending)", refused)
			}
		})
	}
}

// TestReview2RefusedPrefetchKeepsASpentLeaseRecordedAndTheBanStartsLate
// on a real Redis, in real time: two leasing nodes (lease 10, lease_ttl
// 1s), `rate_limit 20 20/s`, ban 1h. The client spends 8 through node A,
// another node (strict) takes what Redis holds, A spends what it holds
// (its prefetch at half is refused), and the client moves to node B, a
// request every 2 ms. One bucket refuses and bans B's first request and
// admits nothing more for an hour. Redis still records A's spent tokens
// (A's report names the refused prefetch's seq), so B's refusals start no
// ban until the record expires, and B admits the refill meanwhile.
func TestReview2RedisRefusedPrefetchKeepsASpentLeaseRecordedAndTheBanStartsLate(t *testing.T) {
	skipUnderShort(t, "real-time (1.5 s of a client on a real Redis)")
	srv := redistest.Start(t)
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 50_000}, Ban: 3600 * second}
	var nodes [3]*Store
	for i := range nodes {
		nodes[i] = newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
		if i < 2 {
			nodes[i].leases = newLeaseTable(nodes[i], nodes[i].conn.now, LeaseSize{tokens: 10}, time.Second, 100*time.Millisecond, 1000, nopLogger)
		}
	}
	a, b, strict := nodes[0], nodes[1], nodes[2]
	defer a.leases.close()
	defer b.leases.close()
	bk := bucketFor("refused-prefetch")
	key := string(bk)
	for i := range 8 {
		res, err := a.takeLimit(bg, bk, l, 1)
		a.leases.calls.Wait()
		if err != nil || !res.Allowed {
			t.Fatalf("node A, request %d: %+v %v", i+1, res, err)
		}
	}
	for {
		peek, _, err := strict.run(bg, key, l, 0)
		if err != nil {
			t.Fatal(err)
		}
		if peek.Remaining == 0 {
			break
		}
		if res, _, err := strict.run(bg, key, l, peek.Remaining); err != nil || !res.Allowed {
			t.Fatalf("the strict node's take of %d: %+v %v", peek.Remaining, res, err)
		}
	}
	entry := func() lease {
		sh := a.leases.shard([]byte(key))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return *sh.m[key]
	}
	for entry().tokens > 0 {
		res, err := a.takeLimit(bg, bk, l, 1)
		a.leases.calls.Wait()
		if err != nil || !res.Allowed {
			t.Fatalf("node A, on the tokens it holds: %+v %v", res, err)
		}
	}
	rdb := srv.Client()
	defer rdb.Close()
	fields, _ := rdb.Get(bg, key).Result()
	t.Logf("node A spent what it held (its last call seq %d); Redis holds %v", entry().seq, fields)
	admitted, firstRefusal := 0, bucket.Result{}
	refused := false
	start := time.Now()
	for time.Since(start) < 1500*time.Millisecond {
		res, err := b.takeLimit(bg, bk, l, 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed && refused {
			admitted++
		} else if !res.Allowed && !refused {
			refused, firstRefusal = true, res
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Logf("node B: first refusal %+v; admitted %d after it, in 1.5 s", firstRefusal, admitted)
	if !firstRefusal.Banned {
		t.Errorf("B's first request, refused on a bucket the client has spent, started no ban; one bucket bans it")
	}
	if admitted > 0 {
		t.Errorf("node B admitted %d after its first refusal, within 1.5 s of the client spending its bucket; one bucket, banned there, admits none", admitted)
	}
}
