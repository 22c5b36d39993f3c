package redisbucket

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
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
	t.Parallel()
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
	t.Parallel()
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
	t.Parallel()
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

// Every call to Redis follows a Cluster given by one address whose node
// did not answer at connect, whichever call first hears MOVED: the slots
// script, a reset, a give-back and a free, as the bucket script does. A
// MOVED that cannot be followed is an answer, not a failure: the breaker,
// opened here by one failure, stays closed.
func TestEveryCallFollowsAClusterGivenByOneAddress(t *testing.T) {
	t.Parallel()
	skipUnderShort(t, "Redis Cluster of three")
	nodes := redistest.StartCluster(t, 3)
	// A client whose bucket and slots both live on another node than the
	// one given, so that it answers MOVED for both.
	var key []byte
	for c := 0; key == nil; c++ {
		k := bucketFor("elsewhere-" + strconv.Itoa(c))
		_, movedB := redis.IsMovedError(nodes[0].Client().Exists(bg, string(k)).Err())
		_, movedS := redis.IsMovedError(nodes[0].Client().Exists(bg, slotKey(k)).Err())
		if movedB && movedS {
			key = k
		}
	}
	// connect gives a store the node through a link that is down while it
	// connects, and up once it has looked.
	connect := func(t *testing.T) *Store {
		proxy := redistest.StartProxy(t, nodes[0].Addr(), 0)
		proxy.Cut()
		plan, err := NewPlan(Options{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: time.Second, BreakerFailures: 1, BreakerCooldown: time.Hour})
		if err != nil {
			t.Fatal(err)
		}
		conn := plan.Connect(nopLogger)
		s := NewStore(conn, StoreOptions{SlotTTL: time.Hour})
		t.Cleanup(func() {
			s.Close()
			_ = conn.Close()
		})
		time.Sleep(300 * time.Millisecond)
		proxy.Restore()
		if _, ok := conn.client().(*redis.ClusterClient); ok {
			t.Fatal("the store followed the Cluster while its node was down")
		}
		return s
	}
	tier := oneLimit(slowLimit(3))
	for name, call := range map[string]func(s *Store) error{
		"take":      func(s *Store) error { _, err := s.takeLimit(bg, key, tier.Limits[0], 1); return err },
		"acquire":   func(s *Store) error { _, _, _, err := s.Acquire(bg, key, 1); return err },
		"in flight": func(s *Store) error { _, err := s.InFlight(bg, key); return err },
		"reset":     func(s *Store) error { return s.Reset(bg, key) },
		"give back": func(s *Store) error {
			_, err := s.giveBack("node", []leaseReturn{{key: string(key), tier: tier, tokens: 1, seq: 1, done: make(chan struct{})}})
			return err
		},
		"free": func(s *Store) error {
			tb := s.slotTable()
			tb.send([]slotFree{{key: slotKey(key), id: 1}})
			tb.mu.Lock()
			defer tb.mu.Unlock()
			if len(tb.doubt) > 0 {
				return errors.New("the free failed")
			}
			return nil
		},
	} {
		t.Run(name, func(t *testing.T) {
			s := connect(t)
			if err := call(s); err != nil {
				t.Errorf("the first call: %v", err)
			}
			if _, ok := s.conn.client().(*redis.ClusterClient); !ok {
				t.Errorf("after the first call, the store does not follow the Cluster")
			}
			if got := s.BreakerState(); got != "closed" {
				t.Errorf("the breaker is %s, want closed", got)
			}
		})
	}
	t.Run("MOVED not followed", func(t *testing.T) {
		s := connect(t)
		s.conn.followMu.Lock()
		s.conn.asCluster = func() (redis.UniversalClient, error) { return nil, errors.New("no Cluster client from this address") }
		s.conn.followMu.Unlock()
		for i := range 3 {
			if _, err := s.takeLimit(bg, key, tier.Limits[0], 1); err == nil || errors.Is(err, errBreakerOpen) {
				t.Fatalf("take %d: %v; want the MOVED", i, err)
			}
		}
		if got := s.BreakerState(); got != "closed" {
			t.Errorf("after three MOVED, the breaker is %s; want closed, since Redis answered", got)
		}
	})
}

