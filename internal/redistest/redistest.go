// Package redistest starts real redis-server processes for tests, on free
// loopback ports, each in a temporary directory and without persistence:
// one node, a Cluster, a Sentinel with its master and replica, a server that
// speaks only TLS, and a proxy that delays, silences or cuts the link. A
// test that needs Redis fails, rather than skips, when CI is "true".
package redistest

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
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// FreePort returns a TCP port on 127.0.0.1 that was free a moment ago.
//
// A port is handed out once a process: the kernel may give a port again as
// soon as it is free, and a test that asks for two (an admin endpoint and a
// site) would then bind both to one port, where Caddy's listeners, which
// share ports for graceful reloads, both accept.
func FreePort(t testing.TB) int {
	t.Helper()
	for range 100 {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		if _, taken := handedOut.LoadOrStore(port, true); !taken {
			return port
		}
	}
	t.Fatal("no free port that was not handed out already")
	return 0
}

// handedOut holds the ports FreePort has handed out.
var handedOut sync.Map

// Tests that need Redis start real redis-server processes on free loopback
// ports, each with its own temporary directory and no persistence.

// need returns the redis-server binary, or skips the test without one
// (and fails it in CI, where it must be installed).
func need(t testing.TB) string {
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

// Server is one redis-server process that a test started.
type Server struct {
	t    testing.TB
	bin  string
	Port int
	dir  string
	args []string    // the arguments after the config file
	conf string      // a config file to start from, or ""
	tls  *tls.Config // how to reach it, when it speaks only TLS
	cmd  *exec.Cmd
	exit chan struct{}
}

// startRedis starts a redis-server on a free port with extra arguments.
func Start(t testing.TB, extra ...string) *Server {
	t.Helper()
	return StartOn(t, FreePort(t), extra...)
}

func StartOn(t testing.TB, port int, extra ...string) *Server {
	t.Helper()
	r := &Server{t: t, bin: need(t), Port: port, dir: t.TempDir()}
	r.args = append([]string{
		"--bind", "127.0.0.1", "--port", strconv.Itoa(port),
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--logfile", filepath.Join(r.dir, "redis.log"),
	}, extra...)
	r.start()
	t.Cleanup(r.Kill)
	return r
}

// start runs the process and waits until it answers PING.
func (r *Server) start() {
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
	deadline := time.Now().Add(10 * time.Second)
	// First the port, polled by plain dials: a client whose first dials
	// were refused waits about 100 ms more before it answers.
	r.poll(deadline, "listen", 2*time.Millisecond, func() error {
		conn, err := net.DialTimeout("tcp", r.Addr(), 200*time.Millisecond)
		if err == nil {
			conn.Close()
		}
		return err
	})
	c := r.Client()
	defer c.Close()
	r.poll(deadline, "answer", 20*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		return c.Ping(ctx).Err()
	})
}

// poll calls try every pause until it succeeds, and fails the test when
// the server exits first or the deadline passes: it did not do what.
func (r *Server) poll(deadline time.Time, what string, pause time.Duration, try func() error) {
	for {
		err := try()
		if err == nil {
			return
		}
		select {
		case <-r.exit:
			r.t.Fatalf("redis-server on port %d exited: %v\n%s", r.Port, err, r.Log())
		default:
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("redis-server on port %d did not %s: %v", r.Port, what, err)
		}
		time.Sleep(pause)
	}
}

// Log is what the server wrote to its log file.
func (r *Server) Log() []byte {
	log, _ := os.ReadFile(filepath.Join(r.dir, "redis.log"))
	return log
}

// Restart starts the process again after Kill, on the same port, empty.
func (r *Server) Restart() { r.start() }

// Addr is the server's host:port, and URL its redis:// address.
func (r *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(r.Port) }
func (r *Server) URL() string  { return "redis://" + r.Addr() }

// client is a plain client for the test's own looks at the server.
func (r *Server) Client() *redis.Client {
	return redis.NewClient(&redis.Options{Addr: r.Addr(), TLSConfig: r.tls, MaxRetries: -1, DialTimeout: time.Second, DisableIdentity: true, MaintNotificationsConfig: &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}})
}

