package redisbucket

import (
	"context"
	"slices"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Strict mode: a request decided by one script call, unless this node's
// deny cache already knows the answer.

// takeAllStrict is TakeAll by one script call, or the deny cache.
func (s *Store) takeAllStrict(ctx context.Context, k string, ls []bucket.Limit, cost int64, out []bucket.Result) (bool, error) {
	return s.decide(ctx, k, ls, nil, cost, out)
}

// decide is strict mode's decision of one request on the tier at k, of
// limits ls and quotas qs: from the deny cache when it knows the answer,
// else by one script call (a lone limit's through the batcher). Once a
// client's denial has expired, one request of this node asks Redis and
// the others wait for its answer (denyCache.claim). out gets each limit's
// and quota's result, limits first. A denial is remembered until the
// retry time of the one that makes the client wait longest.
func (s *Store) decide(ctx context.Context, k string, ls []bucket.Limit, qs []bucket.Quota, cost int64, out []bucket.Result) (bool, error) {
	lone := len(ls) == 1 && len(qs) == 0
	for {
		start := s.conn.now()
		var epoch uint64
		var hit bool
		if lone {
			out[0], epoch, hit = s.conn.denied.get(k, ls[0], cost, start)
		} else {
			epoch, hit = s.conn.denied.getAll(k, ls, qs, cost, start, out)
		}
		if hit {
			return false, nil
		}
		done, wait := s.conn.denied.claim(k, start)
		if wait != nil {
			select {
			case <-wait.done:
				if wait.err != nil && wait.err != errProbeAbandoned {
					return false, wait.err
				}
				continue
			case <-ctx.Done():
				return false, s.wrap(ctx.Err())
			}
		}
		v, err := s.decideBy(ctx, "take", k, ls, qs, cost, out, lone)
		switch {
		case err != nil:
		case !v.allowed:
			s.remember(k, epoch, ls, qs, cost, start, out)
		case v.next > 0 && ls[0].MaxWait == 0 && ls[0].Ban == 0:
			// The take left less than its cost: the same request is
			// denied until next, as Redis said, and one that asks sooner
			// need not. (Not with max_wait, where it could wait, nor
			// with a ban, which only Redis's refusal starts.)
			denied := make([]bucket.Result, len(out))
			for i, r := range out {
				// The ones left short of the cost make the client wait.
				r.Allowed, r.RetryAfter = false, 0
				if r.Remaining < cost {
					r.RetryAfter = v.next
				}
				denied[i] = r
			}
			s.remember(k, epoch, ls, qs, cost, start, denied)
		}
		if done != nil {
			if err != nil && ctx.Err() != nil {
				// The probe's own request went away: its failure is not
				// the others'.
				done(errProbeAbandoned)
			} else {
				done(err)
			}
		}
		return v.allowed, err
	}
}

// remember puts a denial of a request sent at start, each limit's and
// quota's result in out, into the deny cache: until its retry time or, a
// quota's (a period's end), for quotaDenyFor at most, since a give-back or
// a reset on another node may return the quota sooner.
func (s *Store) remember(k string, epoch uint64, ls []bucket.Limit, qs []bucket.Quota, cost, start int64, out []bucket.Result) {
	if len(ls) == 1 && len(qs) == 0 {
		s.conn.denied.put(k, epoch, ls[0], cost, start, out[0])
		return
	}
	worst := Binding(out, false)
	if slices.IndexFunc(out[len(ls):], func(r bucket.Result) bool { return r.RetryAfter == worst.RetryAfter }) >= 0 {
		worst.RetryAfter = min(worst.RetryAfter, quotaDenyFor.Microseconds())
	}
	s.conn.denied.putAll(k, epoch, ls, qs, cost, start, worst, out)
}

// quotaDenyFor bounds how long the deny cache keeps a quota's refusal.
const quotaDenyFor = 5 * time.Second

// takeAll runs op, take or peek, on key, and also returns the server's
// time of the decision. A single limit's take goes through the batcher.
func (s *Store) takeAll(ctx context.Context, op, key string, ls []bucket.Limit, cost int64, out []bucket.Result, batched bool) (bool, int64, error) {
	v, err := s.decideBy(ctx, op, key, ls, nil, cost, out, batched)
	return v.allowed, v.now, err
}

// verdict is the script's answer to a take or a peek, besides each
// limit's and quota's result: whether it was allowed, the server's time
// of the decision, and, for an allowed take, how long until every limit
// and quota holds the cost again (0 when they do).
type verdict struct {
	allowed   bool
	now, next int64
}

// decideBy runs op, take or peek, on the tier at key, of limits ls and
// quotas qs: out gets each one's result, limits first.
func (s *Store) decideBy(ctx context.Context, op, key string, ls []bucket.Limit, qs []bucket.Quota, cost int64, out []bucket.Result, batched bool) (verdict, error) {
	n := len(ls) + len(qs)
	vals, err := s.call(ctx, key, s.argsWithQuotas(op, ls, qs, 0, cost), batched, 4+4*n)
	if err != nil {
		return verdict{}, err
	}
	for i := range n {
		// A quota starts no ban.
		out[i] = decodeResult(vals[3+4*i:], vals[1] == 1 && i < len(ls))
	}
	return verdict{allowed: vals[0] == 1, now: vals[2], next: vals[3+4*n]}, nil
}

// decodeResult reads one limit's or quota's answer, four values: allowed,
// remaining, retry after (when allowed: the wait), reset after; banned
// says whether the call started a ban.
func decodeResult(v []int64, banned bool) bucket.Result {
	r := bucket.Result{Allowed: v[0] == 1, Remaining: v[1], ResetAfter: v[3], Banned: banned}
	if r.Allowed {
		r.Wait = v[2]
	} else {
		r.RetryAfter = v[2]
	}
	return r
}

// reserve decides one request on the tier at key as strict mode does,
// for a request that leases refused and that may wait (max_wait): one
// script call, unless the deny cache already knows the answer. The result
// is the binding limit's or quota's, with the longest wait.
func (s *Store) reserve(ctx context.Context, k string, tr Tier, cost int64, each results) (bucket.Result, error) {
	if tr.parts() == 0 {
		return s.reserveOne(ctx, k, tr.first(), cost)
	}
	all := make([]bucket.Result, len(tr.Limits)+len(tr.Quotas))
	allowed, err := s.decide(ctx, k, tr.Limits, tr.Quotas, cost, all)
	if err != nil {
		return bucket.Result{}, err
	}
	for i := range min(each.len(), len(all)) {
		*each.at(i) = all[i]
	}
	return Binding(all, allowed), nil
}

// Binding is the one result that stands for several limits' and quotas'
// (the X- headers report it): when allowed, the one with the least
// remaining; when refused, the one that makes the client wait longest;
// the first of equals. Its Wait is the longest.
func Binding(all []bucket.Result, allowed bool) bucket.Result {
	j := 0
	var wait int64
	for i, r := range all {
		if allowed && r.Remaining < all[j].Remaining || !allowed && r.RetryAfter > all[j].RetryAfter {
			j = i
		}
		wait = max(wait, r.Wait)
	}
	res := all[j]
	res.Allowed, res.Wait = allowed, wait
	return res
}

// reserveOne decides one request on the bucket at key, of one limit, by
// one script call, as strict mode does, unless the deny cache already
// knows the answer.
func (s *Store) reserveOne(ctx context.Context, k string, l bucket.Limit, cost int64) (bucket.Result, error) {
	var out [1]bucket.Result
	_, err := s.decide(ctx, k, []bucket.Limit{l}, nil, cost, out[:])
	return out[0], err
}
