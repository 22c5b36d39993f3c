package redisbucket

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// In-flight limits (docs/concurrency.md): the slots of a bucket
// are one sorted set, <bucket key>:c, of slot ids scored by the
// microsecond at which each expires. A node takes a slot by one script
// call, renews the slots it holds while their requests run, and frees
// them, pipelined, when they end; a node that dies stops renewing, so its
// slots expire within slot_ttl.

// DefaultSlotTTL is how long a slot lives without renewal.
const DefaultSlotTTL = 30 * time.Second

// MinSlotTTL is the shortest slot TTL that renewals on a connection of
// this timeout (0 for the default) keep alive: renewals leave every third
// of the TTL, each in one pipeline that lands within the timeout, so with
// a TTL of three timeouts one lands at most two thirds of the TTL after
// the last (and the first, even when the acquire's answer took a whole
// timeout to come back, by the slot's expiry). A shorter TTL could let a
// held slot expire, and another request take it.
func MinSlotTTL(timeout time.Duration) time.Duration {
	return 3 * cmp.Or(timeout, DefaultTimeout)
}

// slotsLua applies one operation to a bucket's slots, by the Redis
// server's clock. KEYS[1] is the sorted set. ARGV: the operation
// (acquire, renew or count); microseconds to add to TIME, which only tests
// set; the slot TTL (µs); then, for acquire, the most slots, the new
// slot's id and the ids of slots this node freed whose frees are still on
// their way (slotTable.unsent), removed first; for renew, the ids. It
// answers {taken or renewed, in use}.
const slotsLua = `
if redis.replicate_commands then redis.replicate_commands() end
local op = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local ms = math.floor(ttl / 1000) + 1
-- The set lives as long as its latest slot: a node with a shorter
-- slot_ttl never shortens the life of another's.
local function extend()
  if redis.call('PTTL', KEYS[1]) < ms then redis.call('PEXPIRE', KEYS[1], ms) end
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if op == 'acquire' then
  for i = 6, #ARGV do redis.call('ZREM', KEYS[1], ARGV[i]) end
  local used = redis.call('ZCARD', KEYS[1])
  if used >= tonumber(ARGV[4]) then return {0, used} end
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[5])
  extend()
  return {1, used + 1}
end
if op == 'renew' then
  local n = 0
  for i = 4, #ARGV do n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now + ttl, ARGV[i]) end
  if n > 0 then extend() end
  return {n, redis.call('ZCARD', KEYS[1])}
end
if op == 'count' then return {0, redis.call('ZCARD', KEYS[1])} end
return redis.error_reply('rate_limit: unknown slots operation ' .. tostring(op))
`

var slotsScript = redis.NewScript(slotsLua)

// slotTable is what slots this node holds, to renew them, and the frees
// on their way to Redis.
type slotTable struct {
	s    *Store
	node string
	ttl  time.Duration
	seq  atomic.Uint64

	mu   sync.Mutex
	held map[uint64]string // slot id -> its set's key
	// doubt are frees to send again: of slots whose acquire failed,
	// which may have been taken, and frees that did not reach Redis. The
	// retry (freeRetry), the next renewal and the close send them, until
	// each has reached Redis or its slot has expired there.
	doubt []slotFree
	// unsent are the slots freed on this node whose frees are queued, by
	// their set's key: the next acquire on the set removes them first, so
	// that a client whose request ended is not refused for it while its
	// free is on its way.
	unsent map[string][]uint64
	// retiring: the store closed; the loops stop when the last slot held
	// is freed. stopped: they stop or have; idle is closed once they have.
	// doubtTaken: the close has sent the doubtful frees; none is kept now.
	retiring, stopped, doubtTaken bool
	stopOnce                      sync.Once
	idle                          chan struct{}

	frees chan slotFree
	// retry asks the renewal loop to send the doubtful frees soon.
	retry chan struct{}
	stop  chan struct{}
	done  sync.WaitGroup
}

// slotFree is one slot to free. until, once the free is doubtful, is when
// the slot has surely expired in Redis (the table's clock): no need to
// send it after.
type slotFree struct {
	key   string
	id    uint64
	until int64
}

const (
	// maxFreeBatch bounds the frees sent in one pipeline.
	maxFreeBatch = 256
	// maxDoubt bounds the doubtful frees kept; past it the oldest are
	// left to expire within slot_ttl.
	maxDoubt = 1 << 16
	// freeRetry is how soon frees that did not reach Redis go again, so
	// that a slot whose free a blip or a failover lost does not hold its
	// client off until the slot expires (up to slot_ttl).
	freeRetry = time.Second
)

// slotTTL is ttl, or the default.
func slotTTL(ttl time.Duration) time.Duration {
	if ttl <= 0 {
		return DefaultSlotTTL
	}
	return ttl
}

func newSlotTable(s *Store, ttl time.Duration) *slotTable {
	t := &slotTable{s: s, node: newNodeID(), ttl: slotTTL(ttl), held: map[uint64]string{}, unsent: map[string][]uint64{}, frees: make(chan slotFree, 4096), retry: make(chan struct{}, 1), stop: make(chan struct{}), idle: make(chan struct{})}
	t.done.Add(2)
	go t.freeLoop()
	go t.renewLoop()
	return t
}

