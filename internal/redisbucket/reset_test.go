package redisbucket

import (
	"context"
	"sync"
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"github.com/redis/go-redis/v9"
)

// TestRedisResetDuringATakeLeavesNoStaleDenial resets a bucket after Redis
// denied a Take but before the Take remembered the denial. The denial
// predates the reset, so the deny cache must not keep it: the next Take
// goes to Redis, where the bucket is full again.
func TestRedisResetDuringATakeLeavesNoStaleDenial(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	off := false
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Batch: &off})
	hook := new(afterScriptHook)
	s.conn.client().AddHook(hook)
	b := bucketFor("reset-race")
	if res, err := s.takeLimit(bg, b, slowLimit(1), 1); err != nil || !res.Allowed {
		t.Fatalf("first take: %+v, %v", res, err)
	}
	// The first take left the bucket empty, which the deny cache learned
	// from its answer: forget that, so that the second asks Redis.
	s.conn.denied.remove(string(b))

	hook.mu.Lock()
	hook.then = func() {
		if err := s.Reset(bg, b); err != nil {
			t.Errorf("reset: %v", err)
		}
	}
	hook.mu.Unlock()
	if res, err := s.takeLimit(bg, b, slowLimit(1), 1); err != nil || res.Allowed {
		t.Fatalf("second take, on the empty bucket: %+v, %v; want denied", res, err)
	}
	if n := srv.Do("EXISTS", string(b)).(int64); n != 0 {
		t.Fatal("the reset did not delete the bucket in Redis")
	}
	if res, err := s.takeLimit(bg, b, slowLimit(1), 1); err != nil || !res.Allowed {
		t.Fatalf("take after the reset: %+v, %v; want allowed: a denial from before the reset was kept", res, err)
	}
}

// afterScriptHook runs a function once, right after Redis has answered
// the next script call: a test's way to slip an event between Redis's
// decision and the store's handling of it.
type afterScriptHook struct {
	mu   sync.Mutex
	then func()
}

func (h *afterScriptHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h *afterScriptHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *afterScriptHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if name := cmd.Name(); name == "evalsha" || name == "eval" {
			h.mu.Lock()
			then := h.then
			h.then = nil
			h.mu.Unlock()
			if then != nil {
				then()
			}
		}
		return err
	}
}
