package redisbucket

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisBatcher sends concurrent decisions to Redis together. Each of its
// loops takes the decisions waiting, up to maxBatch, and sends them as one
// pipeline of EVALSHA, so that n decisions cost Redis and Caddy one write
// and one read instead of n. A decision still makes one round trip (two
// when Redis has lost the script, as with Script.Run), and its caller
// waits no longer than its own context allows.
//
// batchLoops pipelines may be in flight at once: measured best of 1 to 8
// on 2 CPUs (BenchmarkRedisBatch).
//
// A caller alone, with no other decision waiting or in flight, sends its
// own EVALSHA at once: going through a loop would only add a hand-over to
// its round trip (BenchmarkRedisTake, serial).
type redisBatcher struct {
	client     redis.UniversalClient
	handshakes *handshakes
	queue      chan *batchCall
	stop       chan struct{}
	maxBatch   int
	callers    atomic.Int64 // decisions in take now
}

type batchCall struct {
	ctx  context.Context
	keys []string
	args []any
	vals []int64
	err  error
	// took is the pipeline's time from its write to its reply (µs).
	took int64
	done chan struct{}
}

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
// decisions are waiting. It reports how long the call took from its write
// to its reply (µs): a batched call's pipeline's, not its wait in the
// queue; -1 when that was no round trip alone (callTimer).
func (b *redisBatcher) take(ctx context.Context, keys []string, args []any) ([]int64, int64, error) {
	defer b.callers.Add(-1)
	if b.callers.Add(1) == 1 {
		select {
		case <-b.stop:
			return nil, 0, redis.ErrClosed
		default:
		}
		cmd, took := runTimed(ctx, bucketScript, b.client, b.handshakes, keys, args...)
		vals, err := cmd.Int64Slice()
		return vals, took, err
	}
	c := &batchCall{ctx: ctx, keys: keys, args: args, done: make(chan struct{})}
	select {
	case b.queue <- c:
	case <-b.stop:
		return nil, 0, redis.ErrClosed
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	}
	select {
	case <-c.done:
		return c.vals, c.took, c.err
	case <-b.stop:
		return nil, 0, redis.ErrClosed
	case <-ctx.Done():
		return nil, 0, ctx.Err()
	}
}

func (b *redisBatcher) loop() {
	batch := make([]*batchCall, 0, b.maxBatch)
	for {
		select {
		case c := <-b.queue:
			batch = append(batch[:0], c)
		case <-b.stop:
			return
		}
		b.send(drain(b.queue, batch, b.maxBatch))
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

// send runs one batch. The pipeline may take as long as the most patient
// caller; the others stop waiting at their own deadlines.
func (b *redisBatcher) send(batch []*batchCall) {
	var deadline time.Time
	patient := false // a caller without a deadline waits as long as it takes
	live := batch[:0:0]
	for _, c := range batch {
		if c.ctx.Err() != nil {
			c.err = c.ctx.Err()
			close(c.done)
			continue
		}
		d, ok := c.ctx.Deadline()
		patient = patient || !ok
		if d.After(deadline) {
			deadline = d
		}
		live = append(live, c)
	}
	if len(live) == 0 {
		return
	}
	ctx, cancel := context.Background(), context.CancelFunc(func() {})
	if !patient {
		ctx, cancel = context.WithDeadline(ctx, deadline)
	}
	defer cancel()
	call := b.handshakes.startCall()
	cmds := b.run(ctx, live, bucketScript.EvalSha)
	var lost []*batchCall
	var lostAt []int
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			lost = append(lost, live[i])
			lostAt = append(lostAt, i)
		}
	}
	if len(lost) > 0 {
		// Redis lost the script (a restart, a failover, SCRIPT FLUSH):
		// EVAL sends it again, and loads it.
		for j, cmd := range b.run(ctx, lost, bucketScript.Eval) {
			cmds[lostAt[j]] = cmd
		}
	}
	took := call.took()
	if len(lost) > 0 {
		// Two pipelines: no round trip alone (runTimed).
		took = -1
	}
	for i, c := range live {
		c.vals, c.err = cmds[i].Int64Slice()
		c.took = took
		close(c.done)
	}
}

func (b *redisBatcher) run(ctx context.Context, calls []*batchCall, eval func(context.Context, redis.Scripter, []string, ...any) *redis.Cmd) []*redis.Cmd {
	pipe := b.client.Pipeline()
	cmds := make([]*redis.Cmd, len(calls))
	for i, c := range calls {
		cmds[i] = eval(ctx, pipe, c.keys, c.args...)
	}
	_, _ = pipe.Exec(ctx) // each command carries its own error
	return cmds
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || strings.HasPrefix(err.Error(), "NOSCRIPT"))
}
