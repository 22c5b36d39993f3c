package ratelimit

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"

	"go.uber.org/zap"
)

// Tests that need Redis start real redis-server processes on free loopback
// ports, each with its own temporary directory and no persistence.

// needRedis returns the redis-server binary, or skips the test without one
// (and fails it in CI, where it must be installed).
func needRedis(t testing.TB) string {
	t.Helper()
	path, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server is not installed: %v", err)
		}
		t.Skipf("redis-server is not installed: %v", err)
	}
	return path
}

// redisServer is one redis-server process that a test started.
type redisServer struct {
	t    testing.TB
	bin  string
	port int
	dir  string
	args []string    // the arguments after the config file
	conf string      // a config file to start from, or ""
	tls  *tls.Config // how to reach it, when it speaks only TLS
	cmd  *exec.Cmd
	exit chan struct{}
}

// startRedis starts a redis-server on a free port with extra arguments.
func startRedis(t testing.TB, extra ...string) *redisServer {
	t.Helper()
	return startRedisOn(t, freePort(t), extra...)
}

func startRedisOn(t testing.TB, port int, extra ...string) *redisServer {
	t.Helper()
	r := &redisServer{t: t, bin: needRedis(t), port: port, dir: t.TempDir()}
	r.args = append([]string{
		"--bind", "127.0.0.1", "--port", strconv.Itoa(port),
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--logfile", filepath.Join(r.dir, "redis.log"),
	}, extra...)
	r.start()
	t.Cleanup(r.kill)
	return r
}

// start runs the process and waits until it answers PING.
func (r *redisServer) start() {
	r.t.Helper()
	var args []string
	if r.conf != "" {
		args = append(args, r.conf)
	}
	args = append(args, r.args...)
	r.cmd = exec.Command(r.bin, args...)
	if err := r.cmd.Start(); err != nil {
		r.t.Fatalf("starting redis-server: %v", err)
	}
	r.exit = make(chan struct{})
	go func(cmd *exec.Cmd, exit chan struct{}) {
		_ = cmd.Wait()
		close(exit)
	}(r.cmd, r.exit)
	c := r.client()
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return
		}
		select {
		case <-r.exit:
			log, _ := os.ReadFile(filepath.Join(r.dir, "redis.log"))
			r.t.Fatalf("redis-server on port %d exited: %v\n%s", r.port, err, log)
		default:
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("redis-server on port %d did not answer: %v", r.port, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (r *redisServer) addr() string { return "127.0.0.1:" + strconv.Itoa(r.port) }
func (r *redisServer) url() string  { return "redis://" + r.addr() }

// client is a plain client for the test's own looks at the server.
func (r *redisServer) client() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: r.addr(), TLSConfig: r.tls, MaxRetries: -1, DialTimeout: time.Second})
}

// do runs one command and fails the test on an error.
func (r *redisServer) do(args ...any) any {
	r.t.Helper()
	c := r.client()
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	v, err := c.Do(ctx, args...).Result()
	if err != nil && err != redis.Nil {
		r.t.Fatalf("redis %v: %v", args, err)
	}
	return v
}

// info returns one field of INFO, or "" when the server does not answer.
func (r *redisServer) info(section, field string) string {
	c := r.client()
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	text, err := c.Info(ctx, section).Result()
	if err != nil {
		return ""
	}
	for line := range strings.SplitSeq(text, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v
		}
	}
	return ""
}

func (r *redisServer) signal(sig syscall.Signal) {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Signal(sig)
	}
}

// kill ends the process at once, as a crash would.
func (r *redisServer) kill() {
	if r.cmd == nil {
		return
	}
	r.signal(syscall.SIGKILL)
	<-r.exit
	r.cmd = nil
}

// pause freezes the process: connections stay open and nothing answers,
// like a Redis stuck or unreachable behind a silent network.
func (r *redisServer) pause()  { r.signal(syscall.SIGSTOP) }
func (r *redisServer) resume() { r.signal(syscall.SIGCONT) }

// waitFor polls cond until it holds, or fails the test after timeout.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// clusterPort returns a free port whose cluster bus port, 10000 above, is
// free too.
func clusterPort(t testing.TB) int {
	t.Helper()
	for range 100 {
		p := freePort(t)
		if p+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p+10000))
		if err != nil {
			continue
		}
		l.Close()
		return p
	}
	t.Fatal("no free port pair for a cluster node")
	return 0
}

