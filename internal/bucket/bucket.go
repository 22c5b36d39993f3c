// Package bucket is the token bucket's math: a bucket's state, its limits,
// a tier's shape, and what a request, a give-back and a charge do to it,
// on integers and an injected clock, and the terms of a lease. It imports
// nothing but the standard library; the models every store is held to are
// in buckettest, which only tests import.
package bucket

import (
	"fmt"
	"math"
	"math/big"
	"math/bits"
	"time"
)

// The token bucket, lazily refilled.
//
// A bucket holds at most Capacity tokens and gains Rate.Tokens tokens every
// Rate.Interval microseconds. A request costing k tokens is allowed when the
// bucket holds at least k, and takes them; a denied request changes nothing.
// Nothing refills in the background: the level is computed from the time.
//
// All arithmetic is on integers. One token is Rate.Interval "units", so that
// one microsecond refills exactly Rate.Tokens units and no fraction is ever
// rounded. From a full bucket, over T seconds, at most C + floor(r*T)
// unit-cost requests are allowed, exactly.
//
// The state is kept as the moment the bucket is full again (FullAt) plus the
// part of the last microsecond that is already refilled (Slack). A zero State
// is a full bucket, and a bucket whose FullAt has passed is the same as no
// bucket at all, so stores may forget it.

// maxUnits bounds Capacity*Rate.Interval so that every figure stays exact in
// a float64 as well, with room for a product: the Redis store's Lua script
// computes with doubles.
const maxUnits = 1 << 52

// Limit is a bucket's shape.
type Limit struct {
	Capacity int64
	Rate     Rate
	// Ban, when above 0, is how long (µs) a denial holds the bucket empty
	// (docs/logins.md). Denials during a ban do not extend it; when it
	// ends, the bucket refills from empty.
	Ban int64
	// MaxWait, when above 0, is how long (µs) a request may wait for its
	// tokens (docs/max-wait.md): one whose tokens are due within it takes
	// them now, the level going below zero by at most MaxWait's refill,
	// and waits until they are due. One that would wait longer is refused,
	// taking nothing.
	MaxWait int64
	// Instant marks the one limit of a plan of quotas alone (a tier with
	// quotas and no rate limit), which every store's step needs and which
	// must never refuse what the quotas admit: it refills whole within a
	// microsecond and reads any state as full a microsecond later.
	Instant bool
}

// State is a bucket's stored state. The zero State is a full bucket.
type State struct {
	// FullAt is the microsecond at which the bucket is full again.
	FullAt int64
	// Slack is how many units of the microsecond before FullAt are already
	// refilled, in [0, Rate.Tokens).
	Slack int64
	// Banned marks a state that a ban wrote: until a request is allowed
	// again, tokens given back are dropped, since the ban emptied the
	// bucket they were taken from.
	Banned bool
}

// Result is what one Take decided.
type Result struct {
	Allowed bool
	// Banned says that this denial started a ban.
	Banned bool
	// Remaining is the whole tokens left after this request.
	Remaining int64
	// RetryAfter is, when denied, the microseconds until the request could be
	// allowed. It is 0 when allowed.
	RetryAfter int64
	// ResetAfter is the microseconds until the bucket is full again.
	ResetAfter int64
	// Wait is, when allowed, the microseconds until the tokens taken are
	// due: the request waits that long before it goes on. 0 when they are
	// there now, and always without MaxWait.
	Wait int64
}

// Validate checks that the limit is a bucket the arithmetic can hold, and
// that a request costing cost tokens can ever be allowed.
func (l Limit) Validate(cost int64) error {
	if l.Capacity < 1 {
		return fmt.Errorf("capacity %d: must be at least 1", l.Capacity)
	}
	if l.Rate.Tokens < 1 || l.Rate.Interval < 1 || l.Rate.Tokens > math.MaxInt32 {
		return fmt.Errorf("refill %d/%dµs: must be above 0, in lowest terms", l.Rate.Tokens, l.Rate.Interval)
	}
	if l.Capacity > maxUnits/l.Rate.Interval {
		return fmt.Errorf("capacity %d with refill %s: too large to compute exactly; use a smaller capacity or a coarser refill", l.Capacity, l.Rate)
	}
	if cost < 1 || cost > l.Capacity {
		return fmt.Errorf("cost %d: must be from 1 to the capacity, %d", cost, l.Capacity)
	}
	if most := (l.maxDeficit() - l.Units()) / l.Rate.Tokens; l.MaxWait < 0 || l.MaxWait > most {
		return fmt.Errorf("max_wait %s: must be at most the time 1000 capacities take to refill, %s", time.Duration(l.MaxWait)*time.Microsecond, time.Duration(most)*time.Microsecond)
	}
	return nil
}

