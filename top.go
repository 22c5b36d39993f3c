package ratelimit

import (
	"slices"
	"sync"
	"time"
)

// Who is being limited (DESIGN section 6): each policy keeps, on this node,
// the buckets it denied most in about the last minute, in a bounded
// heavy-hitters sketch (space-saving) that only denials touch. It holds
// fingerprints (key_id), never a client's value. The same pass notices a
// bucket that starts being denied, for the rate_limit_exceeded event.

// topWindow is how long one sketch counts before it becomes the previous
// one; the top list merges the two, so it spans one to two windows.
const topWindow = 30 * time.Second

// topEntries bounds each sketch, and maxExceeded the buckets remembered
// as being denied.
const (
	topEntries  = 256
	maxExceeded = 4096
)

// denialKey names a bucket in the sketch.
type denialKey struct {
	tier, keyer, keyID string
}

// denialCount is one bucket's count in a window. err is space-saving's
// overestimate: the count of the entry it replaced.
type denialCount struct {
	denied, err int64
	last        time.Time
}

// sketch is one window's space-saving counts.
type sketch map[denialKey]*denialCount

// denials is one policy's record of its denials on this node.
type denials struct {
	mu          sync.Mutex
	cur, prev   sketch
	windowStart time.Time
	// exceeded remembers, by bucket, until when (monotonic µs) its last
	// denial said to retry: a denial after that follows a time the bucket
	// could allow again, so it starts a new exceeded episode. Bounded.
	exceeded map[denialKey]int64
}

// policyDenials holds every policy's record, kept across reloads.
var policyDenials = struct {
	sync.Mutex
	byPolicy map[string]*denials
}{byPolicy: make(map[string]*denials)}

func denialsFor(policy string) *denials {
	policyDenials.Lock()
	defer policyDenials.Unlock()
	d := policyDenials.byPolicy[policy]
	if d == nil {
		d = &denials{cur: sketch{}, prev: sketch{}, exceeded: make(map[denialKey]int64)}
		policyDenials.byPolicy[policy] = d
	}
	return d
}

// record counts one denial, at wall time now and monotonic time mono (µs,
// the local store's clock), and reports whether the bucket starts being
// denied: the first denial since it could last have allowed.
func (d *denials) record(k denialKey, now time.Time, mono int64, retryAfter time.Duration) (started bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rotate(now)
	d.cur.add(k, now)

	until, seen := d.exceeded[k]
	started = !seen || mono >= until
	if !seen && len(d.exceeded) >= maxExceeded {
		d.forgetExceeded()
	}
	d.exceeded[k] = mono + retryAfter.Microseconds()
	return started
}

// rotate starts a new window when the current one is over.
func (d *denials) rotate(now time.Time) {
	switch age := now.Sub(d.windowStart); {
	case age < topWindow:
		return
	case age < 2*topWindow:
		d.prev, d.cur = d.cur, sketch{}
	default:
		d.prev, d.cur = sketch{}, sketch{}
	}
	d.windowStart = now
}

// forgetExceeded makes room for one more bucket: it drops one that Go's
// map order picks, in constant time, so that a flood of distinct denied
// keys costs no scan. That bucket's next denial may then emit its event
// once more, which only ever adds an event.
func (d *denials) forgetExceeded() {
	for k := range d.exceeded {
		delete(d.exceeded, k)
		return
	}
}

// add counts k: its entry, or a new one, which replaces the least counted
// when the sketch is full and inherits its count as the error bound.
func (s sketch) add(k denialKey, now time.Time) {
	if c := s[k]; c != nil {
		c.denied++
		c.last = now
		return
	}
	var base int64
	if len(s) >= topEntries {
		var minKey denialKey
		var minCount *denialCount
		for key, c := range s {
			if minCount == nil || c.denied < minCount.denied {
				minKey, minCount = key, c
			}
		}
		delete(s, minKey)
		base = minCount.denied
	}
	s[k] = &denialCount{denied: base + 1, err: base, last: now}
}

// topDenied is one row of GET /rate_limit/top.
type topDenied struct {
	Tier   string `json:"tier"`
	Keyer  string `json:"keyer"`
	KeyID  string `json:"key_id"`
	Denied int64  `json:"denied"`
	// LastDenied is when, as RFC 3339.
	LastDenied time.Time `json:"last_denied"`
}

// top is the n buckets denied most in the last one to two windows, most
// first. Counts are space-saving's: never under the truth, and over it by
// at most what the sketch forgot when it was full.
func (d *denials) top(now time.Time, n int) []topDenied {
	d.mu.Lock()
	d.rotate(now)
	merged := make(map[denialKey]*denialCount, len(d.cur)+len(d.prev))
	for _, s := range []sketch{d.prev, d.cur} {
		for k, c := range s {
			m := merged[k]
			if m == nil {
				m = &denialCount{}
				merged[k] = m
			}
			m.denied += c.denied
			if c.last.After(m.last) {
				m.last = c.last
			}
		}
	}
	d.mu.Unlock()
	rows := make([]topDenied, 0, len(merged))
	for k, c := range merged {
		rows = append(rows, topDenied{Tier: k.tier, Keyer: k.keyer, KeyID: k.keyID, Denied: c.denied, LastDenied: c.last.UTC()})
	}
	slices.SortFunc(rows, func(a, b topDenied) int {
		if a.Denied != b.Denied {
			return int(b.Denied - a.Denied)
		}
		return b.LastDenied.Compare(a.LastDenied)
	})
	return rows[:min(n, len(rows))]
}

// exceededEvent is the Caddy event of a bucket that starts being denied.
const exceededEvent = "rate_limit_exceeded"

// noteDenial records a denial for GET /rate_limit/top and, when the bucket
// starts being denied, emits rate_limit_exceeded: once per bucket until it
// could allow again, never once per request of a flood.
func (h *Handler) noteDenial(d *decision) {
	retry := time.Duration(d.retryAfterSeconds()) * time.Second
	k := denialKey{tier: d.tier.Name, keyer: d.bucket.Keyer, keyID: d.keyID()}
	if !h.denials.record(k, d.start, localClock(), retry) || h.events == nil || !h.events.ShouldEmit(exceededEvent) {
		return
	}
	h.events.Emit(h.ctx, exceededEvent, map[string]any{
		"policy":      h.Name,
		"tier":        k.tier,
		"keyer":       k.keyer,
		"key_id":      k.keyID,
		"retry_after": int(retry / time.Second),
	})
}