// do runs one command and fails the test on an error.
func (r *Server) Do(args ...any) any {
	r.t.Helper()
	c := r.Client()
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
func (r *Server) Info(section, field string) string {
	c := r.Client()
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

func (r *Server) signal(sig syscall.Signal) {
	if r.cmd != nil && r.cmd.Process != nil {
		_ = r.cmd.Process.Signal(sig)
	}
}

// kill ends the process at once, as a crash would.
func (r *Server) Kill() {
	if r.cmd == nil {
		return
	}
	r.signal(syscall.SIGKILL)
	<-r.exit
	r.cmd = nil
}

// pause freezes the process: connections stay open and nothing answers,
// like a Redis stuck or unreachable behind a silent network.
func (r *Server) Pause()  { r.signal(syscall.SIGSTOP) }
func (r *Server) Resume() { r.signal(syscall.SIGCONT) }

// waitFor polls cond until it holds, or fails the test after timeout.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ClusterPort returns a free port whose cluster bus port, 10000 above, is
// free too.
func ClusterPort(t testing.TB) int {
	t.Helper()
	for range 100 {
		p := FreePort(t)
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
func StartCluster(t testing.TB, n int) []*Server {
	t.Helper()
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		need(t)
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-cli is not installed: %v", err)
		}
		t.Skipf("redis-cli is not installed: %v", err)
	}
	var nodes []*Server
	args := []string{"--cluster", "create"}
	for range n {
		r := StartOn(t, ClusterPort(t), "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000")
		nodes = append(nodes, r)
		args = append(args, r.Addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, r := range nodes {
		WaitFor(t, 15*time.Second, "cluster_state:ok on "+r.Addr(), func() bool {
			return strings.Contains(r.Do("CLUSTER", "INFO").(string), "cluster_state:ok")
		})
	}
	return nodes
}

// sentinelSetup is a master, its replica and one Sentinel watching them.
type Sentinel struct {
	Name            string
	Master, Replica *Server
	Sentinel        *Server
	Addresses       []string
}

func StartSentinel(t testing.TB) *Sentinel {
	t.Helper()
	s := &Sentinel{Name: "rlmaster"}
	s.Master = Start(t, "--repl-diskless-sync-delay", "0")
	s.Replica = Start(t, "--repl-diskless-sync-delay", "0", "--replicaof", "127.0.0.1", strconv.Itoa(s.Master.Port))
	WaitFor(t, 10*time.Second, "the replica to sync", func() bool {
		return s.Replica.Info("replication", "master_link_status") == "up"
	})

	port := FreePort(t)
	dir := t.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	text := fmt.Sprintf(`port %d
bind 127.0.0.1
dir %s
logfile %s
sentinel monitor %s 127.0.0.1 %d 1
sentinel down-after-milliseconds %s 1000
sentinel failover-timeout %s 5000
`, port, dir, filepath.Join(dir, "sentinel.log"), s.Name, s.Master.Port, s.Name, s.Name)
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	s.Sentinel = &Server{t: t, bin: need(t), Port: port, dir: dir, conf: conf, args: []string{"--sentinel"}}
	s.Sentinel.start()
	t.Cleanup(s.Sentinel.Kill)
	s.Addresses = []string{s.Sentinel.Addr()}
	WaitFor(t, 20*time.Second, "the Sentinel to see the replica", func() bool {
		replicas, _ := s.Sentinel.Do("SENTINEL", "REPLICAS", s.Name).([]any)
		return len(replicas) == 1 && !strings.Contains(fmt.Sprint(replicas[0]), "disconnected")
	})
	return s
}

// failover makes the Sentinel promote the replica, and waits until it has.
func (s *Sentinel) Failover(t testing.TB) {
	t.Helper()
	WaitFor(t, 20*time.Second, "SENTINEL FAILOVER to be accepted", func() bool {
		c := s.Sentinel.Client()
		defer c.Close()
		return c.Do(context.Background(), "SENTINEL", "FAILOVER", s.Name).Err() == nil
	})
	WaitFor(t, 20*time.Second, "the replica to become master", func() bool {
		addr, _ := s.Sentinel.Do("SENTINEL", "GET-MASTER-ADDR-BY-NAME", s.Name).([]any)
		return len(addr) == 2 && addr[1] == strconv.Itoa(s.Replica.Port) &&
			s.Replica.Info("replication", "role") == "master"
	})
	// Until the old master is turned into a replica, it still takes
	// writes, which its resync then drops. The Sentinel would do this on
	// its next look at it, up to 10 s away; the test does it now.
	s.Master.Do("REPLICAOF", "127.0.0.1", strconv.Itoa(s.Replica.Port))
	WaitFor(t, 20*time.Second, "the old master to become a replica", func() bool {
		return s.Master.Info("replication", "role") == "slave"
	})
	s.Master, s.Replica = s.Replica, s.Master
}

// testCA is a certificate authority and a server certificate for
// 127.0.0.1, made for one test.
type CA struct {
	CAFile, CertFile, KeyFile string
	Pool                      *x509.CertPool
}

func NewCA(t testing.TB) *CA {
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
	ca := &CA{
		CAFile:   filepath.Join(dir, "ca.pem"),
		CertFile: filepath.Join(dir, "cert.pem"),
		KeyFile:  filepath.Join(dir, "key.pem"),
		Pool:     x509.NewCertPool(),
	}
	ca.Pool.AddCert(caCert)
	write := func(path, typ string, der []byte) {
		if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(ca.CAFile, "CERTIFICATE", caDER)
	write(ca.CertFile, "CERTIFICATE", der)
	write(ca.KeyFile, "EC PRIVATE KEY", keyDER)
	return ca
}

// startTLSRedis starts a redis-server that speaks only TLS, with a
// certificate from ca.
func StartTLS(t testing.TB, ca *CA) *Server {
	t.Helper()
	port := FreePort(t)
	r := &Server{t: t, bin: need(t), Port: port, dir: t.TempDir(),
		tls: &tls.Config{RootCAs: ca.Pool, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}}
	r.args = []string{
		"--bind", "127.0.0.1", "--port", "0", "--tls-port", strconv.Itoa(port),
		"--tls-cert-file", ca.CertFile, "--tls-key-file", ca.KeyFile,
		"--tls-ca-cert-file", ca.CAFile, "--tls-auth-clients", "no",
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--logfile", filepath.Join(r.dir, "redis.log"),
	}
	r.start()
	t.Cleanup(r.Kill)
	return r
}