// A connection's lines, and go-redis's, go to the logger of the newest
// store of it that names one; when that store closes, to the newest left;
// with none, to the logger the connection was made with. A config that
// unloads closes its log, so the lines must leave it.
func TestAConnectionLogsToItsNewestStoresLogger(t *testing.T) {
	// Not parallel: go-redis's log goes to one route for the process
	// (goRedisRoute), which the stores of tests running beside it move.
	// A Redis that answers: go-redis says nothing of its own meanwhile.
	srv := redistest.Start(t)
	plan, err := NewPlan(Options{Addresses: []string{srv.URL()}})
	if err != nil {
		t.Fatal(err)
	}
	observed := func() (*zap.Logger, *observer.ObservedLogs) {
		core, logs := observer.New(zapcore.DebugLevel)
		return zap.New(core), logs
	}
	made, madeLogs := observed()
	older, olderLogs := observed()
	newer, newerLogs := observed()
	conn := plan.Connect(made)
	defer conn.Close()
	a := NewStore(conn, StoreOptions{Logger: older})
	b := NewStore(conn, StoreOptions{Logger: newer})
	logs := map[string]*observer.ObservedLogs{"made with": madeLogs, "older": olderLogs, "newer": newerLogs}
	expect := func(step, want string) {
		t.Helper()
		for i := range 3 {
			conn.masterSwitched("127.0.0.1:1", "127.0.0.1:"+strconv.Itoa(2+i)) // the connection's own line
			goRedisLog{}.Printf(bg, "redis: %s", "dial failed")                // go-redis's
		}
		for name, l := range logs {
			own, goRedis := l.FilterMessageSnippet("new master").Len(), l.FilterMessage("redis client").Len()
			if name == want && (own == 0 || goRedis == 0) || name != want && own+goRedis > 0 {
				t.Errorf("%s: the logger %s got %d of the connection's lines and %d of go-redis's; want them all in %s", step, name, own, goRedis, want)
			}
			l.TakeAll()
		}
	}
	expect("two stores open", "newer")
	b.Close()
	expect("the newer closed", "older")
	a.Close()
	expect("both closed", "made with")
}

// TestANewConnectionSendsNoClientSetInfo: a new connection's set-up is a
// round trip per command, which a node far from Redis pays before its first
// call can go (3 through a 160 ms link leave a 500 ms timeout 20 ms): it
// sends no CLIENT SETINFO, which nothing here reads. A server older than
// 7.2 refuses the command, so it is counted as an error or as a call.
func TestANewConnectionSendsNoClientSetInfo(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	before := refusedCommands(rawInfo(t, srv.Addr()))
	s := newTestStore(t, testConfig{Addresses: []string{srv.Addr()}, Timeout: time.Second})
	if _, err := s.takeLimit(context.Background(), bucketFor("set-info"), slowLimit(10), 1); err != nil {
		t.Fatal(err)
	}
	// Read by hand: a go-redis client would send its own CLIENT SETINFO.
	info := rawInfo(t, srv.Addr())
	if after := refusedCommands(info); after != before || strings.Contains(info, "cmdstat_client|setinfo") {
		t.Errorf("a new connection sent CLIENT SETINFO (commands refused with ERR: %d before, %d after):\n%s", before, after, info)
	}
	if !strings.Contains(info, "cmdstat_evalsha") {
		t.Errorf("no EVALSHA counted: the check reads the wrong statistics:\n%s", info)
	}
}

// refusedCommands is INFO errorstats' count of ERR answers.
func refusedCommands(info string) int {
	_, rest, _ := strings.Cut(info, "errorstat_ERR:count=")
	n, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(rest, "\r\n", 2)[0]))
	return n
}

// rawInfo is INFO's commandstats and errorstats, asked over a plain TCP
// connection.
func rawInfo(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("INFO commandstats\r\nINFO errorstats\r\n")); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(c)
	var sb strings.Builder
	for range 2 {
		head, err := r.ReadString('\n')
		if err != nil || !strings.HasPrefix(head, "$") {
			t.Fatalf("INFO answered %q, %v", head, err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(head[1:]))
		if err != nil {
			t.Fatal(err)
		}
		body := make([]byte, n+2)
		if _, err := io.ReadFull(r, body); err != nil {
			t.Fatal(err)
		}
		sb.Write(body)
	}
	return sb.String()
}
