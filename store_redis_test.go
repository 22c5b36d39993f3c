package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"

	"github.com/caddyserver/caddy/v2"
)

var bg = context.Background()

// slowLimit is a bucket that does not refill within a test.
func slowLimit(capacity int64) bucket.Limit {
	return bucket.Limit{Capacity: capacity, Rate: bucket.Rate{Tokens: 1, Interval: 3600_000_000}}
}

func TestRedisKeysHideClientValues(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Prefix: "edge:"})
	b := &Bucket{Policy: "api", Tier: "gold", Keyer: "header/X-Api-Key", Value: []byte("sk_live_very_secret")}
	if _, err := takeLimit(bg, s, b, slowLimit(5), 1); err != nil {
		t.Fatal(err)
	}
	keys := srv.do("KEYS", "*").([]any)
	if len(keys) != 1 {
		t.Fatalf("keys %v, want one", keys)
	}
	key := keys[0].(string)
	if !regexp.MustCompile(`^edge:3:api:4:gold:[0-9a-f]{32}$`).MatchString(key) {
		t.Fatalf("key %q, want edge:3:api:4:gold: and 32 hex digits", key)
	}
	if strings.Contains(key, "secret") || strings.Contains(key, "X-Api-Key") {
		t.Fatalf("key %q shows the client value", key)
	}
	// The hash is stable: another node, another process, the same key.
	other := newPrivateRedisStore(t, &RedisStore{Prefix: "edge:", Addresses: []string{srv.url()}})
	if other.keyOf(b) != key {
		t.Fatalf("key %q differs from %q made apart", other.keyOf(b), key)
	}
}

func TestRedisDenyCacheAnswersWithoutRedis(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}})
	b := bucketFor("198.51.100.1")
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 400_000}} // 1 per 400 ms

	if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed {
		t.Fatalf("first take: %+v, %v", res, err)
	}
	first, err := takeLimit(bg, s, b, l, 1)
	if err != nil || first.Allowed {
		t.Fatalf("second take: %+v, %v; want denied by Redis", first, err)
	}
	calls := scriptCalls(srv)
	hits := s.engine.DenyCacheHits()
	for range 50 {
		res, err := takeLimit(bg, s, b, l, 1)
		if err != nil || res.Allowed {
			t.Fatalf("take within the retry time: %+v, %v; want denied", res, err)
		}
		if res.RetryAfter <= 0 || res.RetryAfter > first.RetryAfter {
			t.Fatalf("cached Retry-After %dµs, want within (0, %d]", res.RetryAfter, first.RetryAfter)
		}
	}
	if got := s.engine.DenyCacheHits() - hits; got != 50 {
		t.Fatalf("deny cache hits %d, want 50", got)
	}
	if got := scriptCalls(srv); got != calls {
		t.Fatalf("Redis ran the script %d more times while the deny cache held the bucket", got-calls)
	}
	// Once the retry time has passed, Redis decides again.
	time.Sleep(time.Duration(first.RetryAfter)*time.Microsecond + 20*time.Millisecond)
	if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed {
		t.Fatalf("take after the retry time: %+v, %v; want allowed by Redis", res, err)
	}
	if scriptCalls(srv) == calls {
		t.Fatal("the take after the retry time did not reach Redis")
	}
}

// scriptCalls counts EVALSHA and EVAL calls on the server.
func scriptCalls(srv *redisServer) int {
	return commandCalls(srv, "evalsha") + evalCalls(srv)
}

func evalCalls(srv *redisServer) int { return commandCalls(srv, "eval") }

func commandCalls(srv *redisServer, command string) int {
	v := srv.info("commandstats", "cmdstat_"+command)
	calls, _, _ := strings.Cut(strings.TrimPrefix(v, "calls="), ",")
	n, _ := strconv.Atoi(calls)
	return n
}

func TestRedisResetAndPeek(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}})
	b := bucketFor("192.0.2.9")
	l := slowLimit(3)
	for range 3 {
		if _, err := takeLimit(bg, s, b, l, 1); err != nil {
			t.Fatal(err)
		}
	}
	if res, _ := takeLimit(bg, s, b, l, 1); res.Allowed {
		t.Fatal("4th take of 3 allowed")
	}
	peek, err := peekLimit(bg, s, b, l)
	if err != nil || peek.Allowed || peek.Remaining != 0 {
		t.Fatalf("peek at an empty bucket: %+v, %v", peek, err)
	}
	if err := s.reset(bg, b); err != nil {
		t.Fatal(err)
	}
	peek, err = peekLimit(bg, s, b, l)
	if err != nil || !peek.Allowed || peek.Remaining != 3 || peek.ResetAfter != 0 {
		t.Fatalf("peek after reset: %+v, %v; want a full bucket", peek, err)
	}
	if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed || res.Remaining != 2 {
		t.Fatalf("take after reset: %+v, %v", res, err)
	}
}

