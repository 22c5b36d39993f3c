// Command redisrate measures the Redis CPU one rate-limit decision costs:
// this plugin's bucket script (through internal/redisbucket's Store, in
// strict mode) beside go-redis/redis_rate's GCRA script, on the same
// redis-server, with random keys, in one run. It reads the cost from
// Redis's own INFO commandstats: the microseconds of every command the
// decisions sent (EVALSHA, EVAL, FCALL and any other), which include those
// of the commands a script calls, divided by the decisions made.
//
// It is its own module (bench/redisrate/go.mod), so that redis_rate never
// enters the plugin's go.mod; the plugin comes from the repository by a
// replace directive.
//
// Usage (from bench/redisrate): go run . [-addr 127.0.0.1:6379] [-rounds 3]
// Without -addr it starts a redis-server on a free 127.0.0.1 port.
package main

import (
	"bufio"
	"context"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"log"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

var (
	addr      = flag.String("addr", "", "a redis-server on 127.0.0.1 to use (host:port); empty: start one")
	decisions = flag.Int("n", 200000, "decisions per setup and round")
	keys      = flag.Int("keys", 100000, "distinct clients, picked at random")
	workers   = flag.Int("c", 32, "concurrent callers")
	rounds    = flag.Int("rounds", 3, "rounds of every setup, alternating")
	only      = flag.String("setups", "ours,tier,redis_rate", "which setups, comma-separated: ours (one limit), tier (two limits and a daily quota), redis_rate")
	batch     = flag.Bool("batch", true, "pipeline the Store's concurrent decisions, as Caddy's default")
	limitFlag = flag.String("limit", "1000 1000/h", "every setup's limit: capacity and rate, as rate_limit's line")
	alongside = flag.Duration("alongside", 0, "instead of rounds: run the first setup for this long, without warming up or resetting Redis's stats, and print the decisions made (bench/redis-cpu.sh reads the stats around it)")
)

func main() {
	flag.Parse()
	if !strings.HasPrefix(*addr, "127.0.0.1:") && *addr != "" {
		log.Fatal("-addr must be a 127.0.0.1 address")
	}
	if *addr == "" {
		a, stop, err := startRedis()
		if err != nil {
			log.Fatal(err)
		}
		defer stop()
		*addr = a
	}
	ctx := context.Background()
	rdb := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: *workers})
	defer rdb.Close()
	version, _ := rdb.InfoMap(ctx, "server").Result()

	// The default, 1000 an hour with a burst of 1000, keeps a client's
	// state seconds after each decision, so that later decisions on it
	// read one; no client is ever refused.
	capText, rateText, _ := strings.Cut(*limitFlag, " ")
	capacity, err := strconv.ParseInt(capText, 10, 64)
	if err != nil {
		log.Fatal(err)
	}
	rate, err := bucket.ParseRate(rateText)
	if err != nil {
		log.Fatal(err)
	}
	l := bucket.Limit{Capacity: capacity, Rate: rate}
	l2 := bucket.Limit{Capacity: 10 * capacity, Rate: bucket.Rate{Tokens: rate.Tokens * 10, Interval: rate.Interval}}
	for _, x := range []bucket.Limit{l, l2} {
		if err := x.Validate(1); err != nil {
			log.Fatal(err)
		}
	}
	one := bucket.Tier{Limits: []bucket.Limit{l}}
	tier := bucket.Tier{Limits: []bucket.Limit{l, l2}, Quotas: []bucket.Quota{{N: 1 << 40, Period: bucket.Day, Loc: time.UTC}}}

	plan, err := redisbucket.NewPlan(redisbucket.Options{Addresses: []string{"redis://" + *addr}, Timeout: 2 * time.Second, PoolSize: *workers, Batch: *batch})
	if err != nil {
		log.Fatal(err)
	}
	conn := plan.Connect(zap.NewNop())
	defer conn.Close()
	store := redisbucket.NewStore(conn, redisbucket.StoreOptions{Prefix: "rlbench:"})
	defer store.Close()
	limiter := redis_rate.NewLimiter(rdb)
	// The same limit: Tokens every Interval, a burst of the capacity.
	gcra := redis_rate.Limit{Rate: int(rate.Tokens), Burst: int(capacity), Period: time.Duration(rate.Interval) * time.Microsecond}

	// Each setup's clients have keys of their own (the tier's name in it).
	storeTake := func(name string, t bucket.Tier) func(context.Context, int) error {
		return func(ctx context.Context, client int) error {
			var digest [16]byte
			copy(digest[:], strconv.Itoa(client))
			key := store.AppendKey(make([]byte, 0, 96), "bench", name, digest[:])
			var out [3]bucket.Result
			ok, err := store.Take(ctx, key, t, 1, out[:])
			if err == nil && !ok {
				err = errors.New("refused: the bench must never be refused")
			}
			return err
		}
	}
	setups := map[string]func(context.Context, int) error{
		"ours": storeTake("one", one),
		"tier": storeTake("tier", tier),
		"redis_rate": func(ctx context.Context, client int) error {
			res, err := limiter.Allow(ctx, "bench:"+strconv.Itoa(client), gcra)
			if err == nil && res.Allowed == 0 {
				err = errors.New("refused: the bench must never be refused")
			}
			return err
		},
	}
	names := strings.Split(*only, ",")
	for _, n := range names {
		if setups[n] == nil {
			log.Fatalf("no setup %q", n)
		}
	}
	if *alongside > 0 {
		n, err := runFor(ctx, setups[names[0]], *alongside)
		if err != nil {
			log.Fatalf("%s: %v", names[0], err)
		}
		fmt.Printf("%s: %d decisions in %s\n", names[0], n, *alongside)
		return
	}
	// Warm up: every script loaded, every setup's first calls made.
	for _, n := range names {
		if _, _, err := run(ctx, rdb, setups[n], 2000); err != nil {
			log.Fatalf("%s: %v", n, err)
		}
	}

	per := map[string][]float64{}
	for r := 1; r <= *rounds; r++ {
		for _, n := range names {
			usec, stats, err := run(ctx, rdb, setups[n], *decisions)
			if err != nil {
				log.Fatalf("%s: %v", n, err)
			}
			us := float64(usec) / float64(*decisions)
			per[n] = append(per[n], us)
			fmt.Printf("round %d %-10s %6.2f µs/decision  (%s)\n", r, n, us, stats)
		}
	}
	load, _ := os.ReadFile("/proc/loadavg")
	fmt.Printf("\nredis-server %s at %s; %d decisions a setup and round, %d callers, %d random clients, limit %s; load average %s\n",
		version["Server"]["redis_version"], *addr, *decisions, *workers, *keys, *limitFlag, strings.Join(strings.Fields(string(load))[:3], " "))
	fmt.Println("Redis µs per decision (commandstats usec of every command sent / decisions), median of rounds:")
	med := map[string]float64{}
	for _, n := range names {
		med[n] = median(per[n])
		fmt.Printf("  %-10s %6.2f   rounds: %s\n", n, med[n], fmtAll(per[n]))
	}
	if g, ok := med["redis_rate"]; ok {
		for _, n := range names {
			if n != "redis_rate" {
				// The ratio round by round, each pair run back to back.
				var rs []float64
				for i := range per[n] {
					rs = append(rs, per[n][i]/per["redis_rate"][i])
				}
				fmt.Printf("  %s / redis_rate: %.2f (medians), %.2f (median of the rounds' ratios)\n", n, med[n]/g, median(rs))
			}
		}
	}
}

