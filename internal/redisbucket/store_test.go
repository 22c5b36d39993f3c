package redisbucket

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

func TestRedisMatchesReferenceModel(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	rdb := srv.Client()
	defer rdb.Close()

	// Redis reads its own clock, so the traces run on TIME plus an offset
	// that grows by each gap (the script's test-only argument), and the
	// model is given the time the script reports. The offset never
	// shrinks, so the simulated time runs ahead of the real one and no key
	// expires before the model's bucket is full.
	rng := rand.New(rand.NewPCG(5, 6))
	traces := 40
	if testing.Short() {
		traces = 15
	}
	for i := range traces {
		tr := buckettest.RandomTrace(rng)
		ref := buckettest.NewReference(tr.Limit)
		key := string(bucketFor("client-" + strconv.Itoa(i)))
		var st bucket.State
		for j := range tr.Gaps {
			s.clockOffset += tr.Gaps[j]
			sent := time.Now()
			got, now, err := s.run(bg, key, tr.Limit, tr.Costs[j])
			if err != nil {
				t.Fatal(err)
			}
			var want bucket.Result
			st, want = bucket.Take(st, now, tr.Limit, tr.Costs[j])
			if got != want {
				t.Fatalf("trace %d (limit %+v) step %d at %dµs cost %d: Redis %+v, Take %+v", i, tr.Limit, j, now, tr.Costs[j], got, want)
			}
			if model := ref.Take(now, tr.Costs[j]); got != model {
				t.Fatalf("trace %d step %d: Redis %+v, reference model %+v", i, j, got, model)
			}
			// The stored state is Take's, to the unit, and the key lives
			// until the bucket is full: it may be gone only once the time
			// since the decision, plus the millisecond rounding, has
			// refilled the bucket.
			v, err := rdb.Get(bg, key).Result()
			elapsed := time.Since(sent).Microseconds()
			switch {
			case err == nil && v != fmt.Sprintf("%d %d", st.FullAt, st.Slack):
				t.Fatalf("trace %d step %d: stored %q, Take's state %+v", i, j, v, st)
			case err != nil && st.FullAt > now+elapsed+2000:
				t.Fatalf("trace %d step %d: the key is gone %dµs before the bucket is full: %v", i, j, st.FullAt-now-elapsed, err)
			}
		}
	}
}

func TestRedisKeyExpiresWhenTheBucketIsFull(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}})
	b := bucketFor("127.0.0.2")
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}} // 1/s

	for range 4 {
		if res, err := s.takeLimit(bg, b, l, 1); err != nil || !res.Allowed {
			t.Fatalf("Take: %+v, %v", res, err)
		}
	}
	key := string(b)
	pttl := srv.Do("PTTL", key).(int64)
	// Four tokens short at 1/s: full again in 4 s, give or take the time
	// since the last take and the millisecond rounded up.
	if pttl < 3900 || pttl > 4001 {
		t.Fatalf("PTTL %d ms after taking 4 of 10 at 1/s, want about 4000", pttl)
	}
	value := srv.Do("GET", key)

	// A denial writes nothing: neither the state nor the expiry.
	for range 6 {
		if _, err := s.takeLimit(bg, b, l, 1); err != nil {
			t.Fatal(err)
		}
	}
	denied, err := s.takeLimit(bg, b, l, 1)
	if err != nil || denied.Allowed {
		t.Fatalf("11th take: %+v, %v; want denied", denied, err)
	}
	s.conn.denied.remove(key) // so that the next take reaches Redis
	before := srv.Do("GET", key)
	if res, err := s.takeLimit(bg, b, l, 1); err != nil || res.Allowed {
		t.Fatalf("take from the empty bucket, through Redis: %+v, %v", res, err)
	}
	if after := srv.Do("GET", key); after != before {
		t.Fatalf("a denial changed the bucket from %q to %q", before, after)
	}
	if value == before {
		t.Fatal("allowed takes did not change the bucket")
	}
}

func TestRedisTwoNodesAdmitExactlyTheCapacity(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const capacity = 20
	nodes := []*Store{
		newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second}),
		newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second}),
	}
	if nodes[0].conn.client() == nodes[1].conn.client() {
		t.Fatal("the two nodes share a client")
	}
	b := bucketFor("203.0.113.7")
	var allowed, denied atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 10 * capacity {
		wg.Go(func() {
			<-start
			res, err := nodes[i%2].takeLimit(bg, b, slowLimit(capacity), 1)
			switch {
			case err != nil:
				t.Error(err)
			case res.Allowed:
				allowed.Add(1)
			default:
				denied.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if allowed.Load() != capacity || denied.Load() != 9*capacity {
		t.Fatalf("burst of %d over two nodes: %d allowed, %d denied; want exactly %d allowed", 10*capacity, allowed.Load(), denied.Load(), capacity)
	}
}

// BenchmarkRedisTake is the Redis store's decisions per second, serial and
// from 32 goroutines at once, with batch on (the default) and off, and the
// CPU time this process spent per decision (cpu-ns/op: the store's side,
// not Redis's; a Redis round trip's wait costs no CPU, so on a shared
// machine it moves less than ns/op). bench/redis-benchmark.sh runs it
// beside redis-benchmark.
func BenchmarkRedisTake(b *testing.B) {
	srv := redistest.Start(b)
	bk := bucketFor("bench")
	l := bucket.Limit{Capacity: 1_000_000_000, Rate: bucket.Rate{Tokens: 1, Interval: 1}} // never denies
	one := oneLimit(l)
	for _, batch := range []bool{true, false} {
		s := newTestStore(b, testConfig{Addresses: []string{srv.URL()}, Timeout: time.Second, Batch: &batch})
		if (s.conn.batcher() != nil) != batch {
			b.Fatalf("batch %v: the store's batcher is %v", batch, s.conn.batcher())
		}
		name := map[bool]string{true: "batch-on", false: "batch-off"}[batch]
		b.Run(name+"/serial", func(b *testing.B) {
			defer reportCPU(b)()
			var out [1]bucket.Result
			for b.Loop() {
				if _, err := s.Take(bg, bk, one, 1, out[:]); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
		b.Run(name+"/parallel", func(b *testing.B) {
			defer reportCPU(b)()
			b.SetParallelism(16)
			b.RunParallel(func(pb *testing.PB) {
				var out [1]bucket.Result
				for pb.Next() {
					if _, err := s.Take(bg, bk, one, 1, out[:]); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
		if batch {
			b.Logf("redis-benchmark equivalent: redis-benchmark -p PORT -n 200000 -c 32 -q EVALSHA %s 1 %s %d %d %d 1",
				bucketScript.Hash(), string(bk), l.Capacity, l.Rate.Tokens, l.Rate.Interval)
		}
	}
}

// reportCPU reports, when the returned function is called, the CPU time
// (user and system) this process spent per op since reportCPU was.
func reportCPU(b *testing.B) func() {
	start := processCPU()
	return func() {
		if b.N > 0 {
			b.ReportMetric(float64(processCPU()-start)/float64(b.N), "cpu-ns/op")
		}
	}
}

// processCPU is the CPU time this process has spent, in ns.
func processCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}
