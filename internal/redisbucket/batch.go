package redisbucket

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisBatcher sends concurrent decisions to Redis together. Each of its
// loops takes the decisions waiting, up to maxBatch, and sends them as one
// pipeline of EVALSHA, so that n decisions cost Redis and Caddy one write
// and one read instead of n. A decision still makes one round trip (two
// when Redis has lost the script, as with Script.Run), and its caller
// waits no longer than its own deadline allows.
//
// batchLoops pipelines may be in flight at once: measured best of 1 to 8
// on 2 CPUs (BenchmarkRedisBatch).
//
// A caller alone, with no other decision waiting or in flight, sends its
// own EVALSHA at once: going through a loop would only add a hand-over to
// its round trip (BenchmarkRedisTake, serial).
//
// A queued caller makes no context of its own: it waits on its call's
// signal, its request's context and a timer from a pool, and the pipeline
// runs under one deadline, its most patient caller's
// (TestQueuedStrictTakesAllocateLittle, BenchmarkRedisTake's cpu-ns/op).
type redisBatcher struct {
	client     redis.UniversalClient
	handshakes *handshakes
	queue      chan *batchCall
	stop       chan struct{}
	maxBatch   int
	callers    atomic.Int64 // decisions in take now
}

// batchCall is one queued decision. The caller that gets its answer puts
// it back in callPool; one that stopped waiting leaves it to the loop,
// which may still write to it, and to the garbage collector.
type batchCall struct {
	ctx context.Context
	// deadline bounds the call besides ctx's own (zero: none).
	deadline time.Time
	args     []any // the whole EVALSHA (scriptArgs)
	vals     []int64
	err      error
	// took is the pipeline's time from its write to its reply (µs).
	took int64
	// done gets one value when the call is answered.
	done chan struct{}
}

var callPool = sync.Pool{New: func() any { return &batchCall{done: make(chan struct{}, 1)} }}

// timerPool holds stopped timers with nothing in their channels, so that
// a queued caller's wait costs no allocation (one that timed out may).
var timerPool = sync.Pool{New: func() any {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return t
}}

const (
	batchLoops = 4
	maxBatch   = 128
)

func newRedisBatcher(client redis.UniversalClient, h *handshakes, loops, maxBatch int) *redisBatcher {
	b := &redisBatcher{client: client, handshakes: h, queue: make(chan *batchCall, loops*maxBatch), stop: make(chan struct{}), maxBatch: maxBatch}
	for range loops {
		go b.loop()
	}
	return b
}

func (b *redisBatcher) close() { close(b.stop) }

// take runs the script on keys with args, batched with whatever other
// decisions are waiting, within ctx (takeBy).
func (b *redisBatcher) take(ctx context.Context, keys []string, args []any) ([]int64, int64, error) {
	d, _ := ctx.Deadline()
	return b.takeBy(ctx, d, scriptArgs(keys[0], args))
}

// takeBy runs the script call args (scriptArgs), batched with whatever
// other decisions are waiting, until ctx ends or the deadline (zero:
// none). It reports how long the call took from its write to its reply
// (µs): a batched call's pipeline's, not its wait in the queue; -1 when
// that was no round trip alone (callTimer).
func (b *redisBatcher) takeBy(ctx context.Context, deadline time.Time, args []any) ([]int64, int64, error) {
	defer b.callers.Add(-1)
	if b.callers.Add(1) == 1 {
		select {
		case <-b.stop:
			return nil, 0, redis.ErrClosed
		default:
		}
		return runScriptBy(ctx, deadline, b.client, b.handshakes, args)
	}
	var expired <-chan time.Time
	var fired bool // the tick was received
	if !deadline.IsZero() {
		t := timerPool.Get().(*time.Timer)
		t.Reset(time.Until(deadline))
		defer func() {
			// A timer goes back only with nothing to come in t.C: stopped
			// before it fired, or its tick received. One that fired
			// unreceived is dropped: with GODEBUG=asynctimerchan=1 its tick
			// may land after Stop and a drain, and would end the next
			// caller's wait at once.
			if t.Stop() || fired {
				timerPool.Put(t)
			}
		}()
		expired = t.C
	}
	c := callPool.Get().(*batchCall)
	c.ctx, c.deadline, c.args = ctx, deadline, args
	select {
	case b.queue <- c:
	case <-b.stop:
		return nil, 0, redis.ErrClosed
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	case <-expired:
		fired = true
		return nil, 0, context.DeadlineExceeded
	}
	select {
	case <-c.done:
		vals, took, err := c.vals, c.took, c.err
		*c = batchCall{done: c.done}
		callPool.Put(c)
		return vals, took, err
	case <-b.stop:
		return nil, 0, redis.ErrClosed
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	case <-expired:
		// A loop may still answer c: it is not put back.
		fired = true
		return nil, 0, context.DeadlineExceeded
	}
}

func (b *redisBatcher) loop() {
	batch := make([]*batchCall, 0, b.maxBatch)
	var s sender
	for {
		select {
		case c := <-b.queue:
			batch = append(batch[:0], c)
		case <-b.stop:
			return
		}
		batch = drain(b.queue, batch, b.maxBatch)
		s.send(b, batch)
		// No call outlives its batch here: one whose caller gave up would
		// keep its request's context until the slot is reused.
		clear(batch)
		clear(s.live)
	}
}

// drain appends to batch what already waits on ch, up to most in all,
// without waiting for more.
func drain[T any](ch <-chan T, batch []T, most int) []T {
	for len(batch) < most {
		select {
		case v := <-ch:
			batch = append(batch, v)
		default:
			return batch
		}
	}
	return batch
}

