package redisbucket

import (
	"context"
	"slices"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Strict mode: a request decided by one script call, unless this node's
// deny cache already knows the answer.

// decide is strict mode's decision of one request on the tier tr at k:
// from the deny cache when it knows the answer, else by one script call
// (a lone limit's through the batcher). Once a client's denial has
// expired, one request of this node asks Redis and the others wait for
// its answer (denyCache.claim). out gets each limit's and quota's result,
// limits first. A denial is remembered until the retry time of the one
// that makes the client wait longest.
func (s *Store) decide(ctx context.Context, k string, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	lone := tr.Lone()
	for {
		start := s.conn.now()
		var epoch uint64
		var hit bool
		if lone {
			out[0], epoch, hit = s.conn.denied.get(k, tr.Limits[0], cost, start)
		} else {
			epoch, hit = s.conn.denied.getAll(k, tr, cost, start, out)
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
		v, err := s.decideBy(ctx, "take", k, tr, cost, out, lone)
		switch {
		case err != nil:
		case !v.allowed:
			s.remember(k, epoch, tr, cost, start, out)
		case v.next > 0 && tr.First().MaxWait == 0 && tr.First().Ban == 0:
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
			s.remember(k, epoch, tr, cost, start, denied)
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
func (s *Store) remember(k string, epoch uint64, tr bucket.Tier, cost, start int64, out []bucket.Result) {
	if tr.Lone() {
		s.conn.denied.put(k, epoch, tr.Limits[0], cost, start, out[0])
		return
	}
	worst := Binding(out, false)
	if slices.IndexFunc(out[len(tr.Limits):], func(r bucket.Result) bool { return r.RetryAfter == worst.RetryAfter }) >= 0 {
		worst.RetryAfter = min(worst.RetryAfter, quotaDenyFor.Microseconds())
	}
	s.conn.denied.putAll(k, epoch, tr, cost, start, worst, out)
}

// quotaDenyFor bounds how long the deny cache keeps a quota's refusal.
const quotaDenyFor = 5 * time.Second

// verdict is the script's answer to a take or a peek, besides each
// limit's and quota's result: whether it was allowed, the server's time
// of the decision, and, for an allowed take, how long until every limit
// and quota holds the cost again (0 when they do).
type verdict struct {
	allowed   bool
	now, next int64
}

// decideBy runs op, take or peek, on the tier tr at key, through the
// batcher when batched: out gets each limit's and quota's result, limits
// first.
func (s *Store) decideBy(ctx context.Context, op, key string, tr bucket.Tier, cost int64, out []bucket.Result, batched bool) (verdict, error) {
	// Only the short form's fast path answers in four values.
	long, short := 4+4*tr.Parts(), 4
	var args []any
	if op == "take" {
		head := scriptHead(key)
		var ok bool
		if args, ok = s.appendTakeArgs(append(make([]any, 0, 10), head[:]...), tr, cost); !ok {
			args = nil
		}
	}
	if args == nil {
		args, short = scriptArgs(key, s.args(op, tr, 0, cost)), long
	}
	vals, err := s.callBy(ctx, args, batched, short, long)
	if err != nil {
		return verdict{}, err
	}
	return decodeTake(vals, tr, out), nil
}

// decodeTake reads the script's answer to a take or a peek on the tier tr,
// the fast path's or the long form's, into out.
func decodeTake(vals []int64, tr bucket.Tier, out []bucket.Result) verdict {
	if len(vals) == 4 {
		return decodeShort(vals, out)
	}
	n := tr.Parts()
	for i := range n {
		// A quota starts no ban.
		out[i] = decodeResult(vals[3+4*i:], vals[1] == 1 && i < len(tr.Limits))
	}
	return verdict{allowed: vals[0] == 1, now: vals[2], next: vals[3+4*n]}
}

// decodeShort reads the fast path's answer to the script's short form
// (takeArgs) into out[0]: remaining, reset after, the server's time, and
// the next wait when allowed or minus the retry after when refused.
func decodeShort(v []int64, out []bucket.Result) verdict {
	r := bucket.Result{Allowed: v[3] >= 0, Remaining: v[0], ResetAfter: v[1]}
	if !r.Allowed {
		r.RetryAfter = -v[3]
	}
	out[0] = r
	return verdict{allowed: r.Allowed, now: v[2], next: max(0, v[3])}
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
// is the binding limit's or quota's, with the longest wait; on a tier of
// several, each is each one's, limits first (nil for a lone limit).
func (s *Store) reserve(ctx context.Context, k string, tr bucket.Tier, cost int64) (res bucket.Result, each []bucket.Result, err error) {
	if tr.Lone() {
		var one [1]bucket.Result
		_, err := s.decide(ctx, k, tr, cost, one[:])
		return one[0], nil, err
	}
	each = make([]bucket.Result, tr.Parts())
	allowed, err := s.decide(ctx, k, tr, cost, each)
	if err != nil {
		return bucket.Result{}, nil, err
	}
	return Binding(each, allowed), each, nil
}

// Binding is the one result that stands for several limits' and quotas'
// (bucket.Binding picks it), its Wait the longest.
func Binding(all []bucket.Result, allowed bool) bucket.Result {
	var wait int64
	for _, r := range all {
		wait = max(wait, r.Wait)
	}
	res := all[bucket.Binding(all, allowed)]
	res.Allowed, res.Wait = allowed, wait
	return res
}
