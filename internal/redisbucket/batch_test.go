package redisbucket

import (
	"context"
	"errors"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestRedisBatcherAdmitsExactlyTheCapacity(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
	b := newRedisBatcher(s.conn.client(), s.conn.handshakes, 2, 64)
	defer b.close()
	l := slowLimit(100)
	key := string(bucketFor("192.0.2.20"))
	var allowed atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 10 {
				ctx, cancel := context.WithTimeout(bg, time.Second)
				vals, _, err := b.take(ctx, []string{key}, s.args("take", bucket.Tier{Limits: []bucket.Limit{l}}, 0, 1))
				cancel()
				if err != nil {
					t.Error(err)
					return
				}
				allowed.Add(vals[0])
			}
		})
	}
	wg.Wait()
	if got := allowed.Load(); got != 100 {
		t.Fatalf("%d of 320 concurrent decisions allowed, want the capacity, 100", got)
	}
	if b.callers.Load() != 0 {
		t.Fatalf("%d callers counted after every take returned", b.callers.Load())
	}

	// Redis forgets the script (a restart, a failover): a lone caller
	// (sent at once) and concurrent ones (sent as a pipeline) load it again.
	for _, n := range []int{1, 32} {
		srv.Do("SCRIPT", "FLUSH")
		key := string(bucketFor("192.0.2.2" + strconv.Itoa(n)))
		var allowed atomic.Int64
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				vals, _, err := b.take(bg, []string{key}, s.args("take", bucket.Tier{Limits: []bucket.Limit{l}}, 0, 1))
				if err != nil {
					t.Errorf("take after SCRIPT FLUSH (%d at once): %v", n, err)
					return
				}
				allowed.Add(vals[0])
			})
		}
		wg.Wait()
		if got := allowed.Load(); got != int64(n) {
			t.Fatalf("after SCRIPT FLUSH, %d of %d takes allowed, want all", got, n)
		}
	}
}

func TestRedisBatcherAnswersAfterClose(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
	b := newRedisBatcher(s.conn.client(), s.conn.handshakes, 1, 8)
	b.close()
	if _, _, err := b.take(bg, []string{string(bucketFor("192.0.2.30"))}, s.args("take", bucket.Tier{Limits: []bucket.Limit{{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 1}}}}, 0, 1)); !errors.Is(err, redis.ErrClosed) {
		t.Fatalf("take on a closed batcher: %v, want %v", err, redis.ErrClosed)
	}
}

// BenchmarkRedisBatch compares the store's per-decision EVALSHA with
// pipelining concurrent decisions: redisBatcher with 1 to 8 loops, and
// go-redis's own (experimental) blocking AutoPipeline. 32 goroutines on 2
// CPUs, as BenchmarkRedisTake and bench/redis-benchmark.sh run.
func BenchmarkRedisBatch(b *testing.B) {
	srv := redistest.Start(b)
	off := false // per-decision below is the store without its batcher
	s := newTestStore(b, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Batch: &off})
	l := bucket.Limit{Capacity: 1_000_000_000, Rate: bucket.Rate{Tokens: 1, Interval: 1}} // never denies
	args := s.args("take", bucket.Tier{Limits: []bucket.Limit{l}}, 0, 1)
	var goroutines atomic.Int64
	parallel := func(b *testing.B, take func(ctx context.Context, keys []string) error) {
		b.SetParallelism(16)
		b.RunParallel(func(pb *testing.PB) {
			// A client per goroutine, as an edge sees; "hot" below is one.
			keys := []string{string(bucketFor("client-" + strconv.FormatInt(goroutines.Add(1), 10)))}
			for pb.Next() {
				ctx, cancel := context.WithTimeout(bg, time.Second)
				err := take(ctx, keys)
				cancel()
				if err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
	}
	b.Run("per-decision", func(b *testing.B) {
		if s.conn.batcher() != nil {
			b.Fatal("the store batches")
		}
		parallel(b, func(ctx context.Context, keys []string) error {
			_, err := s.takeLimit(ctx, []byte(keys[0]), l, 1)
			return err
		})
	})
	for _, loops := range []int{1, 2, 4, 8} {
		b.Run("batcher-loops-"+strconv.Itoa(loops), func(b *testing.B) {
			bt := newRedisBatcher(s.conn.client(), s.conn.handshakes, loops, 128)
			defer bt.close()
			parallel(b, func(ctx context.Context, keys []string) error {
				_, _, err := bt.take(ctx, keys, args)
				return err
			})
		})
	}
	b.Run("go-redis-autopipeline", func(b *testing.B) {
		ap, err := s.conn.client().(*redis.Client).AutoPipeline()
		if err != nil {
			b.Fatal(err)
		}
		defer ap.Close()
		parallel(b, func(ctx context.Context, keys []string) error {
			return bucketScript.Run(ctx, ap, keys, args...).Err()
		})
	})
}

// TestRedisBatcherHonoursEachDeadline pauses Redis under concurrent
// decisions: each one, sent alone or in a pipeline, returns an error at its
// own deadline instead of waiting for Redis, and the batcher works again
// once Redis does.
// Serial: it bounds decisions in wall-clock time.
func TestRedisBatcherHonoursEachDeadline(t *testing.T) {
	skipUnderShort(t, "fault injection")
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	b := newRedisBatcher(s.conn.client(), s.conn.handshakes, 2, 8)
	defer b.close()
	l := slowLimit(1000)
	args := s.args("take", bucket.Tier{Limits: []bucket.Limit{l}}, 0, 1)
	key := string(bucketFor("192.0.2.40"))
	if _, _, err := b.take(bg, []string{key}, args); err != nil {
		t.Fatal(err)
	}

	const pause, timeout = 2 * time.Second, 200 * time.Millisecond
	srv.Do("CLIENT", "PAUSE", pause.Milliseconds(), "ALL")
	paused := time.Now()
	var wg sync.WaitGroup
	var slowest atomic.Int64
	for i := range 24 {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(bg, timeout)
			defer cancel()
			start := time.Now()
			_, _, err := b.take(ctx, []string{key}, args)
			took := time.Since(start)
			if err == nil {
				t.Errorf("decision %d answered while Redis was paused", i)
			}
			for {
				old := slowest.Load()
				if int64(took) <= old || slowest.CompareAndSwap(old, int64(took)) {
					break
				}
			}
		})
	}
	wg.Wait()
	// Waiting for Redis would take the whole pause; the bound leaves the
	// race detector and a loaded machine a second of slack.
	if took := time.Duration(slowest.Load()); took >= timeout+time.Second {
		t.Fatalf("the slowest decision took %s with a %s deadline while Redis was paused for %s", took, timeout, pause)
	}
	if elapsed := time.Since(paused); elapsed >= pause {
		t.Fatalf("the decisions outlasted the pause (%s): they waited for Redis", elapsed)
	}

	// (CLIENT UNPAUSE would itself wait for the pause to end.)
	ctx, cancel := context.WithTimeout(bg, 5*time.Second)
	defer cancel()
	if _, _, err := b.take(ctx, []string{key}, args); err != nil {
		t.Fatalf("take after Redis came back: %v", err)
	}
}