// member is a slot's member in its set: the node, then the slot.
func (t *slotTable) member(id uint64) string { return member(t.node, id) }

func member(node string, id uint64) string { return node + ":" + strconv.FormatUint(id, 36) }

// slotKey is the set of the bucket at key.
func slotKey(key []byte) string { return string(key) + ":c" }

// Acquire takes one of n slots of the bucket at key for a request: it
// reports whether it got one, how many are in use with it, and the id to
// free it by.
func (s *Store) Acquire(ctx context.Context, key []byte, n int64) (id uint64, inUse int64, ok bool, err error) {
	t := s.slotTable()
	if t == nil {
		// A request still in flight through an unloaded config: it takes
		// no slot that no one would renew.
		return 0, 0, false, ErrSlotsClosed
	}
	id = t.seq.Add(1)
	k := slotKey(key)
	args := []any{n, t.member(id)}
	t.mu.Lock()
	for _, freed := range t.unsent[k] {
		args = append(args, t.member(freed))
	}
	t.mu.Unlock()
	vals, err := s.runSlots(ctx, k, "acquire", args...)
	if err != nil || vals[0] != 1 {
		if err != nil {
			if !errors.Is(err, errBreakerOpen) {
				// The call may have taken the slot before its answer was
				// lost: free it, now and once more later, in case the
				// free arrives first.
				t.doubtful(slotFree{key: k, id: id})
			}
			return 0, 0, false, err
		}
		return id, vals[1], false, nil
	}
	t.mu.Lock()
	stopped := t.stopped
	if !stopped {
		t.held[id] = k
	}
	t.mu.Unlock()
	if stopped {
		// The store closed while the call was out, and its loops are gone:
		// the slot is freed at once.
		t.send([]slotFree{{key: k, id: id}})
		return 0, 0, false, ErrSlotsClosed
	}
	return id, vals[1], true, nil
}

// doubtful frees a slot that a failed call may have taken: now, and
// again later (doubt).
func (t *slotTable) doubtful(f slotFree) {
	t.mu.Lock()
	stopped := t.stopped
	if !stopped {
		t.keepLocked([]slotFree{f})
	}
	t.mu.Unlock()
	if stopped {
		t.send([]slotFree{f})
		return
	}
	select {
	case t.frees <- f:
	default:
	}
}

// Release frees the slot id of the bucket at key, pipelined with others.
// It does not wait for Redis: a free that does not arrive is sent again
// (doubt).
func (s *Store) Release(key []byte, id uint64) {
	s.slotsMu.Lock()
	t := s.slots
	s.slotsMu.Unlock()
	if t == nil {
		return // never took one
	}
	k := slotKey(key)
	t.mu.Lock()
	delete(t.held, id)
	// Queued under the lock: the last free's stop sends every free queued
	// before it.
	queued := true
	select {
	case t.frees <- slotFree{key: k, id: id}:
		t.unsent[k] = append(t.unsent[k], id)
	default:
		queued = false
	}
	last := t.retiring && len(t.held) == 0 && !t.stopped
	if last {
		t.stopped = true
	}
	t.mu.Unlock()
	if !queued {
		// The queue is full: this one goes on its own.
		t.send([]slotFree{{key: k, id: id}})
	}
	if last {
		t.stopLoops()
	}
}

// InFlight is the slots of the bucket at key in use, fleet-wide.
func (s *Store) InFlight(ctx context.Context, key []byte) (int64, error) {
	vals, err := s.runSlots(ctx, slotKey(key), "count")
	if err != nil {
		return 0, err
	}
	return vals[1], nil
}

// runSlots runs the slots script on k (Store.do).
func (s *Store) runSlots(ctx context.Context, k, op string, args ...any) ([]int64, error) {
	argv := append([]any{op, s.clockOffset, slotTTL(s.slotTTL).Microseconds()}, args...)
	var vals []int64
	err := s.do(ctx, func(ctx context.Context, set *clientSet) (err error) {
		cmd, took := runTimed(ctx, slotsScript, set.client, set.handshakes, []string{k}, argv...)
		vals, err = cmd.Int64Slice()
		if err == nil && len(vals) != 2 {
			err = fmt.Errorf("slots script answered %d values, want 2", len(vals))
		}
		if err == nil {
			s.sample(took)
		}
		return err
	})
	if err != nil {
		return nil, err
	}
	return vals, nil
}

// ErrSlotsClosed refuses a slot to a request of a config that unloaded:
// its handler takes the slot from the running config's store instead.
var ErrSlotsClosed = errors.New("redis store: the config unloaded; no new slot")

// slotTable is the store's slots for a new slot, made on first use; nil
// once the store closed.
func (s *Store) slotTable() *slotTable {
	s.slotsMu.Lock()
	defer s.slotsMu.Unlock()
	if s.slotsClosed {
		return nil
	}
	if s.slots == nil {
		s.slots = newSlotTable(s, s.slotTTL)
	}
	return s.slots
}