// Units is the capacity in units: Rate.Interval to a token.
func (l Limit) Units() int64 { return l.Capacity * l.Rate.Interval }

// Deficit is how many units the bucket lacks at now, from 0 to l.Units().
func (s State) Deficit(now int64, l Limit) int64 {
	if now >= s.FullAt {
		return 0
	}
	// Under the limit that wrote the state, FullAt-now is at most the time to
	// refill a whole bucket. A reload may have changed the limit since, or
	// the clock gone backwards: a gap longer than a whole refill saturates
	// to an empty bucket before the product could overflow.
	// (Slack is below the old limit's Tokens, so the sums stay small.)
	gap := s.FullAt - now
	if gap > (l.Units()+s.Slack)/l.Rate.Tokens+1 {
		return l.Units()
	}
	d := gap*l.Rate.Tokens - s.Slack
	if d > l.Units() {
		return l.Units()
	}
	// Below 0 only when a reload changed the rate: Slack, in the old rate's
	// units, then exceeds the little time left before FullAt, when the
	// bucket is all but full.
	return max(d, 0)
}

// StateAt is the state of a bucket that lacks deficit units (above 0) at
// now.
func StateAt(now, deficit int64, l Limit) State {
	refill := CeilDiv(deficit, l.Rate.Tokens)
	return State{FullAt: now + refill, Slack: refill*l.Rate.Tokens - deficit}
}

// RawDeficit is how many units the bucket lacks at now, unsaturated: more
// than the capacity for a bucket in debt or under a ban, up to maxDeficit.
func (s State) RawDeficit(now int64, l Limit) int64 {
	gap := s.FullAt - now
	if gap <= 0 {
		return 0
	}
	if gap > (l.maxDeficit()+s.Slack)/l.Rate.Tokens+1 {
		return l.maxDeficit()
	}
	return min(max(0, gap*l.Rate.Tokens-s.Slack), l.maxDeficit())
}

// Take applies one request costing cost tokens at time now (microseconds)
// to a bucket in state s. It returns the new state, which equals s when the
// request is denied, unless the denial starts a ban.
func Take(s State, now int64, l Limit, cost int64) (State, Result) {
	// The common case, written out here: a request allowed by a limit of
	// no max_wait and not Instant, in a bucket neither banned nor in debt.
	// It runs take's steps with two divisions where take has four; every
	// other case goes to takeAny.
	if l.MaxWait == 0 && !l.Instant && cost > 0 {
		units, deficit := l.Units(), int64(0)
		if gap := s.FullAt - now; gap > 0 {
			// Overdrawn is gap*Tokens > Units+Slack, computed in 128 bits
			// rather than divided: below it, the product is the deficit's.
			hi, lo := bits.Mul64(uint64(gap), uint64(l.Rate.Tokens))
			if hi != 0 || lo > uint64(units+s.Slack) {
				return takeAny(s, now, l, cost)
			}
			deficit = max(int64(lo)-s.Slack, 0)
		}
		if level, need := units-deficit, cost*l.Rate.Interval; level >= need {
			next := StateAt(now, deficit+need, l)
			return next, Result{Allowed: true, Remaining: (level - need) / l.Rate.Interval, ResetAfter: next.FullAt - now}
		}
	}
	return takeAny(s, now, l, cost)
}

// takeAny is Take for every case.
func takeAny(s State, now int64, l Limit, cost int64) (State, Result) {
	next, res := take(s, now, l, cost)
	if !res.Allowed && l.Ban > 0 {
		return Ban(s, now, l, cost*l.Rate.Interval)
	}
	return next, res
}

