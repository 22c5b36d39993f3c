package redisbucket

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// charge is the model's charge after the fact, as the script's: the
// bucket may go into debt, and the answer says how long until it is out.
func (m *sharedModel) charge(key string, tr bucket.Tier, n int64) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.down {
		return 0, errBreakerOpen
	}
	sh := m.bucket(key, len(tr.Limits))
	debt := sh.Charge(m.now(), tr.Limits, n)
	sh.ChargeQuotas(m.now(), tr.Quotas, n)
	return debt, nil
}

// creditModel is the model store for credit: a charge may be held until
// the test lets it through (a slow round trip), and, as a mutation, its
// answer may say the bucket is never in debt (no debt rule).
type creditModel struct {
	*sharedModel
	gate    chan struct{}
	noDebt  bool
	charges int
}

func (c *creditModel) charge(key string, tr bucket.Tier, n int64) (int64, error) {
	c.mu.Lock()
	g := c.gate
	c.mu.Unlock()
	if g != nil {
		<-g
	}
	debt, err := c.sharedModel.charge(key, tr, n)
	c.mu.Lock()
	c.charges++
	c.mu.Unlock()
	if c.noDebt {
		debt = 0
	}
	return debt, err
}

// newCreditTable is a lease table on the model c that gives k requests of
// a key with no entry credit.
func newCreditTable(c *creditModel, size LeaseSize, ttl time.Duration, maxEntries int, k int64) *leaseTable {
	tb := newLeaseTable(c, c.now, size, ttl, 100*time.Millisecond, maxEntries, nopLogger)
	tb.credit = k
	return tb
}

// A cold key's first k requests are admitted while their charge is still
// out (no wait on the store), each reporting a full bucket less its cost;
// one call charges them, and the next request leases as without credit.
func TestACreditedColdKeyIsAdmittedBeforeItsChargeAnswers(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := bucket.Limit{Capacity: 20, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	tb := newCreditTable(c, LeaseSize{tokens: 5}, time.Second, 1000, 2)
	defer tb.close()
	key := []byte("cold")
	for i := range 2 {
		out := make([]bucket.Result, 1)
		res, err := tb.take(bg, key, oneLimit(l), 1, out)
		if err != nil || !res.Allowed {
			t.Fatalf("credited request %d: %+v %v; want allowed at once", i+1, res, err)
		}
		if res.Remaining != l.Capacity-1 || res.ResetAfter != l.Rate.Interval || out[0] != res {
			t.Fatalf("credited request %d reports %+v (out %+v); want a full bucket less its cost: %d left, full in %d µs", i+1, res, out[0], l.Capacity-1, l.Rate.Interval)
		}
	}
	if sm.calls != 0 {
		t.Fatalf("%d calls answered before the charge was let through; want none", sm.calls)
	}
	close(c.gate)
	tableSync(tb)
	// The first request's charge, then the second's, which came while it
	// was out.
	if c.charges != 2 || sm.level(string(key), l) != l.Capacity-2 {
		t.Fatalf("%d charges, level %d; want 2 charges and %d left", c.charges, sm.level(string(key), l), l.Capacity-2)
	}
	calls := sm.calls
	if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
		t.Fatalf("the third request: %+v %v", res, err)
	}
	tableSync(tb)
	if c.charges != 2 || sm.calls != calls+1 {
		t.Fatalf("the third request made %d calls, %d charges in all; want one lease call and no charge", sm.calls-calls, c.charges)
	}
	_ = clock
}

