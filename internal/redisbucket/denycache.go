package redisbucket

import (
	"errors"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
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
	limit  bucket.Limit
	cost   int64
	result bucket.Result
	// limits, quotas and results are a tier's several limits and its
	// quotas, and each one's answer, limits first, when it has several or
	// quotas; limit and result are then unused.
	limits  []bucket.Limit
	quotas  []bucket.Quota
	results []bucket.Result
	until   int64 // monotonic µs at which the client may retry
	resetAt int64 // monotonic µs at which the bucket is full
	// probe, once the denial has expired, is the one request of this node
	// that asks Redis again (claim).
	probe *probe
}

// probe is one request's call to Redis for a client whose denial expired;
// done is closed when it has its answer, and err is then its failure.
type probe struct {
	done chan struct{}
	err  error
}

// errProbeAbandoned is a probe's end when its own request went away (its
// client hung up) before Redis answered: that says nothing of Redis, so
// the requests that waited for it claim again, and one of them probes.
var errProbeAbandoned = errors.New("redis store: the deny cache's probe was abandoned by its request")

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
	res.Banned = false // the denial that started a ban was Redis's, not this one
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

// getAll is get for a tier of several limits or quotas: out gets each
// one's answer, limits first, as Redis gave it, with the time left.
func (c *denyCache) getAll(key string, tr bucket.Tier, cost, now int64, out []bucket.Result) (uint64, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	e, ok := sh.entries[key]
	epoch := sh.epoch
	sh.mu.Unlock()
	if !ok || now >= e.until || e.cost != cost || !slices.Equal(e.limits, tr.Limits) || !slices.Equal(e.quotas, tr.Quotas) {
		return epoch, false
	}
	c.hits.Add(1)
	denyCacheHitsTotal.Add(1)
	for i, r := range e.results {
		// Each limit's times count down from the denial.
		elapsed := now - (e.until - e.result.RetryAfter)
		r.RetryAfter = max(0, r.RetryAfter-elapsed)
		r.ResetAfter = max(0, r.ResetAfter-elapsed)
		r.Banned = false // the denial that started a ban was Redis's
		out[i] = r
	}
	return epoch, true
}

// putAll is put for a tier of several limits or quotas: res is the
// answer of the one that makes the client wait longest; out holds every
// one's, limits first.
func (c *denyCache) putAll(key string, epoch uint64, tr bucket.Tier, cost, start int64, res bucket.Result, out []bucket.Result) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.epoch != epoch {
		return
	}
	if _, ok := sh.entries[key]; !ok && len(sh.entries) >= sh.max {
		sh.makeRoom(start)
	}
	sh.entries[key] = denyEntry{cost: cost, result: res, until: start + res.RetryAfter, resetAt: start + res.ResetAfter,
		limits: slices.Clone(tr.Limits), quotas: slices.Clone(tr.Quotas), results: slices.Clone(out)}
}

// claim is for a request the cache did not answer. Once a client's denial
// has expired, a flood of its requests would all ask Redis in the round
// trip before the next denial is known: one asks (done is set, which it
// calls once it has its answer and put any denial, with the call's
// error), and the others wait for it (wait) and look again, or fail as it
// did, within the one call's timeout. A probe that ends with
// errProbeAbandoned leaves the expired entry: the others claim again. Neither is set when no expired
// denial is there: the request asks Redis as usual. After the answer the
// expired entry goes, unless a denial replaced it: the requests that
// waited then find that denial, or ask Redis each, since the bucket may
// hold more than one request's cost.
func (c *denyCache) claim(key string, now int64) (done func(err error), wait *probe) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.entries[key]
	switch {
	case !ok || now < e.until:
		return nil, nil
	case e.probe != nil:
		return nil, e.probe
	}
	p := &probe{done: make(chan struct{})}
	e.probe = p
	sh.entries[key] = e
	return func(err error) {
		sh.mu.Lock()
		if cur, ok := sh.entries[key]; ok && cur.probe == p {
			if err == errProbeAbandoned {
				cur.probe = nil
				sh.entries[key] = cur
			} else {
				delete(sh.entries, key)
			}
		}
		p.err = err
		sh.mu.Unlock()
		close(p.done)
	}, nil
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
