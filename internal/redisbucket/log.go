package redisbucket

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// logRoute is where lines go: the logger of its newest user, or its
// fallback when it has none. A connection outlives the config that made
// it, whose log is closed once that config unloads, so each config that
// uses the connection hands it its logger (Conn.UseLogger). Lines read it
// with one atomic load.
type logRoute struct {
	cur atomic.Pointer[zap.Logger]

	mu       sync.Mutex
	fallback *zap.Logger
	users    []*logUser // the newest last
}

// logUser is one use of a route: the same logger may be handed twice.
type logUser struct{ logger *zap.Logger }

// logger is the logger in use, nil before any.
func (r *logRoute) logger() *zap.Logger { return r.cur.Load() }

// fallBackTo makes logger take the lines while the route has no user.
func (r *logRoute) fallBackTo(logger *zap.Logger) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fallback = logger
	r.point()
}

// use makes logger take the lines until a newer user comes or release is
// called.
func (r *logRoute) use(logger *zap.Logger) (release func()) {
	u := &logUser{logger}
	r.mu.Lock()
	r.users = append(r.users, u)
	r.point()
	r.mu.Unlock()
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		if i := slices.Index(r.users, u); i >= 0 {
			r.users = slices.Delete(r.users, i, i+1)
			r.point()
		}
	}
}

// point sets the logger in use, under mu.
func (r *logRoute) point() {
	if n := len(r.users); n > 0 {
		r.cur.Store(r.users[n-1].logger)
		return
	}
	r.cur.Store(r.fallback)
}

// sampled is logger, sampled: a flapping Redis turns the breaker often,
// and a few lines a second say so. A nil logger writes nothing.
func sampled(logger *zap.Logger) *zap.Logger {
	if logger == nil {
		return zap.NewNop()
	}
	return logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 2, 0)
	}))
}

// go-redis writes its own lines (a failed dial, a Sentinel's new master)
// through one logger for the whole process, by default as plain text on
// stderr, past Caddy's log and its sampling. They go to goRedisRoute: the
// logger of the newest config that uses a connection, sampled as the
// connection's own lines are, under one message so that the sampling
// holds however they vary.
var (
	goRedisRoute   logRoute
	goRedisLogOnce sync.Once
)

func routeGoRedisLog() {
	goRedisLogOnce.Do(func() { redis.SetLogger(goRedisLog{}) })
}

// goRedisLog is go-redis's logger, writing to goRedisRoute.
type goRedisLog struct{}

func (goRedisLog) Printf(_ context.Context, format string, v ...any) {
	l := goRedisRoute.logger()
	if l == nil {
		return
	}
	msg := strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: ")
	level := zapcore.InfoLevel
	if strings.Contains(msg, "fail") || strings.Contains(msg, "error") || strings.Contains(msg, "bad") {
		level = zapcore.WarnLevel
	}
	if ce := l.Check(level, "redis client"); ce != nil {
		ce.Write(zap.String("said", msg))
	}
}