// take decides a request against one limit as if there were no ban
// setting: the state after it, and the result.
func take(s State, now int64, l Limit, cost int64) (State, Result) {
	s = s.Read(now, l)
	if l.MaxWait > 0 && !(s.Banned && s.Overdrawn(now, l)) {
		return takeWaiting(s, now, l, cost)
	}
	if s.Overdrawn(now, l) {
		// In debt (cost_from_response) or under a ban: empty until the
		// refill covers what it lacks, even for a request of cost 0.
		return s, Result{RetryAfter: retryBanned(s, now, l, cost*l.Rate.Interval), ResetAfter: s.FullAt - now}
	}
	deficit := s.Deficit(now, l)
	level := l.Units() - deficit
	need := cost * l.Rate.Interval
	if level < need {
		return s, Result{
			Remaining:  level / l.Rate.Interval,
			RetryAfter: CeilDiv(need-level, l.Rate.Tokens),
			ResetAfter: CeilDiv(deficit, l.Rate.Tokens),
		}
	}
	if cost == 0 {
		// Nothing taken, so nothing written: a ban's mark stays.
		return s, Result{Allowed: true, Remaining: level / l.Rate.Interval, ResetAfter: CeilDiv(deficit, l.Rate.Tokens)}
	}
	next := StateAt(now, deficit+need, l)
	return next, Result{Allowed: true, Remaining: (level - need) / l.Rate.Interval, ResetAfter: next.FullAt - now}
}

// MaxLimits bounds the limits of one bucket.
const MaxLimits = 8

// TakeAll applies one request to every limit of a bucket at once: it takes
// cost from each, or, when one is short, from none. It updates states in
// place, writes each limit's result into out, and reports whether the
// request was allowed. With a ban, a denial empties every limit.
func TakeAll(states []State, now int64, ls []Limit, cost int64, out []Result) bool {
	var next [MaxLimits]State
	allowed := true
	for i, l := range ls {
		states[i] = states[i].Read(now, l)
		next[i], out[i] = take(states[i], now, l, cost)
		allowed = allowed && out[i].Allowed
	}
	if !allowed {
		Refuse(states, now, ls, cost, out, ls[0].Ban > 0)
		return false
	}
	goTogether(states, next[:len(ls)], now, ls, cost, out)
	copy(states, next[:len(ls)])
	return true
}

// Refuse answers a request of cost on limits ls that one of them refused,
// given each one's take in out. With ban, every limit is emptied (Ban),
// and every result says whether this request started the ban. Without,
// nothing is taken: a limit that had room reports as it stands.
func Refuse(states []State, now int64, ls []Limit, cost int64, out []Result, ban bool) {
	if !ban {
		for i, l := range ls {
			if out[i].Allowed {
				out[i] = Peek(states[i], now, l)
				out[i].Allowed = false
			}
		}
		return
	}
	started := false
	for i, l := range ls {
		states[i], out[i] = Ban(states[i], now, l, cost*l.Rate.Interval)
		started = started || out[i].Banned
	}
	for i := range ls {
		out[i].Banned = started
	}
}

// Ban answers a denial under a ban setting: it empties the bucket for
// l.Ban from now, unless a ban already holds it, and says how long until
// need units are back.
func Ban(s State, now int64, l Limit, need int64) (State, Result) {
	// With MaxWait, a bucket below empty holds waiters, not a ban: a
	// refusal starts one, and it never shortens what the waiters took.
	started := !s.Overdrawn(now, l) || (l.MaxWait > 0 && !s.Banned)
	if started {
		// Empty at now+Ban exactly, then refilling as usual.
		refill := CeilDiv(l.Units(), l.Rate.Tokens)
		b := State{FullAt: now + l.Ban + refill, Slack: refill*l.Rate.Tokens - l.Units(), Banned: true}
		if s.FullAt > b.FullAt {
			b = State{FullAt: s.FullAt, Slack: s.Slack, Banned: true}
		}
		s = b
	}
	return s, Result{RetryAfter: retryBanned(s, now, l, need), ResetAfter: s.FullAt - now, Banned: started}
}

// retryBanned is when a request that lacks need units may come back to a
// bucket a ban or a debt empties: when the bucket holds them or, with
// MaxWait, when the ban is over and they are due within MaxWait.
func retryBanned(s State, now int64, l Limit, need int64) int64 {
	until := untilLevel(s, now, l, need)
	if l.MaxWait > 0 {
		until = max(untilLevel(s, now, l, 0), until-l.MaxWait)
	}
	return until
}

// bannedSince reports whether a ban emptied the bucket since a request was
// last allowed. A bucket full again is no bucket, ban or not.
func (s State) bannedSince(now int64) bool { return s.Banned && s.FullAt > now }

// Overdrawn reports whether s lacks more than the whole bucket at now: a
// ban, or a debt that cost_from_response ran up.
func (s State) Overdrawn(now int64, l Limit) bool {
	gap := s.FullAt - now
	return gap > 0 && gap > (l.Units()+s.Slack)/l.Rate.Tokens
}

