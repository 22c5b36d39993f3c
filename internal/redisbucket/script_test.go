package redisbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
	"strings"
	"testing"
)

// TestRedisScriptReplicatesEffectsBeforeItReadsTime checks the script's
// first statement: before it reads TIME it asks for effects replication,
// which Redis 3.2 and 4 need to let it write after TIME, and which is
// guarded so that a Redis without the call (7 and later may drop it) runs
// the script all the same. The Redis tests run it on the installed Redis;
// no older Redis is at hand, so this reads the source.
func TestRedisScriptReplicatesEffectsBeforeItReadsTime(t *testing.T) {
	const want = "if redis.replicate_commands then redis.replicate_commands() end"
	first, _, _ := strings.Cut(strings.TrimSpace(bucketLua), "\n")
	if first != want {
		t.Fatalf("the script opens with %q, want %q", first, want)
	}
	if strings.Index(bucketLua, want) > strings.Index(bucketLua, "redis.call('TIME')") {
		t.Fatal("the script reads TIME before it asks for effects replication")
	}
}

// TestRedisScriptExplainsARefusedWrite makes Redis refuse the script's
// write (maxmemory reached, the nearest a current Redis comes to the
// refusal of an old one) and checks that the error says what happened.
func TestRedisScriptExplainsARefusedWrite(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}})
	srv.Do("SET", "ballast", strings.Repeat("x", 1<<20))
	srv.Do("CONFIG", "SET", "maxmemory-policy", "noeviction")
	srv.Do("CONFIG", "SET", "maxmemory", "1")
	_, err := s.takeLimit(bg, bucketFor("refused"), slowLimit(5), 1)
	srv.Do("CONFIG", "SET", "maxmemory", "0")
	if err == nil || !strings.Contains(err.Error(), "rate_limit: Redis refused to write the bucket") {
		t.Fatalf("take with the write refused: %v, want the script to say the write was refused", err)
	}
}
