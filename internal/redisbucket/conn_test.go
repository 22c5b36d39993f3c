package redisbucket

import (
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestOneClusterAddressIsFollowedAsACluster gives the store one node of a
// three-master Cluster, as a single address: every decision must be
// Redis's, including those on keys that other masters own, which the node
// answers MOVED for.
// Regression test for issue 31 item 9.
func TestOneClusterAddressIsFollowedAsACluster(t *testing.T) {
	skipUnderShort(t, "Redis Cluster of three")
	nodes := redistest.StartCluster(t, 3)
	s := newTestStore(t, testConfig{Addresses: []string{nodes[0].URL()}, Timeout: 2 * time.Second, BreakerFailures: 1000})
	const clients = 40
	failed := 0
	for c := range clients {
		res, err := s.takeLimit(bg, bucketFor("10.0.1."+strconv.Itoa(c)), slowLimit(3), 1)
		if err != nil || !res.Allowed {
			failed++
			t.Logf("client %d: %+v, %v", c, res, err)
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d decisions failed or were refused on a Cluster given by one address; want all decided by Redis", failed, clients)
	}
	for _, n := range nodes {
		if n.Do("DBSIZE").(int64) == 0 {
			t.Errorf("master %s holds no bucket: the decisions did not follow the Cluster", n.Addr())
		}
	}
}

// TestGoRedisLinesGoThroughTheConnectionsLogger makes go-redis fail to
// dial: its line reaches the connection's logger, not stderr as plain text.
// Regression test for issue 31 item 12.
func TestGoRedisLinesGoThroughTheConnectionsLogger(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	plan, err := NewPlan(Options{Addresses: []string{"redis://127.0.0.1:" + strconv.Itoa(redistest.FreePort(t))}})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(zap.New(core))
	defer conn.Close()
	s := NewStore(conn, StoreOptions{})
	if _, err := s.takeLimit(bg, bucketFor("x"), slowLimit(1), 1); err == nil {
		t.Fatal("take with nothing listening: no error")
	}
	redistest.WaitFor(t, 2*time.Second, "go-redis's line about the dial", func() bool {
		for _, e := range logs.All() {
			if said, _ := e.ContextMap()["said"].(string); strings.Contains(said, "dial") {
				return true
			}
		}
		return false
	})
}

// TestSentinelFailoverEndsTheBreakersHold kills the master under traffic:
// the breaker opens, Sentinel promotes the replica, and the store must
// decide by Redis again soon after the promotion, not at the end of a
// breaker_cooldown far longer than it.
// Regression test for issue 31 item 10.
func TestSentinelFailoverEndsTheBreakersHold(t *testing.T) {
	skipUnderShort(t, "Sentinel failover")
	st := redistest.StartSentinel(t)
	const cooldown = 6 * time.Second
	core, logs := observer.New(zapcore.InfoLevel)
	plan, err := NewPlan(Options{Sentinel: &Sentinel{Master: st.Name, Addresses: st.Addresses},
		Timeout: 200 * time.Millisecond, BreakerFailures: 2, BreakerCooldown: cooldown})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(zap.New(core))
	defer conn.Close()
	s := NewStore(conn, StoreOptions{})
	redistest.WaitFor(t, 5*time.Second, "a decision by the master", func() bool {
		_, err := s.takeLimit(bg, bucketFor("before"), slowLimit(1000), 1)
		return err == nil
	})

	var opened atomic.Bool
	answered := make(chan time.Time, 1)
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			_, err := s.takeLimit(bg, bucketFor("during"+strconv.Itoa(i)), slowLimit(1000), 1)
			if err != nil && conn.breaker.open() {
				opened.Store(true)
			}
			if err == nil && opened.Load() {
				answered <- time.Now()
				return
			}
		}
	}()
	st.Master.Kill()
	redistest.WaitFor(t, 20*time.Second, "the Sentinel to promote the replica", func() bool {
		addr, _ := st.Sentinel.Do("SENTINEL", "GET-MASTER-ADDR-BY-NAME", st.Name).([]any)
		return len(addr) == 2 && addr[1] == strconv.Itoa(st.Replica.Port)
	})
	promoted := time.Now()
	select {
	case at := <-answered:
		if d := at.Sub(promoted); d > cooldown/4 {
			t.Fatalf("first decision by Redis %s after the promotion; want well under breaker_cooldown %s", d.Round(time.Millisecond), cooldown)
		}
	case <-time.After(cooldown + 5*time.Second):
		t.Fatalf("no decision by Redis within %s of the promotion (breaker opened: %v)", cooldown+5*time.Second, opened.Load())
	}
	if got := conn.Master(); got != st.Replica.Addr() {
		t.Errorf("the master in use is %q, want the promoted replica %s", got, st.Replica.Addr())
	}
	switched := logs.FilterMessageSnippet("new master").All()
	if len(switched) == 0 || switched[0].Level != zapcore.WarnLevel || switched[0].ContextMap()["master"] != st.Replica.Addr() {
		t.Errorf("the switch was logged as %v; want one warn line naming the new master %s", switched, st.Replica.Addr())
	}
}
