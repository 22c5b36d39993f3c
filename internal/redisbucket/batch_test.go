package redisbucket

import (
	"context"
	"errors"
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"runtime"
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
		defer reportCPU(b)()
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

// Concurrent strict takes, which queue in the batcher, make no context,
// timer or channel each, and read Redis's answer into integers without
// boxing them: about 7 allocations a take and the pipeline's own shared
// by its batch, where they made 24 and more.
// Regression test for issue 34 (strict mode's Caddy-side cost).
func TestQueuedStrictTakesAllocateLittle(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
	l := bucket.Limit{Capacity: 1_000_000_000, Rate: bucket.Rate{Tokens: 1_000_000, Interval: 1_000_000}} // never denies
	const goroutines, each = 32, 100
	var keys [goroutines][]byte
	for i := range keys {
		keys[i] = bucketFor("queued-allocations-" + strconv.Itoa(i))
	}
	// One decision counted as out: every take below goes through a loop.
	b := s.conn.batcher()
	b.callers.Add(1)
	defer b.callers.Add(-1)
	var failed atomic.Int64
	run := func(n int) {
		var wg sync.WaitGroup
		for i := range goroutines {
			wg.Go(func() {
				var out [1]bucket.Result
				for range n {
					if _, err := s.Take(bg, keys[i], oneLimit(l), 1, out[:]); err != nil || !out[0].Allowed {
						failed.Add(1)
					}
				}
			})
		}
		wg.Wait()
	}
	run(10) // the pool's connections dialled
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	run(each)
	runtime.ReadMemStats(&after)
	if n := failed.Load(); n != 0 {
		t.Fatalf("%d takes failed or were refused", n)
	}
	perTake := float64(after.Mallocs-before.Mallocs) / (goroutines * each)
	t.Logf("%.1f allocations a take", perTake)
	if perTake > 12 {
		t.Fatalf("a queued strict take made %.1f allocations, want at most 12", perTake)
	}
}

// Each caller gets its own call's answer, while callers that stopped
// waiting (their deadline passed while Redis was paused) leave calls that
// the loops answer later: a call is reused only once its own caller had
// its answer. Random deadlines, seed logged.
func TestBatchedAnswersGoToTheirOwnCallers(t *testing.T) {
	skipUnderShort(t, "pauses Redis")
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	seed := time.Now().UnixNano()
	t.Logf("seed %d", seed)
	b := newRedisBatcher(s.conn.client(), s.conn.handshakes, 2, 16)
	defer b.close()
	var bad atomic.Int64
	var round atomic.Int64
	// Caller i's bucket holds capacity 1e6*(i+1): its remaining tells
	// whose answer it got.
	take := func(ctx context.Context, i int, mustAnswer bool) {
		l := bucket.Limit{Capacity: 1_000_000 * int64(i+1), Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
		key := string(bucketFor("own-answer-" + strconv.FormatInt(seed, 10) + "-" + strconv.FormatInt(round.Load(), 10) + "-" + strconv.Itoa(i)))
		d, _ := ctx.Deadline()
		vals, _, err := b.takeBy(ctx, d, scriptArgs(key, s.takeArgs(oneLimit(l), 1)))
		switch {
		case err != nil:
			if mustAnswer {
				t.Logf("caller %d: %v", i, err)
				bad.Add(1)
			}
		case len(vals) != 4 || vals[0]/1_000_000 != int64(i):
			bad.Add(1)
		}
	}
	for r := range 3 {
		round.Store(int64(r))
		// Calls queued while Redis is paused, given up on at once.
		srv.Pause()
		var wg sync.WaitGroup
		b.callers.Add(1) // every call queues
		for i := range 16 {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(bg, time.Duration(1+(seed+int64(i*r))%20)*time.Millisecond)
				defer cancel()
				take(ctx, i, false)
			})
		}
		wg.Wait()
		srv.Resume()
		// Callers that wait for their answers, on the calls given up.
		for i := range 16 {
			wg.Go(func() { take(bg, 16+i, true) })
		}
		wg.Wait()
		b.callers.Add(-1)
	}
	if n := bad.Load(); n != 0 {
		t.Fatalf("%d callers got no answer or another caller's", n)
	}
}