// sender is one loop's buffers, reused from batch to batch.
type sender struct {
	live []*batchCall
	cmds []*redis.IntSliceCmd
}

// answer gives c its answer; its caller may have stopped waiting.
func (c *batchCall) answer(vals []int64, took int64, err error) {
	c.vals, c.took, c.err = vals, took, err
	c.done <- struct{}{}
}

// send runs one batch. The pipeline may take as long as the most patient
// caller; the others stop waiting at their own deadlines.
func (s *sender) send(b *redisBatcher, batch []*batchCall) {
	var deadline time.Time
	patient := false // a caller without a deadline waits as long as it takes
	now := time.Now()
	live := s.live[:0]
	for _, c := range batch {
		d, ok := c.ctx.Deadline()
		if !c.deadline.IsZero() && (!ok || c.deadline.Before(d)) {
			d, ok = c.deadline, true
		}
		switch {
		case c.ctx.Err() != nil:
			c.answer(nil, 0, c.ctx.Err())
			continue
		case ok && !now.Before(d):
			c.answer(nil, 0, context.DeadlineExceeded)
			continue
		}
		patient = patient || !ok
		if d.After(deadline) {
			deadline = d
		}
		live = append(live, c)
	}
	s.live = live
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if !patient {
		ctx, cancel = context.WithDeadline(ctx, deadline)
	}
	defer cancel()
	call := b.handshakes.startCall()
	pipe := b.client.Pipeline()
	cmds := s.cmds[:0]
	for _, c := range live {
		cmd := scriptCmd(ctx, c.args)
		_ = pipe.Process(ctx, cmd)
		cmds = append(cmds, cmd)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	var lost []*redis.Cmd
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			// Redis lost the script (a restart, a failover, SCRIPT FLUSH):
			// EVAL sends it again, and loads it.
			if lost == nil {
				lost = make([]*redis.Cmd, len(cmds))
				pipe = b.client.Pipeline()
			}
			lost[i] = evalScript(ctx, pipe, live[i].args)
		}
	}
	if lost != nil {
		_, _ = pipe.Exec(ctx)
	}
	took := call.took()
	if lost != nil {
		// Two pipelines: no round trip alone (runTimed).
		took = -1
	}
	for i, c := range live {
		var vals []int64
		var err error
		if lost != nil && lost[i] != nil {
			vals, err = lost[i].Int64Slice()
		} else {
			vals, err = cmds[i].Result()
		}
		c.answer(vals, took, err)
	}
	clear(cmds)
	clear(live)
	s.cmds = cmds
}

// scriptArgs are the arguments of one call of the bucket script on key
// with args: EVALSHA, the script's hash, one key, the key, then args.
func scriptArgs(key string, args []any) []any {
	head := scriptHead(key)
	all := make([]any, 0, 4+len(args))
	return append(append(all, head[:]...), args...)
}

// scriptHead is the start of scriptArgs, before the script's own
// arguments.
func scriptHead(key string) [4]any {
	return [4]any{"evalsha", bucketHash(), 1, key}
}

// hashed is a script and its hash, boxed once: a call's arguments are
// interfaces, and boxing a string allocates.
type hashed struct {
	script *redis.Script
	hash   any
}

var lastHash atomic.Pointer[hashed]

// bucketHash is bucketScript's hash, boxed. Tests swap bucketScript for
// a broken copy: the hash follows it.
func bucketHash() any {
	script := bucketScript
	if h := lastHash.Load(); h != nil && h.script == script {
		return h.hash
	}
	h := &hashed{script: script, hash: script.Hash()}
	lastHash.Store(h)
	return h.hash
}

// scriptCmd is the call args (scriptArgs) as a command whose reply is read
// as integers, with no []any and no boxing per value as redis.Cmd reads
// it. The key is the third argument, for a Cluster's routing.
func scriptCmd(ctx context.Context, args []any) *redis.IntSliceCmd {
	cmd := redis.NewIntSliceCmd(ctx, args...)
	cmd.SetFirstKeyPos(3)
	return cmd
}

// evalScript sends the call args (scriptArgs) again as EVAL of the
// script's text, which loads it.
func evalScript(ctx context.Context, c redis.Scripter, args []any) *redis.Cmd {
	return bucketScript.Eval(ctx, c, []string{args[3].(string)}, args[4:]...)
}

// runScriptBy runs the call args (scriptArgs) alone, as runTimed does,
// within ctx and the deadline (zero: none).
func runScriptBy(ctx context.Context, deadline time.Time, c scripter, h *handshakes, args []any) ([]int64, int64, error) {
	if d, ok := ctx.Deadline(); !deadline.IsZero() && (!ok || d.After(deadline)) {
		// A context that ends by the deadline already (doAside's, do's)
		// needs no second one: a context, a timer and a channel a call.
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, deadline)
		defer cancel()
	}
	call := h.startCall()
	cmd := scriptCmd(ctx, args)
	_ = c.Process(ctx, cmd)
	if isNoScript(cmd.Err()) {
		vals, err := evalScript(ctx, c, args).Int64Slice()
		return vals, -1, err
	}
	vals, err := cmd.Result()
	return vals, call.took(), err
}

// scripter sends a command alone, or queues it in a pipeline.
type scripter interface {
	redis.Scripter
	Process(context.Context, redis.Cmder) error
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || strings.HasPrefix(err.Error(), "NOSCRIPT"))
}
