package redisbucket

import (
	"context"
	"crypto/sha256"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"go.uber.org/zap"
)

var bg = context.Background()

var nopLogger = zap.NewNop()

const second = int64(1_000_000)

// testConfig is what a test sets of a store: its connection and its view.
type testConfig struct {
	Addresses       []string
	Timeout         time.Duration
	Lease           string
	Batch           *bool
	BreakerFailures int
	BreakerCooldown time.Duration
}

// newTestStore connects a store of its own, as a node would, and closes it
// when the test ends.
func newTestStore(t testing.TB, c testConfig) *Store {
	t.Helper()
	batch := c.Batch == nil || *c.Batch
	plan, err := NewPlan(Options{Addresses: c.Addresses, Timeout: c.Timeout, Batch: batch, BreakerFailures: c.BreakerFailures, BreakerCooldown: c.BreakerCooldown})
	if err != nil {
		t.Fatal(err)
	}
	lease, err := ParseLeaseSize(c.Lease)
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	s := NewStore(conn, StoreOptions{Lease: lease})
	t.Cleanup(func() {
		s.Close()
		_ = conn.Close()
	})
	return s
}

// bucketFor is the key of a client's bucket in policy "p", catch-all tier,
// as the handler names it.
func bucketFor(value string) []byte {
	sum := sha256.Sum256([]byte("ip\x00" + value))
	return (&Store{prefix: DefaultPrefix}).AppendKey(nil, "p", "default", sum[:])
}

// slowLimit is a bucket that does not refill within a test.
func slowLimit(capacity int64) bucket.Limit {
	return bucket.Limit{Capacity: capacity, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
}

// fakeClock is a clock that moves only when a test moves it.
type fakeClock struct{ micros atomic.Int64 }

func (c *fakeClock) now() int64              { return c.micros.Load() }
func (c *fakeClock) advance(d time.Duration) { c.micros.Add(d.Microseconds()) }

func skipUnderShort(t *testing.T, kind string) {
	t.Helper()
	if testing.Short() {
		t.Skipf("%s test: skipped under -short", kind)
	}
}

// oneLimit is the tier of one limit l.
func oneLimit(l bucket.Limit) bucket.Tier { return bucket.Tier{Limits: []bucket.Limit{l}} }

// takeLimit is Take on the tier of one limit l: its result.
func (s *Store) takeLimit(ctx context.Context, key []byte, l bucket.Limit, cost int64) (bucket.Result, error) {
	var out [1]bucket.Result
	_, err := s.Take(ctx, key, oneLimit(l), cost, out[:])
	return out[0], err
}

// peekLimit is Peek on the tier of one limit l: its result.
func (s *Store) peekLimit(ctx context.Context, key []byte, l bucket.Limit) (bucket.Result, error) {
	var out [1]bucket.Result
	err := s.Peek(ctx, key, oneLimit(l), out[:])
	return out[0], err
}

// takeQuotas is Take on the tier of limits ls and quotas qs, with the
// limits' results in out and the quotas' in qout.
func (s *Store) takeQuotas(ctx context.Context, key []byte, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, error) {
	all := make([]bucket.Result, len(ls)+len(qs))
	allowed, err := s.Take(ctx, key, bucket.Tier{Limits: ls, Quotas: qs}, cost, all)
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):])
	return allowed, err
}

// peekQuotas is Peek on the tier of limits ls and quotas qs, with the
// limits' results in out and the quotas' in qout.
func (s *Store) peekQuotas(ctx context.Context, key []byte, ls []bucket.Limit, qs []bucket.Quota, out, qout []bucket.Result) error {
	all := make([]bucket.Result, len(ls)+len(qs))
	err := s.Peek(ctx, key, bucket.Tier{Limits: ls, Quotas: qs}, all)
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):])
	return err
}

// decideAt runs op, take or peek, on the tier tr at key by one script
// call, and says whether it was allowed and the server's time of the
// decision.
func (s *Store) decideAt(ctx context.Context, op, key string, tr bucket.Tier, cost int64, out []bucket.Result, batched bool) (bool, int64, error) {
	v, err := s.decideBy(ctx, op, key, tr, cost, out, batched)
	return v.allowed, v.now, err
}

// takeSynced is one request of cost 1 for key on the lone limit l, after
// which the node's background calls have settled (tableSync); an error
// fails the test.
func takeSynced(t testing.TB, node *leaseTable, key []byte, l bucket.Limit) bucket.Result {
	t.Helper()
	res, err := node.take(bg, key, oneLimit(l), 1, nil)
	tableSync(node)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// allowSynced is takeSynced of a request that must be allowed.
func allowSynced(t testing.TB, node *leaseTable, key []byte, l bucket.Limit) {
	t.Helper()
	if res := takeSynced(t, node, key, l); !res.Allowed {
		t.Fatalf("a request under the limit refused: %+v", res)
	}
}

// takeLater sends one request of cost 1 for key on tier tr to node in a
// goroutine, and gives its result on the channel it returns.
func takeLater(t testing.TB, node *leaseTable, key []byte, tr bucket.Tier) <-chan bucket.Result {
	done := make(chan bucket.Result, 1)
	go func() {
		res, err := node.take(bg, key, tr, 1, nil)
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	return done
}
