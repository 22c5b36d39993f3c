package localbucket

import (
	"sync/atomic"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// fakeClock is a clock that moves only when a test moves it.
type fakeClock struct{ micros atomic.Int64 }

func (c *fakeClock) now() int64              { return c.micros.Load() }
func (c *fakeClock) advance(d time.Duration) { c.micros.Add(d.Microseconds()) }

// monotonicMicros is a real monotonic clock, from 1.
func monotonicMicros() int64 { return time.Since(testStart).Microseconds() + 1 }

var testStart = time.Now()

func wallMicros() int64 { return time.Now().UnixMicro() }

// newStore is a store of maxKeys on the monotonic clock now and the real
// wall clock.
func newStore(maxKeys int, now func() int64) *Store {
	return New(Options{MaxKeys: maxKeys, Now: now, Wall: wallMicros})
}

// ids hashes the tests' bucket names, as the root's hasher does.
var ids = NewHasher()

// benchPrefix is the prefix of the tests' buckets: policy p, tier
// default, the client IP keyer.
var benchPrefix = ids.Prefix("p", "default", "ip/32/64")

// idFor is the id of the bucket of a client of value.
func idFor(value string) uint64 { return bucketID([]byte(value)) }

// bucketID is the id of the bucket of value, hashed as the root hashes a
// request's bucket: the prefix its handler hashed, and the value.
func bucketID(value []byte) uint64 { return ids.ID(benchPrefix, value) }

// lone is the tier of the one limit l.
func lone(l bucket.Limit) bucket.Tier { return bucket.Tier{Limits: []bucket.Limit{l}} }

// take is a request of cost on the tier of the one limit l.
func take(s *Store, id uint64, l bucket.Limit, cost int64) bucket.Result {
	var out [1]bucket.Result
	s.Take(id, lone(l), cost, out[:])
	return out[0]
}
