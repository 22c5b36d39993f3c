package redisbucket

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// Conn is a connection to Redis that every config with the same settings
// shares, and that outlives reloads: the client, its circuit breaker, its
// deny cache and its batcher.
type Conn struct {
	client       redis.UniversalClient
	breaker      breaker
	denied       *denyCache
	batcher      *redisBatcher // nil unless Batch
	timeout      time.Duration
	denyCapacity int
	stop         context.CancelFunc
	// now is the breaker's and the deny cache's clock, monotonic
	// microseconds; tests replace it.
	now func() int64
}

// Connect makes the connection's client. It connects and loads the script
// in the background, so that the first decisions do not pay for it within
// their timeout; a Redis that is down is no error here: decisions say so.
func (p *Plan) Connect(logger *zap.Logger) *Conn {
	o := p.o
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	// A flapping Redis turns the breaker often; a few lines a second say so.
	logger = logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 2, 0)
	}))
	c := &Conn{
		client: p.newClient(),
		breaker: breaker{threshold: int64(o.BreakerFailures), cooldown: o.BreakerCooldown.Microseconds(), changed: func(open bool) {
			if open {
				logger.Error("redis store unreachable: circuit breaker open, on_store_error decides", zap.Int("failures", o.BreakerFailures), zap.Duration("cooldown", o.BreakerCooldown))
			} else {
				logger.Warn("redis store answering again: circuit breaker closed")
			}
		}},
		denied:       newDenyCache(o.DenyCacheSize),
		timeout:      o.Timeout,
		denyCapacity: o.DenyCacheSize,
		stop:         cancel,
		now:          monotonicMicros,
	}
	if o.Batch {
		c.batcher = newRedisBatcher(c.client, batchLoops, maxBatch)
	}
	go func() {
		defer cancel()
		_ = bucketScript.Load(ctx, c.client).Err()
	}()
	return c
}

// Close closes the client.
func (c *Conn) Close() error {
	c.stop()
	if c.batcher != nil {
		c.batcher.close()
	}
	return c.client.Close()
}

// processStart anchors the monotonic clock; one is added so that time 0
// is before every reading.
var processStart = time.Now()

func monotonicMicros() int64 { return time.Since(processStart).Microseconds() + 1 }