// startCluster makes a Redis Cluster of n masters and no replicas.
func startCluster(t testing.TB, n int) []*redisServer {
	t.Helper()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		needRedis(t)
		t.Skipf("redis-cli is not installed: %v", err)
	}
	var nodes []*redisServer
	args := []string{"--cluster", "create"}
	for range n {
		r := startRedisOn(t, clusterPort(t), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		nodes = append(nodes, r)
		args = append(args, r.addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, r := range nodes {
		waitFor(t, 15*time.Second, "cluster_state:ok on "+r.addr(), func() bool {
			return strings.Contains(r.do("CLUSTER", "INFO").(string), "cluster_state:ok")
		})
	}
	return nodes
}

// sentinelSetup is a master, its replica and one Sentinel watching them.
type sentinelSetup struct {
	name              string
	master, replica   *redisServer
	sentinel          *redisServer
	sentinelAddresses []string
}

func startSentinel(t testing.TB) *sentinelSetup {
	t.Helper()
	s := &sentinelSetup{name: "rlmaster"}
	s.master = startRedis(t, "--repl-diskless-sync-delay", "0")
	s.replica = startRedis(t, "--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", strconv.Itoa(s.master.port))
	waitFor(t, 10*time.Second, "the replica to sync", func() bool {
		return s.replica.info("replication", "master_link_status") == "up"
	})

	port := freePort(t)
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
logfile %s
sentinel monitor %s 127.0.0.1 %d 1
sentinel down-after-milliseconds %s 1000
sentinel failover-timeout %s 5000
`, port, dir, filepath.Join(dir, "sentinel.log"), s.name, s.master.port, s.name, s.name)
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	s.sentinel = &redisServer{t: t, bin: needRedis(t), port: port, dir: dir, conf: conf, args: []string{"--sentinel"}}
	s.sentinel.start()
	t.Cleanup(s.sentinel.kill)
	s.sentinelAddresses = []string{s.sentinel.addr()}
	waitFor(t, 20*time.Second, "the Sentinel to see the replica", func() bool {
		replicas, _ := s.sentinel.do("SENTINEL", "REPLICAS", s.name).([]any)
		return len(replicas) == 1 && !strings.Contains(fmt.Sprint(replicas[0]), "disconnected")
	})
	return s
}

// failover makes the Sentinel promote the replica, and waits until it has.
func (s *sentinelSetup) failover(t testing.TB) {
	t.Helper()
	waitFor(t, 20*time.Second, "SENTINEL FAILOVER to be accepted", func() bool {
		c := s.sentinel.client()
		defer c.Close()
		return c.Do(context.Background(), "SENTINEL", "FAILOVER", s.name).Err() == nil
	})
	waitFor(t, 20*time.Second, "the replica to become master", func() bool {
		addr, _ := s.sentinel.do("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.name).([]any)
		return len(addr) == 2 && addr[1] == strconv.Itoa(s.replica.port) &&
			s.replica.info("replication", "role") == "master"
	})
	// Until the old master is turned into a replica, it still takes
	// writes, which its resync then drops. The Sentinel would do this on
	// its next look at it, up to 10 s away; the test does it now.
	s.master.do("REPLICAOF", "127.0.0.1", strconv.Itoa(s.replica.port))
	waitFor(t, 20*time.Second, "the old master to become a replica", func() bool {
		return s.master.info("replication", "role") == "slave"
	})
	s.master, s.replica = s.replica, s.master
}

// testCA is a certificate authority and a server certificate for
// 127.0.0.1, made for one test.
type testCA struct {
	caFile, certFile, keyFile string
	pool                      *x509.CertPool
}

func newTestCA(t testing.TB) *testCA {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "caddy-ratelimit test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "127.0.0.1"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:     []string{"localhost"},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	ca := &testCA{
		caFile:   filepath.Join(dir, "ca.pem"),
		certFile: filepath.Join(dir, "cert.pem"),
		keyFile:  filepath.Join(dir, "key.pem"),
		pool:     x509.NewCertPool(),
	}
	ca.pool.AddCert(caCert)
	write := func(path, typ string, der []byte) {
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(ca.caFile, "CERTIFICATE", caDER)
	write(ca.certFile, "CERTIFICATE", der)
	write(ca.keyFile, "EC PRIVATE KEY", keyDER)
	return ca
}

// startTLSRedis starts a redis-server that speaks only TLS, with a
// certificate from ca.
func startTLSRedis(t testing.TB, ca *testCA) *redisServer {
	t.Helper()
	port := freePort(t)
	r := &redisServer{t: t, bin: needRedis(t), port: port, dir: t.TempDir(),
		tls: &tls.Config{RootCAs: ca.pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}}
	r.args = []string{
		"--bind", "127.0.0.1", "--port", "0", "--tls-port", strconv.Itoa(port),
		"--tls-cert-file", ca.certFile, "--tls-key-file", ca.keyFile,
		"--tls-ca-cert-file", ca.caFile, "--tls-auth-clients", "no",
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--logfile", filepath.Join(r.dir, "redis.log"),
	}
	r.start()
	t.Cleanup(r.kill)
	return r
}

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

// newPrivateRedisStore provisions a store with a client of its own, outside
// the pool: two of them stand for two Caddy nodes.
func newPrivateRedisStore(t testing.TB, s *RedisStore) *RedisStore {
	t.Helper()
	cfg, err := s.settings()
	if err != nil {
		t.Fatal(err)
	}
	s.conn = newRedisConn(cfg, zap.NewNop())
	t.Cleanup(func() { _ = s.conn.Destruct() })
	return s
}

// serveOnRedis serves a policy of 3 requests an hour on the Redis server,
// with the given timeout and on_store_error mode, and waits until the store
// has loaded its script, so that the first request does not race the cold
// start.
func serveOnRedis(t *testing.T, srv *redisServer, timeout time.Duration, mode string) *testServer {
	t.Helper()
	s := serve(t, fmt.Sprintf(`
	rate_limit 3 1/h {
		store redis {
			address %s
			timeout %s
		}
		on_store_error %s
	}
	respond "ok"`, srv.url(), timeout, mode))
	waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
		v, _ := srv.do("SCRIPT", "EXISTS", bucketScript.Hash()).([]any)
		return len(v) == 1 && v[0] == int64(1)
	})
	return s
}
