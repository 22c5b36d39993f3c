package ratelimit

import (
	"bufio"
	"fmt"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
)

// TestRedisBreakerClosesAfterClientsHangUpDuringAnOutage runs a real
// config whose Redis link goes silent (a black hole: connections are
// accepted, nothing comes back) and whose clients hang up right after
// sending, so that the probes after each cool-down are cancelled. Once the
// link is back, decisions must reach Redis again within a few cool-downs,
// as Redis itself shows: new buckets appear in it.
func TestRedisBreakerClosesAfterClientsHangUpDuringAnOutage(t *testing.T) {
	skipUnderShort(t, "fault injection (a black-holed Redis link)")
	const timeout, cooldown = 300 * time.Millisecond, 300 * time.Millisecond
	srv := startRedis(t)
	proxy := startFaultProxy(t, srv.addr(), 0)
	s := serve(t, fmt.Sprintf(`
	rate_limit 100 1/h {
		store redis {
			address redis://%s
			timeout %s
			breaker_failures 2
			breaker_cooldown %s
		}
	}
	respond "ok"`, proxy.addr(), timeout, cooldown))
	waitFor(t, 5*time.Second, "the script to be loaded", func() bool {
		v, _ := srv.do("SCRIPT", "EXISTS", redisbucket.ScriptHash()).([]any)
		return len(v) == 1 && v[0] == int64(1)
	})
	c := trafficClient(5 * time.Second)
	if got := getFrom(c, s.base, "127.0.9.1"); got != 200 {
		t.Fatalf("before the outage: status %d", got)
	}
	if n := srv.do("DBSIZE").(int64); n != 1 {
		t.Fatalf("before the outage Redis holds %d buckets, want 1", n)
	}

	proxy.blackhole()
	for i := range 2 { // each waits for the timeout; the local fallback answers
		if got := getFrom(c, s.base, "127.0.9."+strconv.Itoa(10+i)); got != 200 {
			t.Fatalf("during the outage: status %d, want 200 from the local fallback", got)
		}
	}
	start := time.Now()
	getFrom(c, s.base, "127.0.9.20")
	if d := time.Since(start); d > timeout/2 {
		t.Fatalf("a request after two timeouts took %s: the breaker did not open", d)
	}

	// For six cool-downs only clients that hang up right after sending,
	// four at a time: the first request after each cool-down is the probe,
	// and its client is gone before Redis could answer.
	end := time.Now().Add(6 * cooldown)
	for i := 0; time.Now().Before(end); i++ {
		for j := range 4 {
			hangUp(t, s.port, "127.0.10."+strconv.Itoa((4*i+j)%250+1))
		}
		time.Sleep(10 * time.Millisecond)
	}

	proxy.restore()
	before := srv.do("DBSIZE").(int64)
	deadline := time.Now().Add(5 * cooldown)
	for i := 0; ; i++ {
		getFrom(c, s.base, "127.0.11."+strconv.Itoa(i%250+1))
		if srv.do("DBSIZE").(int64) > before {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("link restored %s ago, Redis up: no decision reached Redis (DBSIZE still %d, %s)",
				5*cooldown, before, srv.info("commandstats", "cmdstat_evalsha"))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// hangUp sends one request as ip and closes the connection without
// reading the answer, as a client that gives up does.
func hangUp(t *testing.T, port int, ip string) {
	t.Helper()
	conn, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		t.Fatal(err)
	}
	w := bufio.NewWriter(conn)
	fmt.Fprintf(w, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Forwarded-For: %s\r\n\r\n", ip)
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	conn.Close()
}
