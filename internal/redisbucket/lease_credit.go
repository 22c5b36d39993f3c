package redisbucket

import (
	"context"
	"math"
	"sync"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"go.uber.org/zap"
)

// Credit (`credit <k>` with lease, docs/fleet.md): a node admits the first
// k requests of a key it holds no lease entry for at once, and charges
// their cost to every limit of the tier in the background, as
// cost_from_response's charge does, into debt if need be. A cold key then
// costs no wait, and still one call. A charge never lifts a ban: the
// request was admitted before the node could know of it.
//
// The debt rule: a node forgets an idle key after lease_ttl, and would
// give it credit again. So the charge's answer says how long until the
// bucket is out of debt (buckettest.Shared's Charge, the script's charge),
// and the node keeps the key, with no credit left, until then: never
// evicted, never dropped as idle. The time runs from the answer's arrival
// on this node's clock, which is after Redis's own moment of the charge,
// so the node never forgets the key before the debt it was told of ends.
// While a shard of the table has no room to keep another such key, its new
// keys get no credit. Over every window T the fleet then admits at most
// C + floor(rT) + nodes x k requests' tokens
// (TestCreditNeverAdmitsMoreThanNodesTimesKOverAnyWindow).
//
// Credit is given only while the node's calls to the store succeed (the
// last one did, and the breaker is closed): a charge that fails leaves its
// requests uncharged, as a failed cost_from_response charge does, and then
// cold keys are decided as without credit, so that on_store_error decides
// them once the store is down.
//
// With the rest of a tier: a credited request is admitted without a wait
// (max_wait), takes its slot after as any request does (concurrency);
// its count_status give-back and a cost_from_response charge go to the
// shared bucket (the node holds no lease to take them), after or before
// the credit's charge, which only ever admits less (a give-back never
// fills past the capacity). Several limits: each is charged, and the
// debt is the longest. A tier with a quota gets no credit: a quota is
// never in debt, so nothing would stop the nodes crediting a client past
// a used-up one (the root's checkCredit refuses it at adapt).

// credited decides a request on credit, if the entry e has any left: it
// is admitted, and its cost charged in the background. Under the shard's
// lock.
func (t *leaseTable) credited(e *lease, cost, now int64, out []bucket.Result) (bucket.Result, bool) {
	if e.credit <= 0 {
		return bucket.Result{}, false
	}
	if len(e.tier.Quotas) > 0 || t.failing != nil && t.failing() {
		// A quota is never in debt: the debt rule could not bound what
		// credit admits past a used-up one (the Caddyfile refuses both).
		// And a store that fails would not be charged: the request is
		// decided as without credit, on_store_error included.
		e.credit = 0
		return bucket.Result{}, false
	}
	e.credit--
	e.owed += cost
	if !e.charging {
		t.chargeOwed(e)
	}
	return creditResult(e.tier, cost, now, out), true
}

// creditResult is what a request admitted on credit reports: each limit
// as strict mode reports a key's first request, a full bucket less the
// cost. The node knows nothing of the shared bucket yet; the headers of
// the key's next requests read what the calls found, as leases' do.
func creditResult(tr bucket.Tier, cost, now int64, out []bucket.Result) bucket.Result {
	var first bucket.Result
	for i, l := range tr.Limits {
		_, r := bucket.Take(bucket.State{}, now, l, cost)
		if i < len(out) {
			out[i] = r
		}
		if i == 0 || r.Remaining < first.Remaining {
			first = r
		}
	}
	return first
}

// chargeOwed charges what e's requests took on credit, in one background
// call; requests credited while it is out are charged by the next, when
// it answers. Under the shard's lock.
func (t *leaseTable) chargeOwed(e *lease) {
	n := e.owed
	e.owed, e.charging = 0, true
	if t.debts != nil {
		// Until the answer says whether it left a debt, the next config's
		// table gives the key no credit either.
		t.debts.charging(e.key)
	}
	t.calls.Add(1)
	go func(key string, tr bucket.Tier) {
		defer t.calls.Done()
		debt, err := t.store.charge(key, tr, n)
		sh := t.shard([]byte(key))
		sh.mu.Lock()
		defer sh.mu.Unlock()
		e.charging = false
		now := t.now()
		switch {
		case err != nil:
			e.credit = 0
			t.logger.Debug("redis store: charging requests admitted on credit failed; they go uncharged", zap.Int64("tokens", n), zap.Error(err))
		case debt > 0:
			e.credit = 0
			e.debtUntil = max(e.debtUntil, now+debt)
		}
		if t.debts != nil {
			t.debts.charged(key, e.debtUntil, now)
		}
		if e.owed > 0 {
			t.chargeOwed(e)
		}
	}(e.key, e.tier)
}