// untilLevel is the microseconds until the bucket in state s holds x
// units, at least 1: the moment (FullAt-t)*Tokens - Slack falls to
// units - x. It holds for a banned bucket too, whose deficit saturates.
func untilLevel(s State, now int64, l Limit, x int64) int64 {
	return max(1, s.FullAt-now-(l.Units()-x+s.Slack)/l.Rate.Tokens)
}

// Peek reports the bucket as it stands at now, without taking: Allowed says
// whether a unit-cost request would pass. A bucket that lacks more than its
// capacity (a ban, a debt, waiters queued past empty) is full again when
// its state says, not one refill of the capacity from now.
func Peek(s State, now int64, l Limit) Result {
	s = s.Read(now, l)
	deficit := s.Deficit(now, l)
	level := l.Units() - deficit
	reset := CeilDiv(deficit, l.Rate.Tokens)
	if deficit == l.Units() {
		reset = max(reset, untilLevel(s, now, l, l.Units()))
	}
	return Result{
		Allowed:    level >= l.Rate.Interval,
		Remaining:  level / l.Rate.Interval,
		ResetAfter: reset,
	}
}

// Read is s as the limit l reads it: an Instant limit is full a
// microsecond after any state, so that one another limit wrote before a
// reload, or a charge's debt, never empties it. Every step reads first.
func (s State) Read(now int64, l Limit) State {
	if l.Instant && s.FullAt-now > 1 {
		return State{}
	}
	return s
}

// CeilDiv is a/b rounded up, for a >= 0 and b > 0.
func CeilDiv(a, b int64) int64 { return (a + b - 1) / b }

// GiveBack returns n tokens that a request took, as count_status does for
// a response that does not count. It only ever undoes a take: a bucket
// that a ban emptied since gets nothing back, one in debt gets exactly n
// off its debt, and the level never passes the capacity of l, whatever
// limit the tokens were taken under.
func GiveBack(s State, now int64, l Limit, n int64) State {
	s = s.Read(now, l)
	if n <= 0 || s.bannedSince(now) {
		return s
	}
	d := s.RawDeficit(now, l) - min(n, l.Capacity)*l.Rate.Interval
	if d <= 0 {
		return State{}
	}
	return StateAt(now, d, l)
}

// maxDeficit bounds how far below empty a charge may take a bucket: a
// debt of up to 1000 capacities, and never past maxUnits in all, so that
// the Redis script's doubles hold every figure, a full time included,
// exactly.
func (l Limit) maxDeficit() int64 {
	return l.Units() + min(l.Units()*1000, maxUnits-l.Units())
}

// Converted is n tokens taken under the limit from, as tokens of l, for a
// give-back that a request or a lease computed under an older config: no
// more than n, and no more than their refill time under from buys under l,
// so that a reload between a take and its give-back never creates tokens.
func (l Limit) Converted(n int64, from Limit) int64 {
	if from.Rate == l.Rate || n <= 0 {
		return n
	}
	// n * min(1, rate(l) / rate(from)), rounded down, in exact arithmetic:
	// the products pass 64 bits.
	num := new(big.Int).Mul(big.NewInt(n), big.NewInt(l.Rate.Tokens))
	num.Mul(num, big.NewInt(from.Rate.Interval))
	den := new(big.Int).Mul(big.NewInt(l.Rate.Interval), big.NewInt(from.Rate.Tokens))
	return min(n, num.Quo(num, den).Int64())
}

// Charge takes n more tokens after the fact, as cost_from_response does:
// the bucket may go into debt, down to maxDeficit, and a debtor is refused
// until it has refilled to the cost of a request.
//
// A charge never brings the moment the bucket is full again closer: a ban
// may hold it empty for longer than the deepest debt (maxDeficit), and a
// charge during it must not end it early.
func Charge(s State, now int64, l Limit, n int64) State {
	s = s.Read(now, l)
	n = min(n, l.maxDeficit()/l.Rate.Interval) // an origin's figure, bounded
	raw := min(s.RawDeficit(now, l)+n*l.Rate.Interval, l.maxDeficit())
	if raw <= 0 {
		return State{}
	}
	next := StateAt(now, raw, l)
	next.Banned = s.bannedSince(now)
	if next.FullAt < s.FullAt {
		return s
	}
	return next
}