// takeOwn takes 1 from caller i's own bucket named by name, whose capacity
// 1e6*(i+1) tells from the remaining whose answer the caller got.
func takeOwn(s *Store, ctx context.Context, name string, i int) error {
	l := bucket.Limit{Capacity: 1_000_000 * int64(i+1), Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	res, err := s.takeLimit(ctx, bucketFor(name+"-"+strconv.Itoa(i)), l, 1)
	if err == nil && res.Remaining/1_000_000 != int64(i) {
		err = fmt.Errorf("caller %d got remaining %d: another caller's answer", i, res.Remaining)
	}
	return err
}

// Strict takes through Store, with no deadline of their own and some whose
// requests go away, end within the store's timeout while redis-server is
// stopped (SIGSTOP), whether sent alone or queued; once it runs again each
// caller gets its own answer, and no goroutine is left behind.
func TestStrictTakesEndWithinTheTimeoutWhileRedisIsStopped(t *testing.T) {
	skipUnderShort(t, "stops Redis")
	srv := redistest.Start(t)
	const timeout = 250 * time.Millisecond
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: timeout, BreakerFailures: 1000})
	for i := range 8 {
		if err := takeOwn(s, bg, "warm", i); err != nil {
			t.Fatal(err)
		}
	}
	before := runtime.NumGoroutine()
	for r := range 3 {
		srv.Pause()
		var wg sync.WaitGroup
		var slowest atomic.Int64
		for i := range 48 {
			wg.Go(func() {
				ctx := bg
				if i%4 == 0 {
					gone, cancel := context.WithCancel(bg)
					defer cancel()
					time.AfterFunc(time.Duration(i)*time.Millisecond, cancel)
					ctx = gone
				}
				start := time.Now()
				if err := takeOwn(s, ctx, "stopped-"+strconv.Itoa(r), i); err == nil {
					t.Errorf("round %d: caller %d answered while Redis was stopped", r, i)
				}
				took := int64(time.Since(start))
				for {
					old := slowest.Load()
					if took <= old || slowest.CompareAndSwap(old, took) {
						break
					}
				}
			})
		}
		wg.Wait()
		srv.Resume()
		// The race detector and a loaded machine get a second of slack.
		if took := time.Duration(slowest.Load()); took > timeout+time.Second {
			t.Errorf("round %d: the slowest take took %s with a %s timeout", r, took, timeout)
		}
		for i := range 48 {
			wg.Go(func() {
				if err := takeOwn(s, bg, "after-"+strconv.Itoa(r), i); err != nil {
					t.Errorf("round %d, Redis running again: %v", r, err)
				}
			})
		}
		wg.Wait()
	}
	redistest.WaitFor(t, 5*time.Second, "the goroutines of the stopped takes to end", func() bool {
		return runtime.NumGoroutine() <= before
	})
}

// Queued takes on a Cluster given by one address follow it on MOVED, each
// with its own answer, and reload the script after SCRIPT FLUSH on every
// master, queued and alone.
func TestBatchedTakesFollowAClusterAndReloadTheScript(t *testing.T) {
	skipUnderShort(t, "Redis Cluster of three")
	nodes := redistest.StartCluster(t, 3)
	// The node is out of reach while the store connects, so that the
	// queued takes are the first to hear MOVED.
	proxy := redistest.StartProxy(t, nodes[0].Addr(), 0)
	proxy.Cut()
	s := newTestStore(t, testConfig{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 2 * time.Second, BreakerFailures: 1000})
	time.Sleep(300 * time.Millisecond)
	proxy.Restore()
	if _, ok := s.conn.client().(*redis.ClusterClient); ok {
		t.Fatal("the store followed the Cluster while its node was down")
	}
	first := s.conn.batcher()
	first.callers.Add(1) // every take queues
	defer first.callers.Add(-1)
	run := func(name string) {
		var wg sync.WaitGroup
		for i := range 40 {
			wg.Go(func() {
				if err := takeOwn(s, bg, name, i); err != nil {
					t.Errorf("%s: %v", name, err)
				}
			})
		}
		wg.Wait()
	}
	run("moved")
	if _, ok := s.conn.client().(*redis.ClusterClient); !ok {
		t.Fatal("the store did not follow the Cluster")
	}
	b := s.conn.batcher()
	b.callers.Add(1)
	for _, n := range nodes {
		n.Do("SCRIPT", "FLUSH")
	}
	run("flushed")
	b.callers.Add(-1)
	for _, n := range nodes {
		n.Do("SCRIPT", "FLUSH")
	}
	for i := range 3 {
		if err := takeOwn(s, bg, "flushed-alone", i); err != nil {
			t.Errorf("alone after SCRIPT FLUSH: %v", err)
		}
	}
}

// A call no request waits on (a lease's renewal or prefetch, callAside)
// runs within its own context's deadline, which doAside sets: it makes no
// second context, timer and channel for the same deadline.
func TestABackgroundCallMakesNoSecondContext(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second})
	l := bucket.Limit{Capacity: 1_000_000_000, Rate: bucket.Rate{Tokens: 1_000_000, Interval: 1_000_000}}
	key := string(bucketFor("background-call"))
	call := func() {
		if _, err := s.callAside(bg, key, s.takeArgs(oneLimit(l), 1), 4); err != nil {
			t.Fatal(err)
		}
	}
	call() // the connection dialled, the script loaded
	perCall := testing.AllocsPerRun(200, call)
	t.Logf("%.1f allocations a background call", perCall)
	if perCall > 15 {
		t.Fatalf("a background call made %.1f allocations, want at most 15", perCall)
	}
}
