package redisbucket

import (
	"runtime"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A table closed while a credit charge is out waits for it: the charge,
// and the one for the requests credited meanwhile, reach the shared
// bucket before close returns, and no goroutine of the table is left.
func TestClosingATableWithACreditChargeOutChargesItAndLeavesNothingRunning(t *testing.T) {
	_, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := slowLimit(20)
	before := runtime.NumGoroutine()
	tb := newCreditTable(c, LeaseSize{tokens: 5}, time.Second, 1000, 2)
	key := []byte("charged at close")
	for range 2 {
		if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
			t.Fatalf("credited: %+v %v", res, err)
		}
	}
	closed := make(chan struct{})
	go func() {
		tb.close()
		close(closed)
	}()
	redistest.WaitFor(t, 5*time.Second, "close to start", tb.closed.Load)
	select {
	case <-closed:
		t.Fatal("close returned with a credit charge out")
	default:
	}
	c.mu.Lock()
	close(c.gate)
	c.gate = nil
	c.mu.Unlock()
	<-closed
	if level := sm.level(string(key), l); level != l.Capacity-2 || c.charges != 2 {
		t.Fatalf("after close: level %d, %d charges; want %d and 2", level, c.charges, l.Capacity-2)
	}
	if _, err := tb.take(bg, key, oneLimit(l), 1, nil); err != errLeasesClosed {
		t.Fatalf("a request after close: %v; want errLeasesClosed", err)
	}
	redistest.WaitFor(t, 5*time.Second, "the table's goroutines to end", func() bool { return runtime.NumGoroutine() <= before })
}
