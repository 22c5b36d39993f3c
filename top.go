package ratelimit

import (
	"container/heap"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"go.uber.org/zap"
)

// Who is being limited (docs/operating.md, the admin API): each policy keeps, on this
// node, the buckets it denied most in about the last minute, in a bounded
// heavy-hitters sketch (space-saving) that only denials touch. It holds
// fingerprints (key_id), never a client's value. The same pass notices a
// bucket that starts being denied, for the rate_limit_exceeded event. A
// denial only queues a note: one goroutine per handler records it, so that
// a flood of denials never waits on the policy's lock or the event's
// handlers.

// topWindow is how long one sketch counts before it becomes the previous
// one; the top list merges the two, so it spans one to two windows.
const topWindow = 30 * time.Second

// topEntries bounds each sketch, maxExceeded the buckets followed through
// a denial episode, and noteQueue the denials waiting to be recorded.
const (
	topEntries  = 256
	maxExceeded = 4096
	noteQueue   = 4096
)

// denialKey names a bucket in the sketch.
type denialKey struct {
	tier, keyer, keyID string
}

// denialTally is what the sketch keeps beside a bucket's count: err is
// space-saving's overestimate, the count of the entry it replaced.
type denialTally struct {
	err  int64
	last time.Time
}

// sketch is one window's space-saving counts: the rank is the count.
type sketch struct{ rankedSet[denialTally] }

// denials is one policy's record of its denials on this node.
type denials struct {
	mu          sync.Mutex
	cur, prev   *sketch
	windowStart time.Time
	// exceeded follows the buckets in a denial episode, ranked by until
	// when (monotonic µs) their last denial said to retry: a denial after
	// that follows a time the bucket could allow again, so it starts a new
	// episode. Bounded by maxExceeded.
	exceeded rankedSet[struct{}]
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
		d = newDenials()
		policyDenials.byPolicy[policy] = d
	}
	return d
}

func newDenials() *denials {
	return &denials{cur: new(sketch), prev: new(sketch)}
}

// record counts one denial, at wall time now and monotonic time mono (µs,
// the local store's clock). started reports that the bucket starts being
// denied: the first denial since it could last have allowed. followed is
// false when the bucket was not followed before and there is no room to
// follow it: its event, if it starts one, is not emitted, so that a bucket
// is never told of twice in one episode because another pushed it out.
func (d *denials) record(k denialKey, now time.Time, mono int64, retryAfter time.Duration) (started, followed bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.rotate(now)
	d.cur.add(k, now)

	until := mono + retryAfter.Microseconds()
	if i, seen := d.exceeded.index[k]; seen {
		e := &d.exceeded.entries[i]
		started = mono >= e.rank
		e.rank = until
		heap.Fix(&d.exceeded, i)
		return started, true
	}
	// Episodes that have ended make room: such a bucket's next denial
	// starts a new one, followed or not.
	for d.exceeded.Len() > 0 && d.exceeded.entries[0].rank <= mono {
		heap.Pop(&d.exceeded)
	}
	if d.exceeded.Len() >= maxExceeded {
		return false, false
	}
	heap.Push(&d.exceeded, rankedEntry[struct{}]{key: k, rank: until})
	return true, true
}

// rotate starts a new window when the current one is over.
func (d *denials) rotate(now time.Time) {
	switch age := now.Sub(d.windowStart); {
	case age < topWindow:
		return
	case age < 2*topWindow:
		d.prev, d.cur = d.cur, new(sketch)
	default:
		d.prev, d.cur = new(sketch), new(sketch)
	}
	d.windowStart = now
}

// add counts k: its entry, or a new one, which replaces the least counted
// when the sketch is full and inherits its count as the error bound.
func (s *sketch) add(k denialKey, now time.Time) {
	if i, ok := s.index[k]; ok {
		e := &s.entries[i]
		e.rank++
		e.val.last = now
		heap.Fix(s, i)
		return
	}
	var base int64
	if s.Len() >= topEntries {
		base = heap.Pop(s).(rankedEntry[denialTally]).rank
	}
	heap.Push(s, rankedEntry[denialTally]{key: k, rank: base + 1, val: denialTally{err: base, last: now}})
}

// rankedSet is a set of buckets, each with a rank, that finds the lowest
// ranked at once: an indexed min-heap, for container/heap. It finds the
// sketch's least counted bucket, and the followed episode that ends first,
// without a scan.
type rankedSet[V any] struct {
	index   map[denialKey]int
	entries []rankedEntry[V]
}

type rankedEntry[V any] struct {
	key  denialKey
	rank int64
	val  V
}

func (s *rankedSet[V]) Len() int           { return len(s.entries) }
func (s *rankedSet[V]) Less(i, j int) bool { return s.entries[i].rank < s.entries[j].rank }

func (s *rankedSet[V]) Swap(i, j int) {
	s.entries[i], s.entries[j] = s.entries[j], s.entries[i]
	s.index[s.entries[i].key] = i
	s.index[s.entries[j].key] = j
}

func (s *rankedSet[V]) Push(x any) {
	e := x.(rankedEntry[V])
	if s.index == nil {
		s.index = make(map[denialKey]int)
	}
	s.index[e.key] = len(s.entries)
	s.entries = append(s.entries, e)
}