// The debt rule: a key whose charge left the bucket in debt is kept past
// lease_ttl idle, with no credit, until the debt the answer named is paid;
// only then is it forgotten, and credited again.
func TestADebtKeepsTheKeyWithNoCreditUntilItIsPaid(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	tb := newCreditTable(c, LeaseSize{tokens: 5}, time.Second, 1000, 3)
	defer tb.close()
	key := []byte("debtor")
	// Another node took 9 of 10: 3 on credit leave the bucket 2 in debt.
	sm.mu.Lock()
	sm.bucket(string(key), 1).Take(clock.now(), []bucket.Limit{l}, 9, make([]bucket.Result, 1))
	sm.mu.Unlock()
	for range 3 {
		if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
			t.Fatalf("credited: %+v %v", res, err)
		}
	}
	c.mu.Lock()
	close(c.gate)
	c.gate = nil
	c.mu.Unlock()
	tableSync(tb)
	if level := sm.level(string(key), l); level != 0 {
		t.Fatalf("level %d after the charges; want 0 (2 in debt)", level)
	}
	// Idle for lease_ttl and more, the debt not yet paid (2 s from the
	// charge): kept, and the next request is decided by a lease call.
	clock.advance(1200 * time.Millisecond)
	tb.sweep(clock.now(), false)
	if !tb.holds(key) {
		t.Fatal("the key was forgotten while the bucket was in debt")
	}
	charges := c.charges
	res, err := tb.take(bg, key, oneLimit(l), 1, nil)
	tableSync(tb)
	if err != nil || res.Allowed || c.charges != charges {
		t.Fatalf("a request while the bucket is in debt: %+v %v, %d charges; want refused by a lease call, no credit", res, err, c.charges-charges)
	}
	// Paid, and idle for lease_ttl: forgotten, and a new entry has credit.
	clock.advance(2 * time.Second)
	tb.sweep(clock.now(), false)
	if tb.holds(key) {
		t.Fatal("the key is kept after its debt was paid and it was idle for lease_ttl")
	}
	if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
		t.Fatalf("a request once the debt is paid: %+v %v; want allowed on credit", res, err)
	}
	tableSync(tb)
	if c.charges != charges+1 {
		t.Fatalf("%d charges; want one more", c.charges-charges)
	}
}

// A ban the credited requests meet holds: the charge does not end it, its
// answer keeps the key, and the node's next request learns of the ban.
func TestACreditChargeLeavesABanInPlace(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm}
	l := bucket.Limit{Capacity: 4, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}, Ban: 60_000_000}
	tb := newCreditTable(c, LeaseSize{tokens: 2}, time.Second, 1000, 1)
	defer tb.close()
	key := []byte("banned")
	sm.mu.Lock()
	sh := sm.bucket(string(key), 1)
	sh.Take(clock.now(), []bucket.Limit{l}, 4, make([]bucket.Result, 1))
	out := make([]bucket.Result, 1)
	sh.Take(clock.now(), []bucket.Limit{l}, 1, out)
	sm.mu.Unlock()
	if !out[0].Banned {
		t.Fatalf("setup: %+v; want a ban", out[0])
	}
	if res, err := tb.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
		t.Fatalf("credited: %+v %v", res, err)
	}
	tableSync(tb)
	clock.advance(5 * time.Second)
	tb.sweep(clock.now(), false)
	if !tb.holds(key) {
		t.Fatal("the key was forgotten during the ban its charge met")
	}
	res, err := tb.take(bg, key, oneLimit(l), 1, nil)
	tableSync(tb)
	if err != nil || res.Allowed || res.RetryAfter < 50_000_000 {
		t.Fatalf("a request 5 s into a 60 s ban: %+v %v; want refused until the ban ends", res, err)
	}
}

// While a shard of the table is full of keys the debt rule keeps, its new
// keys get no credit: they wait on a lease call, as without credit.
func TestCreditIsOffWhileTheTableCannotKeepAnotherKey(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 1, Interval: 1_000_000}}
	tb := newCreditTable(c, LeaseSize{tokens: 5}, time.Second, leaseShards, 1) // one entry a shard
	defer tb.close()
	first := []byte("k0")
	var other []byte
	for i := 1; other == nil; i++ {
		if k := fmt.Appendf(nil, "k%d", i); tb.shard(k) == tb.shard(first) {
			other = k
		}
	}
	if res, err := tb.take(bg, first, oneLimit(l), 1, nil); err != nil || !res.Allowed {
		t.Fatalf("credited: %+v %v", res, err)
	}
	// Its charge is out: the shard's one entry is kept.
	calls := sm.calls
	if res, err := tb.take(bg, other, oneLimit(l), 1, nil); err != nil || !res.Allowed || sm.calls != calls+1 {
		t.Fatalf("a key of the full shard: %+v %v after %d calls; want allowed by a lease call", res, err, sm.calls-calls)
	}
	close(c.gate)
	tableSync(tb)
	if c.charges != 1 {
		t.Fatalf("%d charges; want the first key's alone", c.charges)
	}
	_ = clock
}

