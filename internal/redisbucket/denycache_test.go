package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"strconv"
	"testing"
)

func TestDenyCacheIsBounded(t *testing.T) {
	c := newDenyCache(1000)
	l := slowLimit(1)
	for i := range 20000 {
		c.put("rl:p:t:"+strconv.Itoa(i), 0, l, 1, 1, bucket.Result{RetryAfter: 1 << 40})
	}
	if n := c.len(); n > 1000+denyShards {
		t.Fatalf("deny cache holds %d entries, bound 1000", n)
	}
	// Expired entries go before live ones.
	c = newDenyCache(denyShards)
	c.put("old", 0, l, 1, 0, bucket.Result{RetryAfter: 10})
	sh := c.shard("old")
	sh.makeRoom(100)
	if len(sh.entries) != 0 {
		t.Fatal("an expired entry survived makeRoom")
	}
	// Only the same limit and cost are answered.
	c.put("k", 0, l, 2, 0, bucket.Result{RetryAfter: 1000})
	if _, _, ok := c.get("k", l, 1, 10); ok {
		t.Fatal("a denial at cost 2 answered a take of cost 1")
	}
	if _, _, ok := c.get("k", slowLimit(2), 2, 10); ok {
		t.Fatal("a denial answered a take on another limit")
	}
	if _, _, ok := c.get("k", l, 2, 1000); ok {
		t.Fatal("a denial answered at its retry time")
	}
	if res, _, ok := c.get("k", l, 2, 10); !ok || res.Allowed || res.RetryAfter != 990 {
		t.Fatalf("get within the retry time: %+v, %v", res, ok)
	}
}

// TestDenyCacheDropsADenialFromBeforeAReset is the deny cache's side of
// the race: a put that carries the epoch from before a reset is dropped,
// one from after it is kept.
func TestDenyCacheDropsADenialFromBeforeAReset(t *testing.T) {
	c := newDenyCache(100)
	l := slowLimit(1)
	denial := bucket.Result{RetryAfter: 1000, ResetAfter: 1000}
	_, before, _ := c.get("k", l, 1, 0)
	c.remove("k")
	c.put("k", before, l, 1, 0, denial)
	if _, _, ok := c.get("k", l, 1, 10); ok {
		t.Fatal("a denial from before the reset was kept")
	}
	_, after, _ := c.get("k", l, 1, 10)
	c.put("k", after, l, 1, 10, denial)
	if _, _, ok := c.get("k", l, 1, 20); !ok {
		t.Fatal("a denial from after the reset was dropped")
	}
}
