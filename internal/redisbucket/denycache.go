package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"sync"
	"sync/atomic"
)

// denyCache remembers denied buckets until their retry time, by Redis key.
// It only ever answers "denied", and only before the time Redis gave, so it
// never admits what Redis would deny, and denies only what Redis would.
type denyCache struct {
	shards [denyShards]denyShard
	hits   atomic.Uint64
}

const denyShards = 64

type denyShard struct {
	mu      sync.Mutex
	entries map[string]denyEntry
	max     int
	// epoch counts the resets of the shard's keys. A denial is kept only
	// if no reset came between the Take's look at the cache and its put:
	// one that Redis gave before a reset must not outlive it. Per shard,
	// not per key, to stay bounded; a put dropped for another key's reset
	// only sends that client's next request to Redis.
	epoch uint64
}

type denyEntry struct {
	limit   bucket.Limit
	cost    int64
	result  bucket.Result
	until   int64 // monotonic µs at which the client may retry
	resetAt int64 // monotonic µs at which the bucket is full
}

func newDenyCache(size int) *denyCache {
	c := &denyCache{}
	for i := range c.shards {
		c.shards[i].entries = make(map[string]denyEntry)
		c.shards[i].max = max(1, (size+denyShards-1)/denyShards)
	}
	return c
}

func (c *denyCache) shard(key string) *denyShard {
	// FNV-1a over the key's hex tail is plenty: the keys are hashes already.
	h := uint32(2166136261)
	for i := max(0, len(key)-8); i < len(key); i++ {
		h = (h ^ uint32(key[i])) * 16777619
	}
	return &c.shards[h%denyShards]
}

// get answers a Take that a remembered denial already decides. The same
// cost on the same limit is denied until the retry time, since tokens
// refill at a fixed rate and only Reset adds more. Otherwise it returns
// the epoch to hand to put.
func (c *denyCache) get(key string, l bucket.Limit, cost, now int64) (bucket.Result, uint64, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	e, ok := sh.entries[key]
	epoch := sh.epoch
	sh.mu.Unlock()
	if !ok || now >= e.until || e.limit != l || e.cost != cost {
		return bucket.Result{}, epoch, false
	}
	c.hits.Add(1)
	denyCacheHitsTotal.Add(1)
	res := e.result
	res.RetryAfter = e.until - now
	res.ResetAfter = max(res.RetryAfter, e.resetAt-now)
	return res, epoch, true
}

// put remembers a denial that Redis gave to a request sent at start, when
// get gave epoch. Redis decided at or after start, so start plus its retry
// time is never later than the moment Redis would allow. A reset since
// then drops it.
func (c *denyCache) put(key string, epoch uint64, l bucket.Limit, cost, start int64, res bucket.Result) {
	sh := c.shard(key)
	sh.mu.Lock()
	if sh.epoch != epoch {
		sh.mu.Unlock()
		return
	}
	if _, ok := sh.entries[key]; !ok && len(sh.entries) >= sh.max {
		sh.makeRoom(start)
	}
	sh.entries[key] = denyEntry{limit: l, cost: cost, result: res, until: start + res.RetryAfter, resetAt: start + res.ResetAfter}
	sh.mu.Unlock()
}

// remove forgets the key's denial, and any a Take in flight would put.
func (c *denyCache) remove(key string) {
	sh := c.shard(key)
	sh.mu.Lock()
	delete(sh.entries, key)
	sh.epoch++
	sh.mu.Unlock()
}

// makeRoom drops expired entries, then any, to free a 16th of the shard.
// Dropping an entry only sends that client's next request to Redis.
func (sh *denyShard) makeRoom(now int64) {
	want := len(sh.entries) - sh.max + max(1, sh.max/16)
	for k, e := range sh.entries {
		if now >= e.until {
			delete(sh.entries, k)
			want--
		}
	}
	for k := range sh.entries {
		if want <= 0 {
			break
		}
		delete(sh.entries, k)
		want--
	}
}

func (c *denyCache) len() int {
	n := 0
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		n += len(sh.entries)
		sh.mu.Unlock()
	}
	return n
}