// On a tier of two limits, a credited request reports each limit as a
// full bucket less its cost, and its charge takes from both; its
// count_status give-back and a cost_from_response charge after it go to
// the shared bucket, since the node holds no lease to take them.
func TestCreditChargesEveryLimitAndItsGiveBackGoesToTheSharedBucket(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm}
	hour := bucket.Rate{Tokens: 1, Interval: 3_600_000_000}
	tr := bucket.Tier{Limits: []bucket.Limit{{Capacity: 10, Rate: hour}, {Capacity: 50, Rate: hour}}}
	tb := newCreditTable(c, LeaseSize{tokens: 4}, time.Second, 1000, 1)
	defer tb.close()
	key := []byte("two limits")
	out := make([]bucket.Result, 2)
	res, err := tb.take(bg, key, tr, 2, out)
	tableSync(tb)
	if err != nil || !res.Allowed || out[0].Remaining != 8 || out[1].Remaining != 48 || res != out[0] {
		t.Fatalf("credited: %+v %v, each %+v; want allowed, 8 and 48 left, the first binding", res, err, out)
	}
	levels := func() [2]int64 {
		sm.mu.Lock()
		defer sm.mu.Unlock()
		each := make([]bucket.Result, 2)
		sm.bucket(string(key), 2).Peek(clock.now(), tr.Limits, each)
		return [2]int64{each[0].Remaining, each[1].Remaining}
	}
	if got := levels(); got != [2]int64{8, 48} {
		t.Fatalf("levels %v after the charge; want [8 48]", got)
	}
	if rest := tb.giveBackHeld(key, 2); rest != 2 {
		t.Fatalf("a give-back of the credited request: %d to the shared bucket; want 2", rest)
	}
	if rest := tb.chargeHeld(key, 3); rest != 3 {
		t.Fatalf("a charge after the credited request: %d to the shared bucket; want 3", rest)
	}
}

// holds says whether the table has an entry for key.
func (t *leaseTable) holds(key []byte) bool {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return sh.m[string(key)] != nil
}

// creditRound is one random trace's settings for the credit property.
type creditRound struct {
	limit  bucket.Limit
	size   LeaseSize
	ttl    time.Duration
	nodes  int
	credit int64
	steps  int
	noDebt bool
	// reload: before each attack every node reloads (a new table, with
	// the node's book of debts unless noBook, a mutation).
	reload, noBook bool
}

func randomCreditRound(rng *rand.Rand, steps int) creditRound {
	interval := []int64{200_000, 1_000_000, 2_000_000}[rng.IntN(3)]
	l := bucket.Limit{Capacity: 2 + rng.Int64N(30), Rate: bucket.Rate{Tokens: 1 + rng.Int64N(4), Interval: interval}}
	if rng.IntN(4) == 0 {
		l.Ban = 1 + rng.Int64N(5_000_000)
	}
	size := LeaseSize{tokens: 2 + rng.Int64N(10)}
	if rng.IntN(2) == 0 {
		size = LeaseSize{percent: 10 + 40*rng.Float64()}
	}
	return creditRound{
		limit: l, size: size,
		ttl:    []time.Duration{200 * time.Millisecond, time.Second}[rng.IntN(2)],
		nodes:  2 + rng.IntN(5),
		credit: 1 + rng.Int64N(3),
		steps:  steps,
	}
}

// creditAdmission is a request the fleet admitted, and when.
type creditAdmission struct{ at, cost int64 }

