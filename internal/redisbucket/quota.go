package redisbucket

import (
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Calendar quotas in the bucket script (internal/bucket/quota.go): a
// tier's quotas are counted in the bucket's one key, beside its limits, in
// the same script call as every step of Store (Take, Peek, GiveBack,
// Charge).

// args are the script's arguments for op on the tier tr, count tokens,
// and then extra. Each quota goes with its period, the start of the period
// that holds the moment at (for a give-back; 0 for none), and the
// boundaries of the periods around this node's now, among which Redis's
// TIME picks.
func (s *Store) args(op string, tr bucket.Tier, at, count int64, extra ...any) []any {
	ls, qs := tr.Limits, tr.Quotas
	args := make([]any, 0, 7+3*len(ls)+7*len(qs)+len(extra))
	first := tr.First()
	ban := first.Ban
	if first.Instant {
		ban = -1
	}
	args = append(args, op, len(ls), count, s.clockOffset, ban, first.MaxWait)
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

// takeArgs are the script's short form of a take of cost on the tier tr
// (script.go), which its fast path answers, or nil when the take is not of
// its shape (appendTakeArgs).
func (s *Store) takeArgs(tr bucket.Tier, cost int64) []any {
	args, ok := s.appendTakeArgs(make([]any, 0, 6), tr, cost)
	if !ok {
		return nil
	}
	return args
}

// appendTakeArgs appends to args the script's short form of a take of
// cost on the tier tr, and says whether the take has its shape: one
// limit, no quota, no max_wait, a cost within the capacity. The clock
// offset and the ban go only when set. The limit's numbers go boxed once
// per limit (Store.boxed): boxing a number allocates.
func (s *Store) appendTakeArgs(args []any, tr bucket.Tier, cost int64) ([]any, bool) {
	if !tr.Lone() {
		return args, false
	}
	l := tr.Limits[0]
	if l.MaxWait != 0 || l.Instant || cost < 0 || cost > l.Capacity {
		return args, false
	}
	b := s.boxed.Load()
	if b == nil || b.capacity != l.Capacity || b.rate != l.Rate {
		b = &boxedLimit{capacity: l.Capacity, rate: l.Rate, args: [3]any{l.Capacity, l.Rate.Tokens, l.Rate.Interval}}
		s.boxed.Store(b)
	}
	args = append(args, cost)
	args = append(args, b.args[:]...)
	if s.clockOffset != 0 || l.Ban != 0 {
		args = append(args, s.clockOffset)
	}
	if l.Ban != 0 {
		args = append(args, l.Ban)
	}
	return args, true
}

// boxedLimit is a limit's capacity and rate, boxed as a call's arguments.
type boxedLimit struct {
	capacity int64
	rate     bucket.Rate
	args     [3]any
}

// leaseShort says whether a lease call on the tier tr, and the give-back
// of its tokens, go in the script's short forms, which its lease fast
// paths answer (script.go): one limit, no quota, no max_wait, no ban.
func leaseShort(tr bucket.Tier) bool {
	if !tr.Lone() {
		return false
	}
	l := tr.Limits[0]
	return l.MaxWait == 0 && !l.Instant && l.Ban == 0
}

// leaseArgs are the script's arguments for the lease call a on the tier
// tr: the short form when it has its shape (leaseShort), the long one
// otherwise.
func (s *Store) leaseArgs(tr bucket.Tier, a bucket.LeaseAsk) []any {
	prefetch := 0
	if a.Prefetch {
		prefetch = 1
	}
	if !leaseShort(tr) {
		return s.args("lease", tr, 0, a.Cost, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend, prefetch)
	}
	l := tr.Limits[0]
	return []any{"l", a.Cost, l.Capacity, l.Rate.Tokens, l.Rate.Interval, s.clockOffset, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend, prefetch}
}

// returnArgs are the script's arguments for the give-back of tokens
// leased to node by its call seq on the tier tr, in the short form when
// it has its shape (leaseShort).
func (s *Store) returnArgs(tr bucket.Tier, tokens int64, node string, seq int64) []any {
	if !leaseShort(tr) {
		return s.args("return", tr, 0, tokens, node, seq)
	}
	l := tr.Limits[0]
	return []any{"r", tokens, l.Capacity, l.Rate.Tokens, l.Rate.Interval, s.clockOffset, node, seq}
}
