package localbucket

import "github.com/bramsley/caddy-ratelimit/internal/bucket"

// quotaID is the table id of a bucket's quota of period p: after its
// limits', by period, so that a reload that adds, drops or reorders
// quotas moves no count.
func quotaID(id uint64, p bucket.Period) uint64 {
	return limitID(id, bucket.MaxLimits+int(p)-1)
}

// A quota's count is kept in the table as a State: Slack the count (below
// 2^31), and FullAt the end of its period by the table's clock, when the
// table may drop it, rounded up to a multiple of 2^20 µs (about a second),
// whose low 20 bits name the period: its start in wall-clock seconds,
// modulo 2^20. The count belongs to the period it names, whatever the
// wall clock has done since: a step of it (a resume from suspend, an NTP
// step) moves the wall against the table's monotonic clock, and the end by
// one clock is not the end by the other any more. Two periods of one name
// start a multiple of 2^20 s apart, which whole days (give or take DST's
// hours) are only 8192 days on: a count read as a later period's would
// have lain untouched in the table for 22 years.
// docs/metering-and-quotas.md says what a step does.
const periodBits = 20

// quotaState is the count st holds in the period that starts at start
// (the one that holds the wall's now): nothing when st names another.
func quotaState(st bucket.State, start int64) bucket.QuotaState {
	if st.FullAt == 0 || st.FullAt&(1<<periodBits-1) != periodName(start) {
		return bucket.QuotaState{}
	}
	return bucket.QuotaState{Start: start, Used: st.Slack}
}

// tableQuota is the table's State for qs, off being what to add to the
// table's clock for the wall's. A count that a give-back took back to 0
// keeps its period's name: a take that read the clock before that period
// began, and locks now, is counted in it (racedPast), not from 0 in the
// period before, whose count this one replaced. A count used up is marked
// as a ban is (bannedBit), so that eviction spares it while it can
// (Store.makeRoom): a client it refuses cannot start over by flooding the
// table with new keys.
func tableQuota(qs bucket.QuotaState, q bucket.Quota, off int64) bucket.State {
	if qs == (bucket.QuotaState{}) {
		return bucket.State{}
	}
	_, end := q.Bounds(qs.Start)
	const unit = 1 << periodBits
	return bucket.State{FullAt: (end-off+unit-1)&^(unit-1) | periodName(qs.Start), Slack: qs.Used, Banned: qs.Used >= q.N}
}

// periodName is the low bits of a period's start in seconds.
func periodName(start int64) int64 { return start / 1_000_000 & (1<<periodBits - 1) }

// takeQuotas is Take on a tier with quotas, at now and wall: the quotas' counts live beside
// the limits' states, under the same shard lock, each until its period
// ends.
func (s *Store) takeQuotas(id uint64, tr bucket.Tier, cost int64, out []bucket.Result, now, wall int64) bool {
	sh := s.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return s.takeQuotasLocked(sh, id, tr, cost, out, now, racedPast(sh, id, tr.Quotas, wall), wall-now)
}

// takeQuotasLocked is takeQuotas under sh's lock, counting the quotas at
// wall, off being what to add to the table's clock for the wall clock the
// take read.
func (s *Store) takeQuotasLocked(sh *shard, id uint64, tr bucket.Tier, cost int64, out []bucket.Result, now, wall, off int64) bool {
	ls, qs := tr.Limits, tr.Quotas
	out, qout := out[:len(ls)], out[len(ls):len(ls)+len(qs)]
	var states, olds [bucket.MaxLimits]bucket.State
	var qstates, qolds [bucket.MaxQuotas]bucket.QuotaState
	var stored [bucket.MaxQuotas]bucket.State
	for i := range ls {
		states[i], _ = sh.states.get(limitID(id, i))
	}
	for i, q := range qs {
		stored[i], _ = sh.states.get(quotaID(id, q.Period))
		start, _ := q.Bounds(wall)
		qstates[i] = quotaState(stored[i], start)
	}
	olds, qolds = states, qstates
	allowed := bucket.TakeAllQuotas(states[:len(ls)], qstates[:len(qs)], now, wall, ls, qs, cost, out, qout)
	for i := range ls {
		if states[i] != olds[i] {
			s.putLocked(sh, limitID(id, i), states[i], now)
		}
	}
	for i, q := range qs {
		switch {
		case qstates[i] != qolds[i]:
			s.putLocked(sh, quotaID(id, q.Period), tableQuota(qstates[i], q, off), now)
		case qstates[i] != (bucket.QuotaState{}) && stored[i].Banned != (qstates[i].Used >= q.N):
			// A reload changed N since the count was written: its mark
			// follows, so that a count the reload used up is spared by
			// eviction as one a take used up.
			stored[i].Banned = !stored[i].Banned
			sh.states.put(quotaID(id, q.Period), stored[i])
		}
	}
	return allowed
}

// quotaRace is how close to its period's end a take's wall clock may be
// read and still find the next period counted by a take that read the
// clock after it but took the lock first (racedPast): the two reads of
// requests in flight together, far below any step of the clock.
const quotaRace = 1_000_000 // µs

// racedPast is the moment a take that read wall counts at: wall, or, when
// a quota's count is already the next period's and wall is within
// quotaRace of its own period's end, that end. Such a take raced one that
// read the clock after the boundary and locked first; counted in the
// period that ended, it would have found no count there (the next
// period's replaced it), admitted past a used-up quota, and replaced the
// next period's count with its own. Counted at the boundary, it is
// counted with the other
// (TestATakeThatReadTheClockBeforeAPeriodsEndIsCountedInTheNextOneWhenThatCountedFirst).
// A step of the clock back across a boundary, longer than quotaRace,
// counts in the earlier period as before
// (TestALocalQuotaCountAfterAStepBackAcrossABoundary).
func racedPast(sh *shard, id uint64, qs []bucket.Quota, wall int64) int64 {
	at := wall
	for _, q := range qs {
		st, _ := sh.states.get(quotaID(id, q.Period))
		if st.FullAt == 0 {
			continue
		}
		start, end := q.Bounds(wall)
		name := st.FullAt & (1<<periodBits - 1)
		if name != periodName(start) && name == periodName(end) && end-wall <= quotaRace {
			at = max(at, end)
		}
	}
	return at
}

// updateQuotas applies f to each limit's state and g to each quota's
// count, under the bucket's shard lock.
func (s *Store) updateQuotas(id uint64, ls []bucket.Limit, qs []bucket.Quota, f func(bucket.State, int64, bucket.Limit) bucket.State, g func(bucket.QuotaState, int64, bucket.Quota) bucket.QuotaState) {
	sh := s.shard(id)
	now := s.now()
	wall := s.wall()
	sh.mu.Lock()
	defer sh.mu.Unlock()
	for i, l := range ls {
		st, _ := sh.states.get(limitID(id, i))
		if next := f(st, now, l); next != st {
			s.putLocked(sh, limitID(id, i), next, now)
		}
	}
	for _, q := range qs {
		st, _ := sh.states.get(quotaID(id, q.Period))
		start, _ := q.Bounds(wall)
		qst := quotaState(st, start)
		next := g(qst, wall, q)
		if qst == (bucket.QuotaState{}) && st.FullAt > now {
			// The count of another period that has not ended: one counted
			// in another time zone, before a reload changed it. A
			// give-back or a charge of a request of the old config does
			// not erase it.
			continue
		}
		if next != qst {
			s.putLocked(sh, quotaID(id, q.Period), tableQuota(next, q, wall-now), now)
		}
	}
}