func TestRedisScriptFlushIsHandled(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}})
	b := bucketFor("192.0.2.10")
	l := slowLimit(5)
	if res, err := takeLimit(bg, s, b, l, 1); err != nil || res.Remaining != 4 {
		t.Fatalf("first take: %+v, %v", res, err)
	}
	evals := evalCalls(srv)
	for i := range 2 {
		srv.do("SCRIPT", "FLUSH")
		res, err := takeLimit(bg, s, b, l, 1)
		if err != nil || !res.Allowed || res.Remaining != int64(3-i) {
			t.Fatalf("take after SCRIPT FLUSH: %+v, %v; want allowed with %d left", res, err, 3-i)
		}
	}
	if got := evalCalls(srv) - evals; got != 2 {
		t.Fatalf("%d EVAL calls after two SCRIPT FLUSH, want the two NOSCRIPT fallbacks", got)
	}
}

func TestRedisOverTLS(t *testing.T) {
	t.Parallel()
	ca := redistest.NewCA(t)
	srv := startTLSRedis(t, ca)
	url := "rediss://" + srv.addr()
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{url}, TLS: &RedisTLS{CA: ca.CAFile}})
	b := bucketFor("192.0.2.11")
	for i := range 3 {
		res, err := takeLimit(bg, s, b, slowLimit(2), 1)
		if err != nil {
			t.Fatalf("take over TLS: %v", err)
		}
		if res.Allowed != (i < 2) {
			t.Fatalf("take %d over TLS: %+v", i+1, res)
		}
	}
	// Without the CA the server's certificate is not trusted.
	untrusted := newRedisStoreFor(t, &RedisStore{Addresses: []string{url}, Prefix: "other:", Timeout: caddy.Duration(5 * time.Second)})
	if _, err := takeLimit(bg, untrusted, b, slowLimit(2), 1); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("take over TLS without the CA: %v, want a certificate error", err)
	}
}

func TestRedisClusterLimitsEveryClientExactly(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "Redis Cluster of three")
	nodes := startCluster(t, 3)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.url())
	}
	s := newRedisStoreFor(t, &RedisStore{Addresses: addrs, Timeout: caddy.Duration(5 * time.Second)})
	const clients, capacity = 60, 3
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			b := bucketFor("10.0.0." + strconv.Itoa(c))
			allowed := 0
			for range capacity + 2 {
				res, err := takeLimit(bg, s, b, slowLimit(capacity), 1)
				if err != nil {
					t.Error(err)
					return
				}
				if res.Allowed {
					allowed++
				}
			}
			if allowed != capacity {
				t.Errorf("client %d: %d allowed, want %d", c, allowed, capacity)
			}
		})
	}
	wg.Wait()

	total := int64(0)
	for _, n := range nodes {
		size := n.do("DBSIZE").(int64)
		if size == 0 {
			t.Errorf("node %s holds no bucket: the keys are not spread", n.addr())
		}
		total += size
	}
	if total != clients {
		t.Fatalf("%d keys over the cluster, want %d", total, clients)
	}
	// Each key lives on the master that owns its slot.
	for c := range clients {
		key := s.keyOf(bucketFor("10.0.0." + strconv.Itoa(c)))
		slot := nodes[0].do("CLUSTER", "KEYSLOT", key).(int64)
		found := 0
		for _, n := range nodes {
			if n.do("CLUSTER", "COUNTKEYSINSLOT", slot).(int64) > 0 && n.do("EXISTS", key).(int64) == 1 {
				found++
			}
		}
		if found != 1 {
			t.Fatalf("key of client %d (slot %d) is on %d nodes, want 1", c, slot, found)
		}
	}
}

