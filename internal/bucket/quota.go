package bucket

import (
	"fmt"
	"strconv"
	"strings"
	"time"
	// The zones' rules, built in: a machine without a zone database
	// (a minimal container) computes the same boundaries.
	_ "time/tzdata"
)

// Calendar quotas (docs/metering-and-quotas.md): a quota is a count of tokens
// that starts over at each boundary of a calendar period in a time zone:
// midnight for a day, Monday midnight for a week (ISO), the 1st for a
// month, 1 January for a year. Days of 23 or 25 hours and months of 28 to
// 31 days are as the zone's calendar has them.

// Period is a calendar period a quota counts over.
type Period uint8

// The periods.
const (
	Day Period = iota + 1
	Week
	Month
	Year
)

var periodNames = [...]string{Day: "day", Week: "week", Month: "month", Year: "year"}

func (p Period) String() string {
	if p < Day || p > Year {
		return "period(" + strconv.Itoa(int(p)) + ")"
	}
	return periodNames[p]
}

// Quota is at most N tokens a Period, in the zone Loc.
type Quota struct {
	N      int64
	Period Period
	Loc    *time.Location
}

// ParseQuota reads "<n>/<day|week|month|year>".
func ParseQuota(s string, loc *time.Location) (Quota, error) {
	num, per, ok := strings.Cut(s, "/")
	if !ok {
		return Quota{}, fmt.Errorf("quota %q: want <n>/<day|week|month|year>, such as 10000/month", s)
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n < 1 || n > maxQuota {
		return Quota{}, fmt.Errorf("quota %q: the count must be a whole number from 1 to %d", s, maxQuota)
	}
	q := Quota{N: n, Loc: loc}
	for p := Day; p <= Year; p++ {
		if periodNames[p] == per {
			q.Period = p
		}
	}
	if q.Period == 0 {
		return Quota{}, fmt.Errorf("quota %q: period %q: want day, week, month or year", s, per)
	}
	if q.Loc == nil {
		q.Loc = time.UTC
	}
	return q, nil
}

// maxQuota bounds a quota's count: the local store keeps it in 31 bits.
const maxQuota = 1<<31 - 1

// String is the quota as written.
func (q Quota) String() string { return strconv.FormatInt(q.N, 10) + "/" + q.Period.String() }

// Bounds are the start and the end (microseconds since the epoch) of the
// period that holds the moment t (microseconds since the epoch). A period
// starts when its first day does (dayStart), and ends when the next
// period's first day starts: so periods follow one another, with no gap
// and no overlap, however the zone's clock moves. Where the clock goes
// back over midnight (at 00:01 to 23:01 in St John's until 2011, or at
// 01:00 to 00:00 in Amman), a moment that it shows as the day before, but
// after the day's first moment, is of the new day.
func (q Quota) Bounds(t int64) (start, end int64) {
	y, m, d := time.UnixMicro(t).In(q.Loc).Date()
	from, to := q.period(time.Date(y, m, d, 0, 0, 0, 0, time.UTC))
	start, end = dayStart(from, q.Loc), dayStart(to, q.Loc)
	for end <= t {
		// The clock went back after the next period began.
		_, to = q.period(to)
		start, end = end, dayStart(to, q.Loc)
	}
	return start, end
}

// period is the first day of the period that holds the day date, and the
// first day of the next, as dates at midnight UTC.
func (q Quota) period(date time.Time) (first, next time.Time) {
	y, m, _ := date.Date()
	switch q.Period {
	case Day:
		return date, date.AddDate(0, 0, 1)
	case Week:
		first = date.AddDate(0, 0, -(int(date.Weekday())+6)%7) // back to Monday
		return first, first.AddDate(0, 0, 7)
	case Month:
		first = time.Date(y, m, 1, 0, 0, 0, 0, time.UTC)
		return first, first.AddDate(0, 1, 0)
	}
	first = time.Date(y, 1, 1, 0, 0, 0, 0, time.UTC)
	return first, first.AddDate(1, 0, 0)
}

// dayStart is the first moment (µs) at which the zone's clock shows the
// day date (a date at midnight UTC) or a later one: its midnight; the
// first of two, when the clock goes back over it; or the moment the
// clock jumps to, when it skips midnight (a DST change at 00:00, as in
// Havana) or the whole day (Pacific/Apia's 2011-12-30, which then starts
// when the next one does). It walks the zone's spans of one offset from
// before any of them can show the date: in each, the clock shows it from
// its midnight less the span's offset.
func dayStart(date time.Time, loc *time.Location) int64 {
	midnight := date.Unix() // on the zone's clock, in seconds
	// No zone's offset reaches 18 hours: here its clock is still before
	// the date.
	at := midnight - 18*3600
	for {
		z := time.Unix(at, 0).In(loc)
		_, off := z.Zone()
		_, end := z.ZoneBounds()
		first := max(at, midnight-int64(off))
		if end.IsZero() || first < end.Unix() {
			return first * 1_000_000
		}
		at = end.Unix()
	}
}

// QuotaState is a quota's count: Used tokens in the period that starts at
// Start (microseconds since the epoch). A count of another period is 0.
type QuotaState struct {
	Start, Used int64
}

// used is the count in the period starting at start.
func (s QuotaState) used(start int64) int64 {
	if s.Start != start {
		return 0
	}
	return s.Used
}

// TakeQuota decides cost tokens against the quota at now: allowed when the
// period's count and cost fit N. It returns the state after (unchanged
// when refused) and a result: Remaining the tokens left in the period,
// RetryAfter (refused) and ResetAfter the microseconds to its end.
func TakeQuota(s QuotaState, now int64, q Quota, cost int64) (QuotaState, Result) {
	start, end := q.Bounds(now)
	used := s.used(start)
	// A reload may have lowered N below what the period used.
	res := Result{Remaining: max(0, q.N-used), ResetAfter: end - now}
	if used+cost > q.N {
		res.RetryAfter = end - now
		return s, res
	}
	res.Allowed = true
	res.Remaining -= cost
	if cost == 0 {
		return s, res
	}
	return QuotaState{Start: start, Used: used + cost}, res
}

// PeekQuota reports the quota at now without taking.
func PeekQuota(s QuotaState, now int64, q Quota) Result {
	start, end := q.Bounds(now)
	left := max(0, q.N-s.used(start))
	return Result{Allowed: left > 0, Remaining: left, ResetAfter: end - now}
}

// GiveBackQuota returns n tokens that a request took at the moment at to
// the period's count, never below 0: only while that period lasts, since
// a count of an earlier period is already gone, and the tokens belong to
// it, not to the period now.
func GiveBackQuota(s QuotaState, now, at int64, q Quota, n int64) QuotaState {
	start, _ := q.Bounds(now)
	taken, _ := q.Bounds(at)
	if s.Start != start || taken != start {
		return s
	}
	s.Used = max(0, s.Used-n)
	return s
}

// CountedAt is a moment, by the clock of the node that decided a request
// at start (µs), in the quota periods that counted it, from its quotas'
// results: each says how long its period had left by the store's clock,
// which decides the period. A give-back names it, so that a node whose
// clock is off by less than an hour names the store's period, not its
// own, near a boundary.
func CountedAt(start int64, qout []Result) int64 {
	left := qout[0].ResetAfter
	for _, r := range qout[1:] {
		left = min(left, r.ResetAfter)
	}
	return start + left - time.Hour.Microseconds()
}

// ChargeQuota counts n more tokens after the fact (cost_from_response),
// up to the quota: a client that used it up waits for the next period.
// The figure is the origin's, which may relay a client's: it is bounded
// by N before the sum, which would wrap past 2^63 (the script's doubles
// do not wrap).
func ChargeQuota(s QuotaState, now int64, q Quota, n int64) QuotaState {
	start, _ := q.Bounds(now)
	used := s.used(start)
	// Never lower: a reload may have set N below what was used.
	return QuotaState{Start: start, Used: max(used, min(q.N, used+min(max(0, n), q.N)))}
}

// TakeAllQuotas applies a request to every limit and every quota of a
// bucket at once, as TakeAll does for limits: it takes cost from each, or
// from none. A quota that lacks the cost refuses the request, taking
// nothing and starting no ban; a limit that refuses it leaves the quotas
// as they were. It updates states and qstates in place. The limits read
// now, the quotas wall: a store may time its limits by a monotonic clock,
// but a calendar needs the wall's.
func TakeAllQuotas(states []State, qstates []QuotaState, now, wall int64, ls []Limit, qs []Quota, cost int64, out, qout []Result) bool {
	var next [MaxQuotas]QuotaState
	fits := true
	for i, q := range qs {
		next[i], qout[i] = TakeQuota(qstates[i], wall, q, cost)
		fits = fits && qout[i].Allowed
	}
	if !fits {
		peekRefused(states, now, ls, cost, out)
		refuseQuotas(qstates, wall, qs, qout)
		return false
	}
	if !TakeAll(states, now, ls, cost, out) {
		for i := range qs {
			qout[i] = PeekQuota(qstates[i], wall, qs[i])
		}
		refuseQuotas(qstates, wall, qs, qout)
		return false
	}
	copy(qstates, next[:len(qs)])
	return true
}

// peekRefused reports the limits of a request a quota refused, taking
// nothing: as they stand, and, for a limit that would refuse too, when it
// would not, so that Retry-After covers every refusal.
func peekRefused(states []State, now int64, ls []Limit, cost int64, out []Result) {
	for i, l := range ls {
		_, r := take(states[i], now, l, cost)
		out[i] = Peek(states[i], now, l)
		if !r.Allowed {
			out[i].RetryAfter = r.RetryAfter
		}
		out[i].Allowed = false
	}
}

// refuseQuotas reports, for a refused request, the quotas that had room
// as they stand.
func refuseQuotas(qstates []QuotaState, now int64, qs []Quota, qout []Result) {
	for i := range qs {
		if qout[i].Allowed {
			qout[i] = PeekQuota(qstates[i], now, qs[i])
			qout[i].Allowed = false
		}
	}
}

// MaxQuotas bounds the quotas of one bucket.
const MaxQuotas = 4