func (s *rankedSet[V]) Pop() any {
	last := len(s.entries) - 1
	e := s.entries[last]
	s.entries = s.entries[:last]
	delete(s.index, e.key)
	return e
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
	merged := make(map[denialKey]*topDenied, d.cur.Len()+d.prev.Len())
	for _, s := range []*sketch{d.prev, d.cur} {
		for _, e := range s.entries {
			m := merged[e.key]
			if m == nil {
				m = &topDenied{Tier: e.key.tier, Keyer: e.key.keyer, KeyID: e.key.keyID}
				merged[e.key] = m
			}
			m.Denied += e.rank
			if last := e.val.last.UTC(); last.After(m.LastDenied) {
				m.LastDenied = last
			}
		}
	}
	d.mu.Unlock()
	rows := make([]topDenied, 0, len(merged))
	for _, m := range merged {
		rows = append(rows, *m)
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

// denialNote is one denial on its way from a request to the recorder.
type denialNote struct {
	key  denialKey
	at   time.Time
	mono int64
	// retry is the denial's Retry-After.
	retry time.Duration
	// flushed, on a note that carries no denial, is closed once every
	// note before it has been recorded.
	flushed chan struct{}
}

// denialNotes carries a handler's denials off the request path, to one
// goroutine that records them into the policy's denials and emits the
// event: a request never waits for the policy's lock, nor for the event's
// handlers (a webhook, say).
type denialNotes struct {
	queue   chan denialNote
	stop    chan struct{}
	stopped sync.Once
	// dropped counts the denials the queue had no room for, suppressed
	// those whose bucket there was no room to follow. Both are logged.
	dropped, suppressed atomic.Int64

	policy  string
	denials *denials
	logger  *zap.Logger
	// events emits rate_limit_exceeded in ctx; nil outside a server.
	events *caddyevents.App
	ctx    caddy.Context
}

// lossReportEvery spaces the logs of what the recorder lost.
const lossReportEvery = time.Second

// startNoting starts the goroutine that records a policy's denials into
// d; stop ends it.
func startNoting(policy string, d *denials, logger *zap.Logger, events *caddyevents.App, ctx caddy.Context) *denialNotes {
	n := &denialNotes{queue: make(chan denialNote, noteQueue), stop: make(chan struct{}),
		policy: policy, denials: d, logger: logger, events: events, ctx: ctx}
	go n.record()
	return n
}

// end ends the recorder; denials still queued are dropped with the config
// they belong to. Requests still running may go on noting: the queue
// fills, and then counts what it drops.
func (n *denialNotes) end() {
	if n != nil {
		n.stopped.Do(func() { close(n.stop) })
	}
}

// note hands a denial to the recorder, without waiting: when the queue is
// full, the denial is dropped and counted.
func (n *denialNotes) note(d *decision) {
	note := denialNote{
		key:   denialKey{tier: d.tier.Name, keyer: d.bucket.Keyer, keyID: d.keyID()},
		at:    d.start,
		mono:  localClock(),
		retry: time.Duration(d.retryAfterSeconds()) * time.Second,
	}
	select {
	case n.queue <- note:
	default:
		n.dropped.Add(1)
	}
}

// record records each denial for GET /rate_limit/top and, when its bucket
// starts being denied, emits rate_limit_exceeded: once per bucket until it
// could allow again, never once per request of a flood.
func (n *denialNotes) record() {
	var lost lossReport
	for {
		var note denialNote
		select {
		case <-n.stop:
			return
		case note = <-n.queue:
		}
		if note.flushed != nil {
			close(note.flushed)
			continue
		}
		started, followed := n.denials.record(note.key, note.at, note.mono, note.retry)
		if !followed {
			n.suppressed.Add(1)
		}
		lost.log(n)
		if !started || n.events == nil || !n.events.ShouldEmit(exceededEvent) {
			continue
		}
		n.events.Emit(n.ctx, exceededEvent, map[string]any{
			"policy":      n.policy,
			"tier":        note.key.tier,
			"keyer":       note.key.keyer,
			"key_id":      note.key.keyID,
			"retry_after": int(note.retry / time.Second),
		})
	}
}

// lossReport is what the recorder last logged of its losses, and when.
type lossReport struct {
	dropped, suppressed int64
	at                  time.Time
}

// log reports the recorder's losses when they grew, at most once every
// lossReportEvery: the totals since the handler started.
func (r *lossReport) log(n *denialNotes) {
	dropped, suppressed := n.dropped.Load(), n.suppressed.Load()
	if dropped == r.dropped && suppressed == r.suppressed {
		return
	}
	now := time.Now()
	if now.Sub(r.at) < lossReportEvery {
		return
	}
	n.logger.Warn("too many denials to follow: some left out of /rate_limit/top, some rate_limit_exceeded events not emitted",
		zap.String("policy", n.policy),
		zap.Int64("denials_dropped", dropped),
		zap.Int64("events_suppressed", suppressed),
		zap.Int("buckets_followed_at_most", maxExceeded))
	*r = lossReport{dropped: dropped, suppressed: suppressed, at: now}
}

// flush waits until every denial noted so far is recorded and its event
// emitted. For tests.
func (n *denialNotes) flush() {
	flushed := make(chan struct{})
	n.queue <- denialNote{flushed: flushed}
	<-flushed
}