// run makes n decisions by do, from *workers callers, each on a random
// client, and answers what they cost Redis: the usec INFO commandstats
// counts for every command but INFO and CONFIG themselves, over the run.
// Commands a script calls are counted twice there (in the script's usec
// and on their own), so only the commands the decisions sent are summed:
// those not called by a script.
func run(ctx context.Context, rdb *redis.Client, do func(context.Context, int) error, n int) (int64, string, error) {
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		return 0, "", err
	}
	var wg sync.WaitGroup
	errs := make(chan error, *workers)
	for w := range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for i := w; i < n; i += *workers {
				if err := do(ctx, rng.IntN(*keys)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return 0, "", err
	}
	text, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		return 0, "", err
	}
	var sum int64
	var parts []string
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		name, rest, ok := strings.Cut(strings.TrimPrefix(sc.Text(), "cmdstat_"), ":")
		if !ok || !strings.HasPrefix(sc.Text(), "cmdstat_") || name == "info" || strings.HasPrefix(name, "config") {
			continue
		}
		f := map[string]string{}
		for _, kv := range strings.Split(rest, ",") {
			k, v, _ := strings.Cut(kv, "=")
			f[k] = v
		}
		calls, _ := strconv.ParseInt(f["calls"], 10, 64)
		usec, _ := strconv.ParseInt(f["usec"], 10, 64)
		parts = append(parts, fmt.Sprintf("%s %d calls %d usec", name, calls, usec))
		if !calledByScripts[name] {
			sum += usec
		}
	}
	slices.Sort(parts)
	return sum, strings.Join(parts, ", "), nil
}

// runFor makes decisions by do from *workers callers, each on a random
// client, for d, and answers how many.
func runFor(ctx context.Context, do func(context.Context, int) error, d time.Duration) (int64, error) {
	var wg sync.WaitGroup
	var made atomic.Int64
	errs := make(chan error, *workers)
	end := time.Now().Add(d)
	for w := range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := mrand.New(mrand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for time.Now().Before(end) {
				if err := do(ctx, rng.IntN(*keys)); err != nil {
					errs <- err
					return
				}
				made.Add(1)
			}
		}()
	}
	wg.Wait()
	close(errs)
	return made.Load(), <-errs
}

// calledByScripts are the commands the two scripts call; neither setup
// sends them itself.
var calledByScripts = map[string]bool{"time": true, "get": true, "set": true, "del": true, "pttl": true}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fmtAll(v []float64) string {
	var s []string
	for _, x := range v {
		s = append(s, strconv.FormatFloat(x, 'f', 2, 64))
	}
	return strings.Join(s, " ")
}

// startRedis starts a redis-server on a free 127.0.0.1 port, without
// persistence, and answers its address and how to stop it.
func startRedis() (string, func(), error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir, err := os.MkdirTemp("", "redisrate")
	if err != nil {
		return "", nil, err
	}
	var name [4]byte
	rand.Read(name[:])
	cmd := exec.Command("redis-server", "--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--save", "", "--appendonly", "no",
		"--dir", dir, "--logfile", filepath.Join(dir, fmt.Sprintf("redis-%x.log", name)))
	if err := cmd.Start(); err != nil {
		return "", nil, err
	}
	stop := func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.RemoveAll(dir)
	}
	a := fmt.Sprintf("127.0.0.1:%d", port)
	rdb := redis.NewClient(&redis.Options{Addr: a})
	defer rdb.Close()
	for range 100 {
		if rdb.Ping(context.Background()).Err() == nil {
			return a, stop, nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	stop()
	return "", nil, errors.New("redis-server did not start")
}