// runCredit plays one random trace of nodes with credit and reports the
// first window whose admissions pass C + floor(rT) + nodes x k requests'
// tokens, or nil. It starts from a random state (part spent, in debt, a
// dead node's lease out), and mixes requests on random nodes, clock steps,
// sweeps, charges held back while other requests go on (a slow round
// trip), and the attack: k requests to every node every lease_ttl + 200
// ms, which a node that forgot the key would credit again.
func runCredit(rng *rand.Rand, r creditRound) (charges int, err error) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000 + rng.Int64N(1_000_000_000))
	l := r.limit
	tr := oneLimit(l)
	key := "bucket"
	m := &creditModel{sharedModel: newSharedModel(clock.now), noDebt: r.noDebt}
	now := clock.now()
	start := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	switch rng.IntN(3) {
	case 0:
		if k := rng.Int64N(l.Capacity + 1); k > 0 {
			start.Levels[0], _ = bucket.Take(bucket.State{}, now, l, k)
		}
	case 1:
		start.Levels[0] = bucket.Charge(bucket.State{}, now, l, l.Capacity+rng.Int64N(2*l.Capacity))
	}
	if rng.IntN(3) == 0 {
		start.Held = append(start.Held, buckettest.Held{Node: "dead", Tokens: rng.Int64N(l.Capacity/2 + 1), Expires: now + rng.Int64N(3*r.ttl.Microseconds()), Seq: 1})
	}
	m.states[key] = start

	tables := make([]*leaseTable, r.nodes)
	books := make([]*debtBook, r.nodes)
	for i := range tables {
		tables[i] = newCreditTable(m, r.size, r.ttl, 1000, r.credit)
		tables[i].jitter = rand.New(rand.NewPCG(rng.Uint64(), 0)).Int64N
		books[i] = newDebtBook(1000)
		tables[i].debts = books[i]
	}
	reload := func(i int) {
		next := newCreditTable(m, r.size, r.ttl, 1000, r.credit)
		next.jitter = tables[i].jitter
		if !r.noBook {
			next.debts = books[i]
		}
		tables[i].close()
		tables[i] = next
	}
	defer func() {
		for _, tb := range tables {
			tb.close()
		}
	}()
	var adm []creditAdmission
	take := func(i int) {
		res, err := tables[i].take(bg, []byte(key), tr, 1, make([]bucket.Result, 1))
		if err == nil && res.Allowed {
			adm = append(adm, creditAdmission{clock.now(), 1})
		}
	}
	syncAll := func() {
		for _, tb := range tables {
			tableSync(tb)
		}
	}
	sweepAll := func() {
		for _, tb := range tables {
			if back := tb.sweep(clock.now(), false); len(back) > 0 {
				tb.giveBackNow(back)
			}
		}
	}
	for range r.steps {
		switch op := rng.IntN(100); {
		case op < 50:
			take(rng.IntN(len(tables)))
			syncAll()
		case op < 70:
			step := rng.Int64N(r.ttl.Microseconds())
			if rng.IntN(3) == 0 {
				step = rng.Int64N(1000)
			}
			clock.advance(time.Duration(step) * time.Microsecond)
		case op < 78:
			sweepAll()
		case op < 90:
			// The attack: k requests to every node, lease_ttl + 200 ms
			// after the last, once the nodes swept their idle keys; with
			// reload, each node's config reloaded first.
			if r.reload {
				for i := range tables {
					reload(i)
				}
			}
			for range r.credit {
				for i := range tables {
					take(i)
				}
			}
			syncAll()
			clock.advance(r.ttl + 200*time.Millisecond)
			sweepAll()
		default:
			// Charges held back for a while: requests on every node go on
			// meanwhile, and the clock with them.
			gate := make(chan struct{})
			m.mu.Lock()
			m.gate = gate
			m.mu.Unlock()
			for range 1 + rng.IntN(8) {
				take(rng.IntN(len(tables)))
				clock.advance(time.Duration(rng.Int64N(50_000)) * time.Microsecond)
			}
			m.mu.Lock()
			m.gate = nil
			m.mu.Unlock()
			close(gate)
			syncAll()
		}
	}
	syncAll()
	return m.charges, checkCreditWindows(adm, l, int64(r.nodes)*r.credit)
}

// checkCreditWindows checks every window between two admissions: at most
// C + floor(rT) + extra tokens.
func checkCreditWindows(adm []creditAdmission, l bucket.Limit, extra int64) error {
	slices.SortStableFunc(adm, func(a, b creditAdmission) int { return int(a.at - b.at) })
	sum := make([]int64, len(adm)+1)
	for i, a := range adm {
		sum[i+1] = sum[i] + a.cost
	}
	for i := range adm {
		for j := i; j < len(adm); j++ {
			span := adm[j].at - adm[i].at
			bound := l.Capacity + span*l.Rate.Tokens/l.Rate.Interval + extra
			if got := sum[j+1] - sum[i]; got > bound {
				return fmt.Errorf("%d tokens admitted over the %d µs from %d; want at most %d (C + floor(rT) + nodes x k)", got, span, adm[i].at, bound)
			}
		}
	}
	return nil
}

