package ratelimit

import (
	"fmt"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"

	"go.uber.org/zap"
)

// Tests that need Redis start real redis-server processes through
// internal/redistest; these wrap them in the names the tests here use.

// redisServer is one redis-server process that a test started.
type redisServer struct{ *redistest.Server }

func startRedis(t testing.TB, extra ...string) *redisServer {
	t.Helper()
	return &redisServer{redistest.Start(t, extra...)}
}

func startRedisOn(t testing.TB, port int, extra ...string) *redisServer {
	t.Helper()
	return &redisServer{redistest.StartOn(t, port, extra...)}
}

func clusterPort(t testing.TB) int { return redistest.ClusterPort(t) }

func (r *redisServer) start()                { r.Restart() }
func (r *redisServer) addr() string          { return r.Addr() }
func (r *redisServer) url() string           { return r.URL() }
func (r *redisServer) client() *redis.Client { return r.Client() }
func (r *redisServer) do(args ...any) any    { return r.Do(args...) }
func (r *redisServer) info(section, field string) string {
	return r.Info(section, field)
}
func (r *redisServer) kill()  { r.Kill() }
func (r *redisServer) pause() { r.Pause() }

// waitFor polls cond until it holds, or fails the test after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	redistest.WaitFor(t, timeout, what, cond)
}

// startCluster makes a Redis Cluster of n masters and no replicas.
func startCluster(t testing.TB, n int) []*redisServer {
	t.Helper()
	var nodes []*redisServer
	for _, s := range redistest.StartCluster(t, n) {
		nodes = append(nodes, &redisServer{s})
	}
	return nodes
}

// sentinelSetup is a master, its replica and one Sentinel watching them.
type sentinelSetup struct {
	*redistest.Sentinel
	name              string
	master            *redisServer
	sentinelAddresses []string
}

func startSentinel(t testing.TB) *sentinelSetup {
	t.Helper()
	s := redistest.StartSentinel(t)
	return &sentinelSetup{Sentinel: s, name: s.Name, master: &redisServer{s.Master}, sentinelAddresses: s.Addresses}
}

// failover makes the Sentinel promote the replica, and waits until it has.
func (s *sentinelSetup) failover(t testing.TB) {
	t.Helper()
	s.Failover(t)
	s.master = &redisServer{s.Master}
}

func startTLSRedis(t testing.TB, ca *redistest.CA) *redisServer {
	t.Helper()
	return &redisServer{redistest.StartTLS(t, ca)}
}

// faultProxy stands between a client and a redis-server, and delays,
// silences or cuts the link (redistest.Proxy).
type faultProxy struct{ *redistest.Proxy }

func startFaultProxy(t testing.TB, target string, delay time.Duration) *faultProxy {
	t.Helper()
	return &faultProxy{redistest.StartProxy(t, target, delay)}
}

func (p *faultProxy) addr() string { return p.Addr() }
func (p *faultProxy) blackhole()   { p.Blackhole() }
func (p *faultProxy) restore()     { p.Restore() }
func (p *faultProxy) cut()         { p.Cut() }

// newRedisStoreFor provisions a store from its JSON-shaped settings, through
// the pool as Caddy would, and releases it when the test ends.
func newRedisStoreFor(t testing.TB, s *RedisStore) *RedisStore {
	t.Helper()
	if err := s.Provision(caddy.Context{}); err != nil {
		t.Fatalf("provisioning the Redis store: %v", err)
	}
	t.Cleanup(func() { _ = s.Cleanup() })
	return s
}

// newPrivateRedisStore provisions a store with a connection of its own,
// outside the pool: two of them stand for two Caddy nodes.
func newPrivateRedisStore(t testing.TB, s *RedisStore) *RedisStore {
	t.Helper()
	opts, view, err := s.options()
	if err != nil {
		t.Fatal(err)
	}
	plan, err := redisbucket.NewPlan(opts)
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(zap.NewNop())
	s.engine = redisbucket.NewStore(conn, view)
	t.Cleanup(func() {
		s.engine.Close()
		_ = conn.Close()
	})
	return s
}

// keyOf is the bucket's Redis key.
func (s *RedisStore) keyOf(b *Bucket) string { return string(s.key(nil, b)) }

// serveOnRedis serves a policy of 3 requests an hour on the Redis server,
// with the given timeout and on_store_error mode, and waits until the store
// has loaded its script, so that the first request does not race the cold
// start.
func serveOnRedis(t *testing.T, srv *redisServer, timeout time.Duration, mode string) *testServer {
	t.Helper()
	return serveOnRedisWith(t, srv, fmt.Sprintf(`
	rate_limit 3 1/h {
		store redis {
			address %s
			timeout %s
		}
		on_store_error %s
	}
	respond "ok"`, srv.url(), timeout, mode))
}

// serveOnRedisWith serves directives whose store is the Redis server, and
// waits until the store has loaded its script.
func serveOnRedisWith(t *testing.T, srv *redisServer, directives string) *testServer {
	t.Helper()
	s := serve(t, directives)
	waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
		v, _ := srv.do("SCRIPT", "EXISTS", redisbucket.ScriptHash()).([]any)
		return len(v) == 1 && v[0] == int64(1)
	})
	return s
}
