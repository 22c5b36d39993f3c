package redisbucket

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// TestRedisStoreUsesRedisTime shows that Redis buckets are kept in the
// Redis server's TIME: the script's state for a bucket is full at exactly
// the server time of the decision plus the refill, and that server time
// lies between two TIME readings taken around it. Two stores (two nodes)
// send no time of their own, so their clocks cannot disagree about a
// bucket: the second node's decision on the first node's bucket is exact.
func TestRedisStoreUsesRedisTime(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	one := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	two := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	redisTime := func() int64 {
		v := srv.Do("TIME").([]any)
		sec, _ := strconv.ParseInt(v[0].(string), 10, 64)
		usec, _ := strconv.ParseInt(v[1].(string), 10, 64)
		return sec*1_000_000 + usec
	}
	l := slowLimit(5) // one token an hour
	b := bucketFor("clock")
	key := string(b)
	if key != string(b) {
		t.Fatal("two nodes name one bucket differently")
	}

	lo := redisTime()
	res, now, err := one.run(bg, key, l, 1)
	hi := redisTime()
	if err != nil || !res.Allowed {
		t.Fatalf("take: %+v, %v", res, err)
	}
	if now < lo || now > hi {
		t.Fatalf("the script decided at %d, outside the Redis TIME readings %d..%d around it", now, lo, hi)
	}
	fullAt, slack := redisBucketState(t, srv, key)
	if fullAt != now+res.ResetAfter || res.ResetAfter != l.Rate.Interval || slack != 0 {
		t.Fatalf("state %d %d after one token at Redis time %d: want full at %d (one interval later), slack 0", fullAt, slack, now, now+l.Rate.Interval)
	}

	// The second node takes the rest and is then denied, with the retry
	// time counted from the same Redis clock.
	for i := range 4 {
		res, now2, err := two.run(bg, key, l, 1)
		if err != nil || !res.Allowed {
			t.Fatalf("node two, take %d: %+v, %v", i+2, res, err)
		}
		fullAt, _ = redisBucketState(t, srv, key)
		if fullAt != now2+res.ResetAfter {
			t.Fatalf("node two, take %d: full at %d, want Redis time %d + %d", i+2, fullAt, now2, res.ResetAfter)
		}
	}
	res, now3, err := two.run(bg, key, l, 1)
	if err != nil || res.Allowed {
		t.Fatalf("sixth take: %+v, %v; want denied", res, err)
	}
	// The first token comes back one interval after the first take.
	if want := now + l.Rate.Interval - now3; res.RetryAfter != want {
		t.Fatalf("retry after %d µs, want %d: one interval after the first take, in Redis time", res.RetryAfter, want)
	}
}

// redisBucketState reads a bucket's "<fullAt> <slack>" from Redis.
func redisBucketState(t *testing.T, srv *redistest.Server, key string) (int64, int64) {
	t.Helper()
	v, _ := srv.Do("GET", key).(string)
	a, b, ok := strings.Cut(v, " ")
	fullAt, err1 := strconv.ParseInt(a, 10, 64)
	slack, err2 := strconv.ParseInt(b, 10, 64)
	if !ok || err1 != nil || err2 != nil {
		t.Fatalf("key %s holds %q, not a bucket", key, v)
	}
	return fullAt, slack
}