// credit k (issue 35): over every window T, a fleet of nodes with credit
// admits at most C + floor(rT) + nodes x k, from random states and under
// the attack of k requests to every node every lease_ttl + 200 ms.
func TestCreditNeverAdmitsMoreThanNodesTimesKOverAnyWindow(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if v, err := strconv.ParseUint(os.Getenv("CREDIT_SEED"), 10, 64); err == nil {
		seed = v
	}
	t.Logf("seed %d (CREDIT_SEED=%d replays it)", seed, seed)
	rng := rand.New(rand.NewPCG(35, seed))
	rounds, steps := 300, 500
	if testing.Short() {
		rounds, steps = 80, 300
	}
	charges := 0
	for i := range rounds {
		r := randomCreditRound(rng, steps)
		n, err := runCredit(rng, r)
		if err != nil {
			t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes, credit %d): %v", i, r.limit, r.size, r.ttl, r.nodes, r.credit, err)
		}
		charges += n
	}
	if charges < 3*rounds {
		t.Errorf("%d credit charges in %d rounds: too few to say anything", charges, rounds)
	}
	t.Logf("%d credit charges in %d rounds", charges, rounds)
}

// The credit property catches a fleet without the debt rule: nodes that
// forget a key in debt after lease_ttl credit it again at every attack.
func TestTheCreditPropertyCatchesAFleetWithoutTheDebtRule(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(35, 11))
	for round := range 60 {
		r := randomCreditRound(rng, 300)
		r.noDebt = true
		if _, err := runCredit(rng, r); err != nil {
			t.Logf("caught in round %d: %v", round, err)
			return
		}
	}
	t.Fatal("no round caught the fleet without the debt rule")
}

// Against a real redis-server 50 ms away each way: a cold key's credited
// request answers at once, not after a round trip, and its charge reaches
// the shared bucket once; the key's next request leases, one round trip.
func TestACreditedColdKeyDoesNotWaitOnRedis(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	proxy := redistest.StartProxy(t, srv.Addr(), 50*time.Millisecond)
	plan, err := NewPlan(Options{Addresses: []string{"redis://" + proxy.Addr()}, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	s := NewStore(conn, StoreOptions{Lease: LeaseSize{tokens: 5}, Credit: 1})
	defer func() { s.Close(); _ = conn.Close() }()
	direct := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	l := slowLimit(20)
	key := bucketFor("cold over a slow link")
	out := make([]bucket.Result, 1)
	began := time.Now()
	allowed, err := s.Take(bg, key, oneLimit(l), 1, out)
	took := time.Since(began)
	if err != nil || !allowed || took >= 25*time.Millisecond {
		t.Fatalf("a cold key's first request: %v %v after %v; want allowed well within the 100 ms round trip", allowed, err, took)
	}
	tableSync(s.leases)
	if err := direct.Peek(bg, key, oneLimit(l), out); err != nil || out[0].Remaining != l.Capacity-1 {
		t.Fatalf("the shared bucket after the charge: %+v %v; want %d left, charged once", out[0], err, l.Capacity-1)
	}
	began = time.Now()
	allowed, err = s.Take(bg, key, oneLimit(l), 1, out)
	if took := time.Since(began); err != nil || !allowed || took < 100*time.Millisecond {
		t.Fatalf("the second request: %v %v after %v; want allowed by a lease call, one round trip", allowed, err, took)
	}
}

// Credit only while the node's calls to Redis succeed: once one fails, a
// cold key is no longer admitted on credit (uncharged, as its charge would
// fail too) but decided as without it, so on_store_error applies.
func TestCreditIsOffOnceACallToRedisFails(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	plan, err := NewPlan(Options{Addresses: []string{srv.URL()}, Timeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	s := NewStore(conn, StoreOptions{Lease: LeaseSize{tokens: 5}, Credit: 1})
	defer func() { s.Close(); _ = conn.Close() }()
	l := slowLimit(20)
	if allowed, err := s.Take(bg, bucketFor("warm"), oneLimit(l), 1, make([]bucket.Result, 1)); err != nil || !allowed {
		t.Fatalf("while Redis is up: %v %v", allowed, err)
	}
	tableSync(s.leases)
	srv.Kill()
	if _, err := s.Take(bg, bucketFor("warm"), oneLimit(l), 1, make([]bucket.Result, 1)); err == nil {
		t.Fatal("a lease call with Redis gone: no error")
	}
	allowed, err := s.Take(bg, bucketFor("cold"), oneLimit(l), 1, make([]bucket.Result, 1))
	if err == nil || allowed {
		t.Fatalf("a cold key after a call failed: %v %v; want the store's error, not credit", allowed, err)
	}
}