func TestRedisSentinelFailoverKeepsLimiting(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "fault injection")
	st := startSentinel(t)
	s := newRedisStoreFor(t, &RedisStore{
		Sentinel: &RedisSentinel{Master: st.name, Addresses: st.sentinelAddresses},
		Timeout:  caddy.Duration(time.Second),
	})
	before := bucketFor("192.0.2.20")
	for i := range 4 {
		res, err := takeLimit(bg, s, before, slowLimit(3), 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed != (i < 3) {
			t.Fatalf("take %d before failover: %+v", i+1, res)
		}
	}
	// Let the replica have the writes, as it will most of the time:
	// replication is asynchronous, and what it has not received when the
	// master fails is lost.
	if n := st.master.do("WAIT", 1, 2000).(int64); n != 1 {
		t.Fatalf("WAIT: %d replicas acknowledged, want 1", n)
	}

	st.failover(t)

	waitFor(t, 20*time.Second, "the store to reach the new master", func() bool {
		_, err := takeLimit(bg, s, bucketFor("probe"), slowLimit(1000), 1)
		return err == nil
	})
	after := bucketFor("192.0.2.21")
	first, err := takeLimit(bg, s, after, slowLimit(3), 1)
	if err != nil || !first.Allowed || first.Remaining != 2 {
		t.Fatalf("first take after failover: %+v, %v", first, err)
	}
	for i := range 3 {
		res, err := takeLimit(bg, s, after, slowLimit(3), 1)
		if err != nil {
			t.Fatal(err)
		}
		if res.Allowed != (i < 2) {
			t.Fatalf("take %d after failover: %+v", i+2, res)
		}
	}
	// The bucket emptied before the failover is still empty on the new
	// master.
	peek, err := peekLimit(bg, s, before, slowLimit(3))
	if err != nil || peek.Allowed {
		t.Fatalf("peek after failover at the bucket emptied before: %+v, %v", peek, err)
	}
	if got := st.master.do("DBSIZE").(int64); got != 3 {
		t.Fatalf("the new master holds %d buckets, want 3", got)
	}
}

func TestRedisProvisionDoesNotNeedRedis(t *testing.T) {
	t.Parallel()
	port := freePort(t) // nothing listens here
	start := time.Now()
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{"redis://127.0.0.1:" + strconv.Itoa(port)}})
	if d := time.Since(start); d > time.Second {
		t.Fatalf("provision took %s with Redis down", d)
	}
	if _, err := takeLimit(bg, s, bucketFor("x"), slowLimit(1), 1); err == nil {
		t.Fatal("take with Redis down: no error")
	}
}

// TestRedisDownModes runs a real config with each on_store_error mode,
// then stops Redis, kills it and starts it again, with traffic flowing.
func TestRedisDownModes(t *testing.T) {
	skipUnderShort(t, "fault injection")
	const timeout = 100 * time.Millisecond
	for _, mode := range []string{"local", "allow", "deny"} {
		t.Run(mode, func(t *testing.T) {
			srv := startRedis(t)
			s := serveOnRedis(t, srv, timeout, mode)
			var (
				mu      sync.Mutex
				slowest time.Duration
				where   string
				phase   atomic.Value
			)
			phase.Store("Redis up")
			send := func(ip string) response {
				start := time.Now()
				r := s.from(ip, "/")
				d := time.Since(start)
				mu.Lock()
				if d > slowest {
					slowest, where = d, fmt.Sprintf("%s, from %s, status %d", phase.Load(), ip, r.status)
				}
				mu.Unlock()
				return r
			}
			expectLimited := func(phase, ip string) {
				t.Helper()
				for i := range 5 {
					want := 200
					if i >= 3 {
						want = 429
					}
					if r := send(ip); r.status != want {
						t.Fatalf("%s: request %d from %s: status %d, want %d", phase, i+1, ip, r.status, want)
					}
				}
			}

			// Background traffic across every phase: never a 5xx other
			// than deny's 503, never a wait past the timeout.
			stop := make(chan struct{})
			var traffic sync.WaitGroup
			traffic.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					r := send("127.0.1." + strconv.Itoa(i%200))
					if r.status >= 500 && !(mode == "deny" && r.status == 503) {
						t.Errorf("background request: status %d", r.status)
					}
					time.Sleep(5 * time.Millisecond)
				}
			})
			defer func() { close(stop); traffic.Wait() }()

			expectLimited("Redis up", "127.0.0.2")
			if n := srv.do("DBSIZE").(int64); n < 1 {
				t.Fatal("no bucket in Redis while it is up")
			}

			check := func(phase, ip string) {
				t.Helper()
				switch mode {
				case "local":
					expectLimited(phase, ip)
				case "allow":
					for i := range 5 {
						if r := send(ip); r.status != 200 {
							t.Fatalf("%s: request %d: status %d, want 200", phase, i+1, r.status)
						}
					}
				case "deny":
					for i := range 5 {
						r := send(ip)
						if r.status != http.StatusServiceUnavailable || r.header.Get("Retry-After") != "1" {
							t.Fatalf("%s: request %d: status %d Retry-After %q, want 503 and 1", phase, i+1, r.status, r.header.Get("Retry-After"))
						}
					}
				}
			}
			phase.Store("Redis stopped")
			srv.pause() // connections hang: each decision waits for the timeout
			check("Redis stopped", "127.0.0.3")
			phase.Store("Redis killed")
			srv.kill() // connections refused
			check("Redis killed", "127.0.0.4")

			phase.Store("Redis restarted")
			srv.start() // empty, on the same port
			// After the breaker's cool-down a probe reaches Redis again.
			waitFor(t, 10*time.Second, "Redis to hold buckets again", func() bool {
				send("127.0.2.1")
				return srv.do("DBSIZE").(int64) > 0
			})
			expectLimited("Redis restarted", "127.0.0.5")
			if n := srv.do("DBSIZE").(int64); n < 2 {
				t.Fatalf("%d buckets in the restarted Redis, want the new client's too", n)
			}

			mu.Lock()
			defer mu.Unlock()
			t.Logf("slowest request: %s (%s)", slowest, where)
			if slowest > timeout+250*time.Millisecond {
				t.Fatalf("slowest request took %s (%s), timeout %s", slowest, where, timeout)
			}
		})
	}
}

