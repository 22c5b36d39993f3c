package redisbucket

import (
	"fmt"
	"testing"
	"time"
)

// A flood of distinct keys with credit on, their charges held back (Redis
// slow to answer): the table keeps at most its bound of keys credited and
// charging, gives the rest no credit, and stays within its bound plus the
// one entry a full shard takes in beside them.
func TestAFloodOfColdKeysKeepsTheCreditTableBounded(t *testing.T) {
	t.Parallel()
	_, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := slowLimit(20)
	tb := newCreditTable(c, LeaseSize{tokens: 5}, time.Second, 4*leaseShards, 1)
	tb.debts = newDebtBook(1000)
	defer func() {
		c.mu.Lock()
		close(c.gate)
		c.gate = nil
		c.mu.Unlock()
		tb.close()
	}()
	calls := sm.calls
	for i := range 5000 {
		if res, err := tb.take(bg, fmt.Appendf(nil, "flood-%d", i), oneLimit(l), 1, nil); err != nil || !res.Allowed {
			t.Fatalf("key %d: %+v %v", i, res, err)
		}
	}
	entries, charging := 0, 0
	for i := range tb.shards {
		sh := &tb.shards[i]
		sh.mu.Lock()
		entries += len(sh.m)
		for _, e := range sh.m {
			if e.charging {
				charging++
			}
		}
		sh.mu.Unlock()
	}
	t.Logf("after 5,000 cold keys: %d entries, %d charging, %d lease calls", entries, charging, sm.calls-calls)
	if charging == 0 || charging > 4*leaseShards || entries > 5*leaseShards {
		t.Errorf("after 5,000 cold keys: %d entries, %d of them charging; want at most %d charging (the bound) and %d entries", entries, charging, 4*leaseShards, 5*leaseShards)
	}
	if credited := 5000 - (sm.calls - calls); credited > 4*leaseShards {
		t.Errorf("%d keys credited with their charges out; want at most the bound, %d", credited, 4*leaseShards)
	}
}
