package redisbucket

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// A call Redis answers NOSCRIPT to (a server that restarted, or one no
// node has loaded the script on yet) goes again as EVAL: two round trips,
// no sample of one. The first call of a store on such a server, behind a
// proxy delaying each way 20 ms, seeds the average with about 40 ms, not
// 80.
func TestACallThatLoadsTheScriptIsNoRoundTripSample(t *testing.T) {
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), oneWay)
	for _, batch := range []bool{false, true} {
		s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 5 * time.Second, Batch: &batch})
		ctx, cancel := context.WithTimeout(bg, 10*time.Second)
		var wg sync.WaitGroup
		for range 3 {
			wg.Go(func() {
				_, err := s.conn.client().Pipelined(ctx, func(p redis.Pipeliner) error { return p.Ping(ctx).Err() })
				if err := errors.Join(err, s.conn.client().Ping(ctx).Err()); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		err := s.conn.client().ScriptFlush(ctx).Err()
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.takeLimit(bg, bucketFor("first"), slowLimit(10), 1); err != nil {
			t.Fatal(err)
		}
		if _, err := s.takeLimit(bg, bucketFor("second"), slowLimit(10), 1); err != nil {
			t.Fatal(err)
		}
		if avg, n := s.RoundTrip(); avg > 3*oneWay || n > 2 {
			t.Errorf("batch %v: a call that loaded the script, then one that did not: %s over %d samples; want about %s over 1", batch, avg, n, 2*oneWay)
		}
	}
}
