package ratelimit

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// buildCaddy builds cmd/caddy, standard Caddy with this plugin, once per
// test binary.
var buildCaddy = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "caddy-ratelimit-bin")
	if err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "caddy")
	out, err := exec.Command("go", "build", "-o", bin, "./cmd/caddy").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
	}
	return bin, nil
})

// startCaddyProcess runs the built Caddy with a Caddyfile until the test
// ends, and waits until it answers on port. It returns the process, for a
// test that kills it first.
func startCaddyProcess(t *testing.T, port int, caddyfile string) *os.Process {
	t.Helper()
	bin, err := buildCaddy()
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(caddyfile), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", file, "--adapter", "caddyfile")
	cmd.Env = append(os.Environ(), "HOME="+t.TempDir())
	logs := &lockedBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("Caddy on port %d said:\n%s", port, logs.String())
		}
	})
	waitFor(t, 30*time.Second, fmt.Sprintf("Caddy on port %d", port), func() bool {
		resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/ready", port))
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	return cmd.Process
}

type lockedBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	return len(p), nil
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// TestTwoCaddyProcessesShareOneRedisLimit runs two real Caddy processes
// against one redis-server: a concurrent burst of 200 requests for one
// client, split across them, gets exactly the limit of 20.
func TestTwoCaddyProcessesShareOneRedisLimit(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "real-process (two Caddy processes, one Redis)")
	srv := startRedis(t)
	var ports []int
	for range 2 {
		port := freePort(t)
		ports = append(ports, port)
		startCaddyProcess(t, port, fmt.Sprintf(`{
	admin off
}
http://127.0.0.1:%d {
	handle /ready {
		respond "ready"
	}
	rate_limit 20 1/h {
		name fleet
		key header X-API-Key
		store redis {
			address %s
			timeout 2s
		}
	}
	respond "ok"
}
`, port, srv.url()))
	}

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 100}}
	var allowed, denied, other atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 200 {
		port := ports[i%2]
		wg.Go(func() {
			<-start
			req, _ := http.NewRequest("GET", fmt.Sprintf("http://127.0.0.1:%d/", port), nil)
			req.Header.Set("X-API-Key", "one-client")
			resp, err := client.Do(req)
			if err != nil {
				other.Add(1)
				return
			}
			resp.Body.Close()
			switch resp.StatusCode {
			case 200:
				allowed.Add(1)
			case 429:
				denied.Add(1)
			default:
				other.Add(1)
			}
		})
	}
	close(start)
	wg.Wait()
	if allowed.Load() != 20 || denied.Load() != 180 || other.Load() != 0 {
		t.Fatalf("200 concurrent requests over two Caddy processes: %d allowed, %d denied, %d other; want exactly 20 and 180", allowed.Load(), denied.Load(), other.Load())
	}
}