// storeFailing says whether the last call to the store failed, or its
// breaker is open: credit is off meanwhile.
func (s *Store) storeFailing() bool {
	b := &s.conn.breaker
	return b.open() || b.failures.Load() != 0
}

// keeps says whether the debt rule keeps e: a charge of its credit is
// owed or out, or the bucket is in debt as its answer said.
func (t *leaseTable) keeps(e *lease, now int64) bool {
	return e.charging || e.owed > 0 || now < e.debtUntil
}

// creditFor is the credit a new entry gets in a shard that holds n
// entries once room is made: none when the shard could not keep it.
func (t *leaseTable) creditFor(n int) int64 {
	if n >= t.perShard {
		return 0
	}
	return t.credit
}

// chargeShared charges n tokens to every limit and quota of the tier tr
// of the shared bucket at key, into debt if need be, by one script call;
// it reports how long until every limit holds 0 tokens or more again.
func (s *Store) chargeShared(ctx context.Context, key string, tr bucket.Tier, n int64) (int64, error) {
	v, err := s.call(context.WithoutCancel(ctx), key, s.args("charge", tr, 0, n), false, 3)
	if err != nil {
		return 0, err
	}
	return v[2], nil
}

// charge is chargeShared for credit, apart from any request's context.
func (s *Store) charge(key string, tr bucket.Tier, n int64) (int64, error) {
	return s.chargeShared(context.Background(), key, tr, n)
}

// debtBook is, for one connection, the keys whose credit charge left the
// shared bucket in debt, and until when (the tables' clock, the
// connection's). A reload makes a new lease table, which holds no entry
// for them and would credit each again: nodes x k more at every reload.
// So the debt rule reaches the tables of every config on the connection
// through it: a new entry of a key in debt gets no credit, and is kept
// until the debt ends. It holds at most most keys; while it is full of
// keys still in debt, new keys get no credit, as while a table's shard is
// (creditFor).
type debtBook struct {
	mu    sync.Mutex
	until map[string]int64
	most  int
	// next is the earliest end of the debts pruning kept or note added
	// since: no prune finds one ended before then, so that a book full of
	// debts costs a flood of new keys no scan each.
	next int64
}

func newDebtBook(most int) *debtBook {
	return &debtBook{until: make(map[string]int64), most: max(1, most)}
}

// charging marks key while a charge of it is out: in debt until its
// answer (charged). A book with no room for it marks nothing.
func (b *debtBook) charging(key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.until[key]; ok || len(b.until) < b.most {
		b.until[key] = math.MaxInt64
	}
}

// charged records what a charge of key answered: in debt until until,
// or, when that has passed (no debt), not in debt.
func (b *debtBook) charged(key string, until, now int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if until <= now {
		delete(b.until, key)
		return
	}
	if _, ok := b.until[key]; !ok && len(b.until) >= b.most {
		b.prune(now)
	}
	if _, ok := b.until[key]; ok || len(b.until) < b.most {
		b.until[key] = until
		b.next = min(b.next, until)
	}
}

// creditFor is the credit and the debt's end for a new entry of key that
// the table would credit k: none, and until when to keep it, while the
// key is in debt; none while the book has no room for another key.
func (b *debtBook) creditFor(key string, k, now int64) (credit, debtUntil int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if until, ok := b.until[key]; ok {
		switch {
		case until == math.MaxInt64:
			// A charge is out: the table that made it keeps the key,
			// and the book learns its debt.
			return 0, 0
		case until > now:
			return 0, until
		}
		delete(b.until, key)
	}
	if len(b.until) >= b.most {
		b.prune(now)
		if len(b.until) >= b.most {
			return 0, 0
		}
	}
	return k, 0
}

// prune forgets the debts that have ended.
func (b *debtBook) prune(now int64) {
	if now < b.next {
		return
	}
	b.next = math.MaxInt64
	for key, until := range b.until {
		if until <= now {
			delete(b.until, key)
		} else {
			b.next = min(b.next, until)
		}
	}
}
