package redisbucket

import (
	"errors"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// Review of issue 23 (concurrency): tests that fail on the code as landed.

// Defect: every acquire sets the whole set's expiry to its own node's
// slot_ttl (slotsLua: PEXPIRE KEYS[1] ms), shortening the key's life below
// the scores of slots that another node (or the config before a reload,
// which still renews its running requests' slots) holds with a longer
// slot_ttl; when the key expires, those live slots vanish and are never
// renewed back (ZADD XX). Breaks: "a slot expires after slot_ttl unless its
// node renews it" and "at most n in flight", fleet-wide.
func TestReview23ShorterSlotTTLElsewhereExpiresALiveSlot(t *testing.T) {
	if testing.Short() {
		t.Skip("real-time test: skipped under -short")
	}
	srv := redistest.Start(t)
	long := slotStore(t, 10*time.Second, srv.URL())
	short := slotStore(t, 300*time.Millisecond, srv.URL())
	key := bucketFor("review23-mixed-ttl")
	if _, _, ok, err := long.Acquire(bg, key, 2); !ok || err != nil {
		t.Fatalf("the long-lived slot: %v, %v", ok, err)
	}
	id, _, ok, err := short.Acquire(bg, key, 2)
	if !ok || err != nil {
		t.Fatalf("the short-lived slot: %v, %v", ok, err)
	}
	short.Release(key, id)
	time.Sleep(time.Second)
	// The long node's request still runs: its slot is good for 10s.
	if n, err := long.InFlight(bg, key); err != nil || n != 1 {
		t.Fatalf("in flight %d, %v; want 1: the running request's slot (slot_ttl 10s, taken 1s ago) is gone", n, err)
	}
}

// Defect: a store closed (config unloaded) while one of its Acquire calls
// is between Redis's answer and noting the slot as held stops its loops at
// once (retire sees no slot held), so the slot is never renewed and its
// Release is queued on a channel nobody reads (stopLoops already ran): the
// slot stays taken in Redis until slot_ttl. Breaks: "the slot is freed on
// every path" / "frees are pipelined" (slots.go retire/Release).
func TestReview23CloseDuringAcquireLeavesTheSlotTaken(t *testing.T) {
	srv := redistest.Start(t)
	s := slotStore(t, 10*time.Second, srv.URL())
	key := bucketFor("review23-close-race")
	// A first call makes the slot table (and loads the script).
	if n, err := s.InFlight(bg, key); err != nil || n != 0 {
		t.Fatalf("in flight %d, %v", n, err)
	}
	s.slotTable()
	hook := new(afterScriptHook)
	s.conn.client().AddHook(hook)
	hook.mu.Lock()
	hook.then = s.Close // the reload unloads the config now
	hook.mu.Unlock()
	// Either the slot is the request's, and freed when it ends, or the
	// close refused it, and freed it: in neither case is it left taken.
	id, _, ok, err := s.Acquire(bg, key, 1)
	switch {
	case err == nil && ok:
		s.Release(key, id) // the request ends
	case !errors.Is(err, ErrSlotsClosed):
		t.Fatalf("acquire: %v, %v", ok, err)
	}
	if !eventually(2*time.Second, func() bool { return srv.Do("EXISTS", slotKey(key)).(int64) == 0 }) {
		t.Fatalf("the request ended, but Redis still holds its slot: %v", srv.Do("ZRANGE", slotKey(key), 0, -1, "WITHSCORES"))
	}
}
