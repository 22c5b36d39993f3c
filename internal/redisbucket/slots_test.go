package redisbucket

import (
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// slotStore is a store on addrs whose slots live ttl without renewal.
func slotStore(t *testing.T, ttl time.Duration, addrs ...string) *Store {
	t.Helper()
	plan, err := NewPlan(Options{Addresses: addrs, Timeout: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	s := NewStore(conn, StoreOptions{SlotTTL: ttl})
	t.Cleanup(func() {
		s.Close()
		_ = conn.Close()
	})
	return s
}

// eventually polls cond for up to d.
func eventually(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// Slots are taken up to n, fleet-wide; frees arrive pipelined; when the
// last is freed, Redis holds no key.
func TestSlotsAcquireUpToNAndFreeEveryOne(t *testing.T) {
	srv := redistest.Start(t)
	a, b := slotStore(t, 0, srv.URL()), slotStore(t, 0, srv.URL())
	key := bucketFor("slots")
	var ids []uint64
	for i := range 10 {
		s := a
		if i%2 == 1 {
			s = b
		}
		id, inUse, ok, err := s.Acquire(bg, key, 10)
		if err != nil || !ok || inUse != int64(i+1) {
			t.Fatalf("slot %d: %v, in use %d, %v", i, ok, inUse, err)
		}
		ids = append(ids, id)
	}
	if _, inUse, ok, err := b.Acquire(bg, key, 10); err != nil || ok || inUse != 10 {
		t.Fatalf("the 11th: %v, in use %d, %v; want refused with 10 in use", ok, inUse, err)
	}
	for i, id := range ids {
		s := a
		if i%2 == 1 {
			s = b
		}
		s.Release(key, id)
	}
	if !eventually(2*time.Second, func() bool { return srv.Do("EXISTS", slotKey(key)).(int64) == 0 }) {
		t.Fatalf("after every slot was freed, Redis still holds %s: %v", slotKey(key), srv.Do("ZRANGE", slotKey(key), 0, -1))
	}
	if n, err := a.InFlight(bg, key); err != nil || n != 0 {
		t.Fatalf("in flight after the frees: %d, %v", n, err)
	}
}

// A node that dies stops renewing: its slots are back within slot_ttl;
// a node that lives keeps its slots past slot_ttl.
func TestSlotsOfADeadNodeExpireAndALiveNodeKeepsItsOwn(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time test: skipped under -short")
	}
	srv := redistest.Start(t)
	ttl := 300 * time.Millisecond
	live, dead := slotStore(t, ttl, srv.URL()), slotStore(t, ttl, srv.URL())
	key := bucketFor("dead-node")
	if _, _, ok, err := live.Acquire(bg, key, 3); !ok || err != nil {
		t.Fatal(ok, err)
	}
	for range 2 {
		if _, _, ok, err := dead.Acquire(bg, key, 3); !ok || err != nil {
			t.Fatal(ok, err)
		}
	}
	// The dead node: its loops stop, and nothing it held is freed.
	dt := dead.slotTable()
	close(dt.stop)
	dt.done.Wait()
	dead.slotsMu.Lock()
	dead.slots, dead.slotsClosed = nil, true
	dead.slotsMu.Unlock()
	died := time.Now()
	if _, _, ok, _ := live.Acquire(bg, key, 3); ok {
		t.Fatal("a 4th slot of 3 while the dead node's are fresh")
	}
	if !eventually(3*ttl, func() bool {
		n, err := live.InFlight(bg, key)
		return err == nil && n == 1
	}) {
		t.Fatalf("the dead node's slots are not back after %v", 3*ttl)
	}
	back := time.Since(died)
	// 4 TTLs in, the live node's slot, renewed, still counts.
	time.Sleep(time.Until(died.Add(4 * ttl)))
	if n, err := live.InFlight(bg, key); err != nil || n != 1 {
		t.Fatalf("the live node's slot after 4 TTLs: %d in flight, %v; want 1 (renewed)", n, err)
	}
	if back > ttl+200*time.Millisecond {
		t.Errorf("the dead node's slots came back %v after it died; want within slot_ttl (%v)", back, ttl)
	}
}

// A store that closes (a reload) takes no new slot, and keeps the slots
// its requests hold, renewed, until they end: a stream that runs on
// through a reload keeps its place.
func TestSlotsOutliveAReloadUntilTheirRequestsEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time test: skipped under -short")
	}
	srv := redistest.Start(t)
	// Renewed every third of it: room for a renewal late under load.
	ttl := time.Second
	old := slotStore(t, ttl, srv.URL())
	key := bucketFor("reload")
	id, _, ok, err := old.Acquire(bg, key, 1)
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	old.Close()
	if _, _, _, err := old.Acquire(bg, key, 1); err == nil {
		t.Fatal("a closed store took a new slot")
	}
	fresh := slotStore(t, ttl, srv.URL())
	time.Sleep(3 * ttl)
	if _, inUse, ok, err := fresh.Acquire(bg, key, 1); err != nil || ok || inUse != 1 {
		t.Fatalf("3 TTLs after the reload, the new config: %v, in use %d, %v; want refused, the old request's slot still held", ok, inUse, err)
	}
	old.Release(key, id)
	if !eventually(2*time.Second, func() bool {
		_, _, ok, err := fresh.Acquire(bg, key, 1)
		return err == nil && ok
	}) {
		t.Fatal("the old request ended, but its slot is not free")
	}
}

// An acquire whose answer is lost (Redis slow past the timeout) may have
// taken the slot: it is freed, not left to block the client for slot_ttl.
func TestSlotsOfAFailedAcquireAreFreed(t *testing.T) {
	srv := redistest.Start(t)
	plan, err := NewPlan(Options{Addresses: []string{srv.URL()}, Timeout: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	s := NewStore(conn, StoreOptions{SlotTTL: 900 * time.Millisecond})
	t.Cleanup(func() {
		s.Close()
		_ = conn.Close()
	})
	key := bucketFor("lost-answer")
	id, _, ok, err := s.Acquire(bg, key, 1) // warm: the script is loaded
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	s.Release(key, id)
	if !eventually(2*time.Second, func() bool { return srv.Do("EXISTS", slotKey(key)).(int64) == 0 }) {
		t.Fatal("the warm-up slot was not freed")
	}
	srv.Pause()
	_, _, _, err = s.Acquire(bg, key, 1)
	srv.Resume()
	if err == nil {
		t.Fatal("an acquire while Redis was paused answered")
	}
	// Within one renewal period (a third of slot_ttl), nothing is held:
	// the client's next request gets its slot.
	if !eventually(600*time.Millisecond, func() bool {
		return srv.Do("EXISTS", slotKey(key)).(int64) == 0
	}) {
		t.Fatalf("the lost acquire's slot is still held: %v", srv.Do("ZRANGE", slotKey(key), 0, -1))
	}
	if _, _, ok, err := s.Acquire(bg, key, 1); err != nil || !ok {
		t.Fatalf("the next acquire: %v, %v; want the slot", ok, err)
	}
}

// In a Cluster, each bucket's slots are one key on its own node.
func TestSlotsInACluster(t *testing.T) {
	if testing.Short() {
		t.Skip("cluster test: skipped under -short")
	}
	nodes := redistest.StartCluster(t, 3)
	var addrs []string
	for _, n := range nodes {
		addrs = append(addrs, n.URL())
	}
	s := slotStore(t, 0, addrs...)
	var ids []uint64
	var keys [][]byte
	for i := range 20 {
		key := bucketFor("cluster-" + strconv.Itoa(i))
		for j := range 2 {
			id, _, ok, err := s.Acquire(bg, key, 2)
			if err != nil || !ok {
				t.Fatalf("bucket %d slot %d: %v %v", i, j, ok, err)
			}
			ids, keys = append(ids, id), append(keys, key)
		}
		if _, _, ok, err := s.Acquire(bg, key, 2); err != nil || ok {
			t.Fatalf("bucket %d, a third slot of 2: %v %v", i, ok, err)
		}
	}
	for i, id := range ids {
		s.Release(keys[i], id)
	}
	if !eventually(2*time.Second, func() bool {
		for _, k := range keys {
			if n, err := s.InFlight(bg, k); err != nil || n != 0 {
				return false
			}
		}
		return true
	}) {
		t.Fatal("slots still in flight after every free")
	}
}

// A renewal leaves with the doubtful frees, in one pipeline, and lands one
// trip after its tick: slot_ttl's least (MinSlotTTL) counts on it landing
// within the timeout, not after another round trip for the frees.
// Regression test for issue 30 item 3.
func TestSlotRenewalIsNotDelayedByDoubtfulFrees(t *testing.T) {
	srv := redistest.Start(t)
	const trip = 100 * time.Millisecond // each way
	proxy := redistest.StartProxy(t, srv.Addr(), trip)
	s := slotStore(t, time.Hour, "redis://"+proxy.Addr()) // the loops' ticks come never
	key := bucketFor("renewed")
	id, _, ok, err := s.Acquire(bg, key, 1)
	if err != nil || !ok {
		t.Fatal(ok, err)
	}
	tb := s.slotTable()
	tb.renew() // the connections it needs are open
	tb.mu.Lock()
	tb.doubt = append(tb.doubt, slotFree{key: slotKey(bucketFor("doubtful")), id: 1 << 40})
	tb.mu.Unlock()
	before := redisMicros(t, srv)
	tb.renew()
	score, err := srv.Client().ZScore(bg, slotKey(key), tb.member(id)).Result()
	if err != nil {
		t.Fatal(err)
	}
	landed := time.Duration(int64(score)-time.Hour.Microseconds()-before) * time.Microsecond
	if landed >= 2*trip {
		t.Errorf("the renewal landed %v after it was sent; want one trip, %v, not after the doubtful frees' round trip", landed, trip)
	}
}

// redisMicros is the Redis server's clock, in microseconds.
func redisMicros(t *testing.T, srv *redistest.Server) int64 {
	t.Helper()
	now, err := srv.Client().Time(bg).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.UnixMicro()
}

// The second free of a doubtful slot (an acquire that failed, whose slot
// landed after its first free) is not lost when the store closes before
// the next renewal: it goes at close, and the slot does not block the
// client for slot_ttl.
// Regression test for issue 30 item 4.
func TestSlotsDoubtfulFreeIsSentAtClose(t *testing.T) {
	srv := redistest.Start(t)
	s := slotStore(t, time.Hour, srv.URL()) // the loops' ticks come never
	key := bucketFor("doubtful-at-close")
	tb := s.slotTable()
	const id = 7
	srv.Do("ZADD", slotKey(key), time.Now().Add(time.Hour).UnixMicro(), tb.member(id))
	tb.mu.Lock()
	tb.doubt = append(tb.doubt, slotFree{key: slotKey(key), id: id})
	tb.mu.Unlock()
	s.Close()
	<-s.SlotsIdle()
	if n := srv.Do("ZCARD", slotKey(key)).(int64); n != 0 {
		t.Errorf("after the store closed, Redis still holds the doubtful slot: %v", srv.Do("ZRANGE", slotKey(key), 0, -1))
	}
}

// A free that does not reach Redis (a blip, a failover under way) goes
// again once Redis answers, well before the slot would expire, and not
// only at the next renewal: the client with nothing in flight is not
// held off for the rest of slot_ttl. The frees a renewal carries and
// fails to deliver go again too.
func TestASlotFreeThatFailedIsSentAgain(t *testing.T) {
	srv := redistest.Start(t)
	for _, via := range []string{"release", "renewal"} {
		t.Run(via, func(t *testing.T) {
			proxy := redistest.StartProxy(t, srv.Addr(), 0)
			s := slotStore(t, time.Hour, "redis://"+proxy.Addr()) // the renewals' ticks come never
			key := bucketFor("lost-free-" + via)
			id, _, ok, err := s.Acquire(bg, key, 1)
			if err != nil || !ok {
				t.Fatal(ok, err)
			}
			tb := s.slotTable()
			proxy.Cut()
			if via == "release" {
				s.Release(key, id)
			} else {
				tb.mu.Lock()
				delete(tb.held, id)
				tb.doubt = append(tb.doubt, slotFree{key: slotKey(key), id: id})
				tb.mu.Unlock()
				tb.renew()
			}
			// Until the free has failed, and is kept to go again.
			eventually(time.Second, func() bool {
				tb.mu.Lock()
				defer tb.mu.Unlock()
				return len(tb.doubt) > 0
			})
			proxy.Restore()
			const within = 3 * time.Second
			if !eventually(within, func() bool { return srv.Do("ZCARD", slotKey(key)).(int64) == 0 }) {
				t.Errorf("%v after Redis came back, it still holds the slot whose free failed: %v", within, srv.Do("ZRANGE", slotKey(key), 0, -1))
			}
		})
	}
}

// A client whose request has ended has none in flight: the slot its
// request freed on this node is free for its next request at once, though
// the free is pipelined and may not have reached Redis yet. One at a time,
// a client never meets a refusal, as with the local store.
func TestASlotFreedOnThisNodeIsFreeForTheNextAcquireAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	s := slotStore(t, 0, srv.URL())
	key := bucketFor("one at a time")
	refused := 0
	for range 500 {
		id, inUse, ok, err := s.Acquire(bg, key, 1)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			refused++
			if refused == 1 {
				t.Errorf("a request one at a time was refused its slot, %d in use: the last one's free had not reached Redis", inUse)
			}
			continue
		}
		s.Release(key, id)
	}
	if refused > 0 {
		t.Errorf("%d of 500 requests one at a time were refused a slot of 1", refused)
	}
}