func TestRedisCaddyfile(t *testing.T) {
	t.Parallel()
	adapt := func(store string) (map[string]any, error) {
		cfg, err := adaptCaddyfile(fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:8080 {
	rate_limit 3 1/s {
		%s
	}
	respond "ok"
}`, store))
		if err != nil {
			return nil, err
		}
		var out struct {
			Apps struct {
				HTTP struct {
					Servers map[string]struct {
						Routes []struct {
							Handle []struct {
								Routes []struct {
									Handle []map[string]any
								}
							}
						}
					}
				}
			}
		}
		if err := json.Unmarshal(cfg, &out); err != nil {
			return nil, err
		}
		for _, srv := range out.Apps.HTTP.Servers {
			for _, h := range srv.Routes[0].Handle[0].Routes[0].Handle {
				if h["handler"] == "rate_limit" {
					st, _ := h["store"].(map[string]any)
					return st, nil
				}
			}
		}
		return nil, fmt.Errorf("no rate_limit handler in %s", cfg)
	}

	got, err := adapt(`store redis {
			address rediss://default:{env.REDIS_PASSWORD}@127.0.0.1:6380 redis://127.0.0.1:6381
			username edge
			password {env.REDIS_PASSWORD}
			tls {
				ca /etc/ssl/redis-ca.pem
				cert /etc/ssl/client.pem
				key /etc/ssl/client-key.pem
				insecure_skip_verify
			}
			prefix edge:
			timeout 250ms
			pool_size 32
			breaker_failures 3
			breaker_cooldown 5s
			deny_cache_size 5000
			batch off
		}`)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"store":     "redis",
		"addresses": []any{"rediss://default:{env.REDIS_PASSWORD}@127.0.0.1:6380", "redis://127.0.0.1:6381"},
		"username":  "edge",
		"password":  "{env.REDIS_PASSWORD}",
		"tls": map[string]any{"ca": "/etc/ssl/redis-ca.pem", "cert": "/etc/ssl/client.pem",
			"key": "/etc/ssl/client-key.pem", "insecure_skip_verify": true},
		"prefix":           "edge:",
		"timeout":          float64(250 * time.Millisecond),
		"pool_size":        float64(32),
		"breaker_failures": float64(3),
		"breaker_cooldown": float64(5 * time.Second),
		"deny_cache_size":  float64(5000),
		"batch":            false,
	}
	if g, w := fmt.Sprint(got), fmt.Sprint(want); g != w {
		t.Fatalf("store JSON\n got %s\nwant %s", g, w)
	}

	got, err = adapt(`store redis {
			sentinel mymaster 127.0.0.1:26379 127.0.0.1:26380
			db 2
		}`)
	if err != nil {
		t.Fatal(err)
	}
	if g := fmt.Sprint(got); g != "map[db:2 sentinel:map[addresses:[127.0.0.1:26379 127.0.0.1:26380] master:mymaster] store:redis]" {
		t.Fatalf("sentinel store JSON: %s", g)
	}

	for _, tc := range []struct{ store, want string }{
		{"store redis redis://127.0.0.1", `unexpected "redis://127.0.0.1"`},
		{"store redis {\n address\n }", "address: want one or more"},
		{"store redis {\n sentinel mymaster\n }", "sentinel: want <master> <address...>"},
		{"store redis {\n db -1\n }", "db -1"},
		{"store redis {\n prefix a:\n prefix b:\n }", "prefix: given twice"},
		{"store redis {\n timeout 1s\n timeout 2s\n }", "timeout: given twice"},
		{"store redis {\n db two\n }", `db "two"`},
		{"store redis {\n timeout soon\n }", `timeout "soon"`},
		{"store redis {\n timeout -1s\n }", `timeout "-1s"`},
		{"store redis {\n pool_size 0\n }", "pool_size 0"},
		{"store redis {\n timeout 0\n }", `timeout "0": must be above 0`},
		{"store redis {\n breaker_failures 0\n }", "breaker_failures 0"},
		{"store redis {\n breaker_cooldown 0s\n }", `breaker_cooldown "0s": must be above 0`},
		{"store redis {\n breaker_cooldown later\n }", `breaker_cooldown "later"`},
		{"store redis {\n deny_cache_size -5\n }", "deny_cache_size -5"},
		{"store redis {\n batch yes\n }", `batch "yes": want on or off`},
		{"store redis {\n prefix\n }", "prefix: want exactly one value"},
		{"store redis {\n cluster yes\n }", `unknown subdirective "cluster"`},
		{"store redis {\n tls {\n ca\n }\n }", "tls ca: want a file"},
		{"store redis {\n tls {\n pem x\n }\n }", `tls: unknown subdirective "pem"`},
		{"store redis {\n tls {\n cert c.pem\n }\n }", "give cert and key together"},
		{"store redis {\n address redis://127.0.0.1\n sentinel m 127.0.0.1:26379\n }", "not both"},
	} {
		_, err := adapt(tc.store)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.store, err, tc.want)
		}
	}
}

func TestRedisProvisionErrorsNameTheValue(t *testing.T) {
	t.Setenv("RL_TEST_REDIS_PASSWORD", "hunter2")
	for _, tc := range []struct {
		store     RedisStore
		want      string
		forbidden string
	}{
		{RedisStore{Addresses: []string{"ftp://127.0.0.1:21"}}, `address "ftp://127.0.0.1:21"`, ""},
		{RedisStore{Addresses: []string{"127.0.0.1"}}, `address "127.0.0.1"`, ""},
		{RedisStore{Addresses: []string{"127.0.0.1:99999"}}, `port "99999"`, ""},
		{RedisStore{Addresses: []string{"redis://u:s3cret@127.0.0.1:6379/x"}}, `"redis://u:xxxxx@127.0.0.1:6379/x"`, "s3cret"},
		{RedisStore{Addresses: []string{"redis://u:{env.RL_TEST_REDIS_PASSWORD}@127.0.0.1:bad"}}, "address", "hunter2"},
		{RedisStore{Addresses: []string{"redis://127.0.0.1:6379", "unix:///tmp/redis.sock"}}, `"unix:///tmp/redis.sock": a Cluster needs TCP`, ""},
		{RedisStore{Addresses: []string{"redis://127.0.0.1:6379", "redis://127.0.0.1:6380"}, DB: 1}, "only database 0", ""},
		{RedisStore{Addresses: []string{"redis://127.0.0.1:6379", "rediss://127.0.0.1:6380"}}, "mix redis:// and rediss://", ""},
		{RedisStore{Sentinel: &RedisSentinel{Master: "m", Addresses: []string{"nowhere"}}}, `sentinel address "nowhere"`, ""},
		{RedisStore{Sentinel: &RedisSentinel{Master: "m"}}, `sentinel "m": no sentinel address`, ""},
		{RedisStore{TLS: &RedisTLS{CA: "/nonexistent/ca.pem"}}, `tls ca "/nonexistent/ca.pem"`, ""},
		{RedisStore{Timeout: caddy.Duration(-time.Second)}, "timeout -1s", ""},
		{RedisStore{BreakerFailures: -1}, "breaker_failures -1", ""},
	} {
		s := tc.store
		err := s.Provision(caddy.Context{})
		if err == nil {
			_ = s.Cleanup()
			t.Errorf("%+v: provisioned, want an error containing %q", tc.store, tc.want)
			continue
		}
		if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %q, want one containing %q", tc.store, err, tc.want)
		}
		if tc.forbidden != "" && strings.Contains(err.Error(), tc.forbidden) {
			t.Errorf("error %q shows the password", err)
		}
	}
}

func TestRedisClientSurvivesReloadAndClosesAfterTheLast(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	settings := RedisStore{Addresses: []string{srv.url()}, Prefix: "reload:"}
	a, b := settings, settings
	if err := a.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	if err := b.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	if a.poolKey != b.poolKey {
		t.Fatal("two configs with the same settings got two clients")
	}
	other := RedisStore{Addresses: []string{srv.url()}, Password: "x"}
	if err := other.Provision(caddy.Context{}); err != nil {
		t.Fatal(err)
	}
	if other.poolKey == a.poolKey {
		t.Fatal("different settings share a client")
	}
	_ = other.Cleanup()
	if err := a.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if _, err := takeLimit(bg, &b, bucketFor("r"), slowLimit(1), 1); err != nil {
		t.Fatalf("take after the old config's cleanup: %v", err)
	}
	if err := b.Cleanup(); err != nil {
		t.Fatal(err)
	}
	// Another client: the deny cache knows "r" is empty for now.
	if _, err := takeLimit(bg, &b, bucketFor("r2"), slowLimit(1), 1); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Fatalf("take after the last cleanup: %v, want a closed client", err)
	}
}

// With on_store_error deny, the requests that wait for the deny cache's
// probe (once a client's denial expired) are not answered 503 when the
// probe's client hangs up: one of them asks Redis, and they get its
// answer.
// Regression test for issue 30 item 1.
func TestRedisDenyCacheProbeWhoseClientHangsUpAnswersNoWaiter503(t *testing.T) {
	srv := startRedis(t)
	s := serve(t, fmt.Sprintf(`rate_limit 1 10/s {
		name probe_hangs_up
		key header X-Key
		on_store_error deny
		store redis {
			address %s
			timeout 10s
		}
	}
	respond ok`, srv.url()))
	if r := s.get("/", "X-Key: flood"); r.status != 200 {
		t.Fatalf("the first request: %d", r.status)
	}
	if r := s.get("/", "X-Key: flood"); r.status != 429 {
		t.Fatalf("the second request: %d, want 429 (the deny cache)", r.status)
	}
	time.Sleep(150 * time.Millisecond) // the 100 ms denial expires
	srv.pause()
	paused := true
	defer func() {
		if paused {
			srv.Resume()
		}
	}()
	// Another client's decision is out, so that the probe's call queues in
	// the batcher, where a client that hangs up stops waiting at once.
	other := make(chan waitOutcome, 1)
	go func() { other <- s.send(bg, "another") }()
	waitFor(t, 5*time.Second, "the other client's call", func() bool { return goroutinesIn("IO wait", "redisbucket.(*Store).callBy(") == 1 })
	probeCtx, hangUp := context.WithCancel(bg)
	probe := make(chan waitOutcome, 1)
	go func() { probe <- s.send(probeCtx, "flood") }()
	waitFor(t, 5*time.Second, "the probe's call", func() bool { return goroutinesIn("select", "redisbucket.(*redisBatcher).takeBy(") == 1 })
	const waiters = 3
	waited := make(chan waitOutcome, waiters)
	for range waiters {
		go func() { waited <- s.send(bg, "flood") }()
	}
	waitFor(t, 5*time.Second, "the requests waiting for the probe", func() bool {
		return goroutinesIn("select", "redisbucket.(*Store).decide(")-goroutinesIn("select", "redisbucket.(*Store).callBy(") == waiters
	})
	hangUp()
	if o := <-probe; o.err == nil {
		t.Fatalf("the probe whose client hung up got an answer: %d", o.status)
	}
	srv.Resume()
	paused = false
	if o := <-other; o.status != 200 {
		t.Fatalf("the other client: %d, %v", o.status, o.err)
	}
	served := 0
	for range waiters {
		o := <-waited
		switch {
		case o.err != nil || o.status != 200 && o.status != 429:
			t.Errorf("a request that waited for the probe: %d, %v; want Redis's answer, 200 or 429", o.status, o.err)
		case o.status == 200:
			served++
		}
	}
	if served > 1 {
		t.Errorf("%d requests of a bucket of 1 served", served)
	}
}

// goroutinesIn counts the goroutines in state (as a stack dump names it)
// whose stack holds frame.
func goroutinesIn(state, frame string) int {
	buf := make([]byte, 4<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		head, _, _ := strings.Cut(g, "\n")
		if strings.Contains(head, "["+state) && strings.Contains(g, frame) {
			n++
		}
	}
	return n
}

// A node renews its slots every third of slot_ttl, and a renewal takes up
// to timeout to land: under three timeouts, a held slot could expire
// before its renewal, and another request take it. Such a slot_ttl is
// refused, at adapt and at provision, with the minimum; three timeouts
// are enough.
// Regression test for issue 30 item 3.
func TestRedisSlotTTLUnderThreeTimeoutsIsRefused(t *testing.T) {
	t.Parallel()
	site := func(timeout, slotTTL string) string {
		return fmt.Sprintf("http://127.0.0.1:%d {\n\trate_limit {\n\t\ttier all {\n\t\t\tconcurrency 5\n\t\t}\n\t\tstore redis {\n\t\t\taddress redis://127.0.0.1:6379\n\t\t\t%s\n\t\t\tslot_ttl %s\n\t\t}\n\t}\n\trespond ok\n}\n",
			freePort(t), timeout, slotTTL)
	}
	for _, tc := range []struct {
		timeout, slotTTL time.Duration
		want             string
	}{
		{time.Second, 2 * time.Second, "slot_ttl 2s: must be at least 3s"},
		{time.Second, 2999 * time.Millisecond, "slot_ttl 2.999s: must be at least 3s"},
		{0, 299 * time.Millisecond, "slot_ttl 299ms: must be at least 300ms"},
	} {
		timeout := ""
		if tc.timeout > 0 {
			timeout = "timeout " + tc.timeout.String()
		}
		if _, err := adaptCaddyfile(site(timeout, tc.slotTTL.String())); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("adapt, %s and slot_ttl %s: %v, want an error containing %q", timeout, tc.slotTTL, err, tc.want)
		}
		s := RedisStore{Addresses: []string{"redis://127.0.0.1:6379"}, Timeout: caddy.Duration(tc.timeout), SlotTTL: caddy.Duration(tc.slotTTL)}
		if err := s.Provision(caddy.Context{}); err == nil || !strings.Contains(err.Error(), tc.want) {
			if err == nil {
				_ = s.Cleanup()
			}
			t.Errorf("provision, %s and slot_ttl %s: %v, want an error containing %q", timeout, tc.slotTTL, err, tc.want)
		}
	}
	if _, err := adaptCaddyfile(site("timeout 1s", "3s")); err != nil {
		t.Errorf("slot_ttl of three timeouts: %v", err)
	}
}

// slot_ttl is "default 30s, at least three times timeout": with a timeout
// of 20s and no slot_ttl, a renewal (every 10s) may land 30s after the one
// before, when the slot has expired and another request may take it. The
// store is refused at provision, or its slots live three timeouts.
func TestTheDefaultSlotTTLIsAtLeastThreeTimeouts(t *testing.T) {
	t.Parallel()
	r := startRedis(t)
	timeout := 20 * time.Second
	s := &RedisStore{Addresses: []string{r.url()}, Timeout: caddy.Duration(timeout)}
	if err := s.Provision(caddy.Context{Context: bg}); err != nil {
		if !strings.Contains(err.Error(), "slot_ttl") {
			t.Fatalf("provision: %v", err)
		}
		return // refused, naming slot_ttl
	}
	defer func() { _ = s.Cleanup() }()
	b := &Bucket{Policy: "p", Tier: "t", Keyer: "ip", Value: []byte("1.2.3.4")}
	slot, _, ok, err := s.acquire(bg, b, 5)
	if err != nil || !ok {
		t.Fatalf("acquire: %v %v", ok, err)
	}
	defer s.release(b, slot)
	var buf [192]byte
	key := string(s.key(buf[:0], b)) + ":c"
	members := r.client().ZRangeWithScores(bg, key, 0, -1).Val()
	if len(members) != 1 {
		t.Fatalf("the slot set %s holds %v", key, members)
	}
	now := time.Now().UnixMicro()
	if life := time.Duration(int64(members[0].Score)-now) * time.Microsecond; life < 3*timeout-time.Second {
		t.Errorf("timeout %s and no slot_ttl: a slot lives %s unrenewed, under three timeouts (%s)", timeout, life.Round(time.Second), 3*timeout)
	}
}

// TestRedisPasswordPlaceholderThatExpandsToNothingIsWarnedOf provisions
// a store whose password, and an address's, is an unset environment
// variable: the config loads, and a warning names the placeholder.
// Regression test for issue 31 item 13.
func TestRedisPasswordPlaceholderThatExpandsToNothingIsWarnedOf(t *testing.T) {
	const unset = "RL_TEST_UNSET_REDIS_PASSWORD"
	t.Setenv(unset, "")
	os.Unsetenv(unset)
	for _, c := range []struct{ name, settings string }{
		{"password", "address redis://127.0.0.1:%d\n\t\t\tpassword {env." + unset + "}"},
		{"address", "address redis://default:{env." + unset + "}@127.0.0.1:%d"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, file := serveLoggingTo(t, fmt.Sprintf(`
	rate_limit 10 1/s {
		store redis {
			`+c.settings+`
		}
	}
	respond "ok"`, freePort(t)))
			log, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			for line := range strings.SplitSeq(string(log), "\n") {
				if strings.Contains(line, `"level":"warn"`) && strings.Contains(line, "{env."+unset+"}") {
					return
				}
			}
			t.Fatalf("no warning names {env.%s}, which expands to nothing; the log:\n%s", unset, log)
		})
	}
}

// A reload that changes only where Caddy logs keeps the Redis connection
// (the same settings share one), and the store's lines follow the running
// config's log: the breaker opening after the reload is logged where the
// new config says, not to the old config's file, which the reload closed.
func TestRedisStoreLinesGoToTheRunningConfigsLogAfterAReload(t *testing.T) {
	srv := startRedis(t)
	dir := t.TempDir()
	port := freePort(t)
	conf := func(logFile string) string {
		return fmt.Sprintf(`{
	admin off
	log {
		output file %s
		format json
	}
}
http://127.0.0.1:%d {
	rate_limit 100 10/s {
		name reload_log
		store redis {
			address %s
		}
		on_store_error allow
	}
	respond "ok"
}`, logFile, port, srv.url())
	}
	before, after := filepath.Join(dir, "before.log"), filepath.Join(dir, "after.log")
	s := serveCaddyfile(t, port, conf(before))
	if r := s.get("/"); r.status != 200 {
		t.Fatalf("first request: %d", r.status)
	}
	cfg, err := adaptCaddyfile(conf(after))
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatal(err)
	}
	srv.kill()
	for range 20 {
		s.get("/")
	}
	data, _ := os.ReadFile(after)
	if !strings.Contains(string(data), "circuit breaker open") {
		old, _ := os.ReadFile(before)
		t.Errorf("the running config's log has no \"circuit breaker open\" line after Redis died:\n%s\nthe log the reload replaced:\n%s", data, old)
	}
}

// A Cluster given by one address, whose node did not answer while the
// store connected (Caddy started before Redis): the first MOVED must make
// the store follow the Cluster, whatever call hears it. A tier of a rate
// limit hears it from the bucket script; a tier of concurrency alone calls
// only the slots script. Either way, clients with nothing in flight and
// tokens left are decided by Redis, not refused as a store failure.
func TestATierFollowsAClusterGivenByOneAddressThatWasDownAtStart(t *testing.T) {
	skipUnderShort(t, "Redis Cluster of three")
	nodes := startCluster(t, 3)
	for i, tier := range []string{"limit 5 1/h", "concurrency 1"} {
		t.Run(tier, func(t *testing.T) {
			proxy := startFaultProxy(t, nodes[0].addr(), 0)
			proxy.cut()
			s := serve(t, fmt.Sprintf(`rate_limit {
		name cluster_follow_%d
		key header X-Key
		%s
		store redis {
			address redis://%s
			timeout 500ms
			breaker_failures 1000
		}
		on_store_error deny
	}
	respond "ok"`, i, tier, proxy.addr()))
			// The store's first look at the node, at connect, has failed.
			time.Sleep(500 * time.Millisecond)
			proxy.restore()
			failed := 0
			for c := range 40 {
				if r := s.get("/", "X-Key: client-"+strconv.Itoa(c)); r.status != 200 {
					failed++
				}
			}
			if failed > 0 {
				t.Errorf("%d of 40 clients with nothing in flight were refused or failed; want every one decided by the Cluster", failed)
			}
		})
	}
}

// A request on the Redis store with leases is decided by its bucket's id
// only from a lease this node still holds: not from one an admin reset
// dropped (RedisStore.reset, and forgetHere on another copy of the
// policy), after which the next request reports the refilled bucket as a
// first request does; and never for a cost the lease size does not
// exceed, which strict mode decides in the shared bucket.
func TestALeasedRequestIsDecidedByIDOnlyFromALeaseStillHeld(t *testing.T) {
	t.Parallel()
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}, Timeout: caddy.Duration(5 * time.Second), Lease: "4"})
	l := slowLimit(20)
	tr := bucket.Tier{Limits: []bucket.Limit{l}}
	b := bucketFor("decided-by-id")
	id := localID(b)
	out := make([]bucket.Result, 1)
	// heldByID takes requests until the lease holds 2 tokens (its
	// prefetches land in the background), then one is decided by id.
	heldByID := func() {
		t.Helper()
		waitFor(t, 5*time.Second, "a lease of 2 tokens or more", func() bool {
			if s.engine.Held(s.key(nil, b)) >= 2 {
				return true
			}
			if res, err := takeLimit(bg, s, b, l, 1); err != nil || !res.Allowed {
				t.Fatalf("take: %+v, %v", res, err)
			}
			return false
		})
		if _, ok := s.engine.TakeHeld(id, tr, 1, out); !ok {
			t.Fatal("a request the lease covers was not decided by id")
		}
	}
	for _, drop := range []struct {
		name string
		do   func() error
	}{
		{"reset", func() error { return s.reset(bg, b) }},
		{"forgetHere", func() error { s.forgetHere(b); return nil }},
	} {
		heldByID()
		held := s.engine.Held(s.key(nil, b))
		if _, ok := s.engine.TakeHeld(id, tr, 4, out); ok {
			t.Fatalf("%s: a request of cost 4, the lease size, was decided by id from %d tokens held", drop.name, held)
		}
		if err := drop.do(); err != nil {
			t.Fatal(err)
		}
		if _, ok := s.engine.TakeHeld(id, tr, 1, out); ok {
			t.Fatalf("after %s: a request was decided by id from the lease it dropped", drop.name)
		}
		if drop.name == "reset" {
			res, err := takeLimit(bg, s, b, l, 1)
			if err != nil || !res.Allowed || res.Remaining != l.Capacity-1 {
				t.Fatalf("after reset: %+v, %v; want allowed with %d left, as a first request", res, err, l.Capacity-1)
			}
		}
	}
}
