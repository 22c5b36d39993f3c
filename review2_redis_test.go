package ratelimit

import (
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/caddyserver/caddy/v2"
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
	srv := startRedis(t)
	l := Limit{Capacity: 100, Rate: Rate{Tokens: 1, Interval: 3600 * second}} // 100 1/h
	for _, tt := range []struct {
		name    string
		holdOff bool
	}{{"no hold-off (control)", false}, {"a hold-off pending", true}} {
		t.Run(tt.name, func(t *testing.T) {
			srv.do("FLUSHALL")
			s := &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(2 * time.Second), Lease: "10"}
			if err := s.Provision(caddy.Context{}); err != nil {
				t.Fatal(err)
			}
			b := bucketFor("held-by-its-timer")
			requests := 5
			if tt.holdOff {
				requests = 200
			}
			refused := 0
			for range requests {
				res, err := s.Take(bg, b, l, 1)
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
			if err := s.Cleanup(); err != nil {
				t.Fatal(err)
			}
			s.leases = nil
			collected := false
			for range 20 {
				runtime.GC()
				if table.Value() == nil {
					collected = true
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			if !collected {
				t.Errorf("the lease table closed by Cleanup is still reachable after GC (%d requests refused, a hold-off of up to an hour pending)", refused)
			}
		})
	}
}
