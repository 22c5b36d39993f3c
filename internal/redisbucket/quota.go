package redisbucket

import (
	"context"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Calendar quotas in the bucket script (internal/bucket/quota.go): a
// tier's quotas are counted in the bucket's one key, beside its limits, in
// the same script call.

// argsWithQuotas are the script's arguments for op on limits ls and
// quotas qs, and then extra. Each quota goes with its period, the start of
// the period that holds the moment at (for a give-back; 0 for none), and
// the boundaries of the periods around this node's now, among which
// Redis's TIME picks.
func (s *Store) argsWithQuotas(op string, ls []bucket.Limit, qs []bucket.Quota, at, count int64, extra ...any) []any {
	args := make([]any, 0, 7+3*len(ls)+7*len(qs)+len(extra))
	ban := ls[0].Ban
	if ls[0].Instant {
		ban = -1
	}
	args = append(args, op, len(ls), count, s.clockOffset, ban, ls[0].MaxWait)
	for _, l := range ls {
		args = append(args, l.Capacity, l.Rate.Tokens, l.Rate.Interval)
	}
	args = append(args, len(qs))
	now := time.Now().UnixMicro() + s.clockOffset
	for _, q := range qs {
		start, end := q.Bounds(now)
		before, _ := q.Bounds(start - 1)
		_, after := q.Bounds(end)
		var taken int64
		if at != 0 {
			taken, _ = q.Bounds(at)
		}
		args = append(args, q.N, int(q.Period), taken, before, start, end, after)
	}
	return append(args, extra...)
}

// TakeQuotas decides one request on every limit and every quota of the
// bucket at key, all or none, in one script call: it writes each limit's
// result into out and each quota's into qout.
//
// With leases, the request is decided from this node's lease, which takes
// from every limit and quota at once; each result is then the lease's.
func (s *Store) TakeQuotas(ctx context.Context, key []byte, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, error) {
	if res, ok, err := s.leased(ctx, key, Tier{Limits: ls, Quotas: qs}, cost, results{out[:len(ls)], qout[:len(qs)]}); ok {
		return res.Allowed, err
	}
	all := make([]bucket.Result, len(ls)+len(qs))
	allowed, err := s.decide(ctx, string(key), ls, qs, cost, all)
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):])
	return allowed, err
}

// PeekQuotas reports every limit and quota of the bucket at key as it
// stands, in one script call that changes nothing.
func (s *Store) PeekQuotas(ctx context.Context, key []byte, ls []bucket.Limit, qs []bucket.Quota, out, qout []bucket.Result) error {
	_, _, err := s.takeQuotas(ctx, "peek", string(key), ls, qs, 0, out, qout)
	return err
}

// GiveBackQuotas returns n tokens a request took at the moment at
// (microseconds since the epoch) to every quota of the bucket at key, and
// ln of them (at most n) to every limit: into this node's lease when it
// holds one (its tokens stay counted in the quotas, to be spent in the
// period that counted them), and the rest in one script call, to a quota
// only while the period it was counted in lasts.
//
// A lease holds tokens of the limits and the quotas at once: when the
// limits take back fewer than the quotas (a reload changed them), it
// takes none, and the script gives each its own.
func (s *Store) GiveBackQuotas(ctx context.Context, key []byte, ls []bucket.Limit, ln int64, qs []bucket.Quota, n, at int64) error {
	if ln == n {
		if n = s.fromLease(key, n, true, at); n <= 0 {
			return nil
		}
		ln = n
	}
	k := string(key)
	_, err := s.call(context.WithoutCancel(ctx), k, s.argsWithQuotas("giveback", ls, qs, at, n, max(0, ln)), false, 2)
	s.conn.denied.remove(k)
	return err
}

// ChargeQuotas takes n more tokens from every limit and quota of the
// bucket at key: from this node's lease when it covers them, as Charge
// does, and the rest in one script call.
func (s *Store) ChargeQuotas(ctx context.Context, key []byte, ls []bucket.Limit, qs []bucket.Quota, n int64) error {
	if n = s.fromLease(key, n, false, 0); n == 0 && s.leases != nil {
		return nil
	}
	_, err := s.call(context.WithoutCancel(ctx), string(key), s.argsWithQuotas("charge", ls, qs, 0, n), false, 2)
	return err
}

// takeQuotas runs op, take or peek, on key with quotas, and returns the
// server's time of the decision too.
func (s *Store) takeQuotas(ctx context.Context, op, key string, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, int64, error) {
	all := make([]bucket.Result, len(ls)+len(qs))
	v, err := s.decideBy(ctx, op, key, ls, qs, cost, all, false)
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):])
	return v.allowed, v.now, err
}
