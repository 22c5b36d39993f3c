package redisbucket

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"
	"go.uber.org/zap"
)

// The fleet's guarantees, as a property over random traces on the model
// store (shared.go) with real lease tables. Safety: over every window [a, b]
// between two admissions, not only one that starts from a full bucket, the
// tokens the fleet admitted, less those count_status gave back within the
// window, are at most C + floor(r*(b-a)), as one bucket allows. (A single
// bucket admits more than C + r*T over a window in which the tokens of
// requests admitted before it come back; what it never does is take more
// than that, net.) Each trace starts
// from a random state: a bucket part spent, tokens still out on the lease
// of a node that died. The traces mix requests on 2 to 5 nodes, leases of
// many tokens, clock steps, lease give-backs, count_status give-backs,
// reloads, outages, requests decided in strict mode, and bans. With a ban,
// the fleet admits after the ban starts at most the tokens then out on
// lease, all within lease_ttl of it. With max_wait, a request's tokens count when they are
// due (its decision plus its wait): the bound holds over every window of
// due times, and the ban's over decisions. Quotas count in zones whose
// calendars are odd (DST, fall-backs at midnight), with clock jumps of
// hours across their periods' ends.
//
// Liveness, on the same traces: a request refused while the shared bucket
// holds its cost, in every limit and quota, as one bucket would admit it,
// is refused only by an allowance the design names (liveLease): the
// node's hold-off after its last call, while the limits lack what it asked
// for, plus the hold-off's jitter; or, after a call that found a quota
// used up, the deny cache's cap (quotaDenyFor). The traces also cancel
// requests while their call is out, reload a node mid-call, and charge
// huge figures after the fact (cost_from_response). Those of chargeRound
// charge a part of the tokens a node holds on lease, all of them, or more
// (the rest to the shared bucket), give back a node's recent requests,
// which may go into a lease a charge spent, and drain a small bucket that
// refills within lease_ttl in bursts of requests at one instant.

// admission is one request the fleet allowed. returned marks, in the
// events of a trace, the give-back of an earlier one's cost.
type admission struct {
	at, cost int64
	// from is, for a give-back, when the request it returns was decided.
	from int64
	// due is when the request goes on: at, plus its wait.
	due      int64
	node     int
	returned bool
}

// banStart is a ban as the model store saw it start: when, after which of
// the trace's events, with how many tokens out on lease, until when.
type banStart struct {
	at, out, until int64
	after          int
}

// fleetRound is one random trace's settings.
type fleetRound struct {
	limit bucket.Limit
	// more are the tier's other limits, and quotas its quotas: a lease
	// takes from them all at once.
	more   []bucket.Limit
	quotas []bucket.Quota
	size   LeaseSize
	ttl    time.Duration
	nodes  int
	steps  int
	mutate func(sh *buckettest.Shared, res *bucket.LeaseResult)
	// mutateWait, when set, breaks the strict take that a waiting request
	// makes.
	mutateWait func(sh *buckettest.Shared, res *bucket.Result)
	// mutateCharge, when set, breaks the shared bucket after a charge of
	// n (cost_from_response).
	mutateCharge func(sh *buckettest.Shared, n int64)
	// mutateChargeHeld, when set, breaks the shared bucket after a charge
	// spent n of the tokens node held on lease, before the node's next
	// call says so.
	mutateChargeHeld func(sh *buckettest.Shared, now int64, ls []bucket.Limit, node string, n int64)
	// charges mixes into the trace charges of what nodes hold on lease
	// and beyond, and give-backs of their recent requests.
	charges bool
	// byID, when set, has the nodes decide each request as the root does:
	// by the bucket's id first (takeByID), by key when that reports false.
	byID *idWay
}

// idWay counts the requests of a fleet round that the id way decided, and
// those allowed by key, with how many of them the tokens held covered.
type idWay struct {
	decided, allowed, fromHeld int
	// spendLapsed is a mutation: the id way spends tokens whose lease
	// lapsed, as if just leased.
	spendLapsed bool
}

// takeConcurrently decides a request by id first, counting under mu
// those the id way decided.
func (w *idWay) takeConcurrently(mu *sync.Mutex, tb *leaseTable, key []byte, id uint64, tr bucket.Tier, cost int64) (bucket.Result, error) {
	if res, ok := tb.takeByID(id, tr, cost, nil); ok {
		mu.Lock()
		w.decided++
		mu.Unlock()
		return res, nil
	}
	return tb.takeNamed(bg, key, id, tr, cost, nil)
}

// fleetID is the id the nodes of a fleet round name their bucket by.
const fleetID = 0x9e3779b97f4a7c15

// take decides a request of node tb as r has it: by key, or by id first.
func (r fleetRound) take(ctx context.Context, tb *leaseTable, key string, tr bucket.Tier, cost int64) (bucket.Result, error) {
	out := make([]bucket.Result, tr.Parts())
	if r.byID == nil {
		return tb.take(ctx, []byte(key), tr, cost, out)
	}
	if r.byID.spendLapsed {
		if e := tb.hints[fleetID%hintSlots].Load(); e != nil {
			e.shard.mu.Lock()
			if !e.gone && e.tokens >= cost && tb.lapsed(e, tb.now()) {
				e.leasedAt, e.spendBy = tb.now(), 0
			}
			e.shard.mu.Unlock()
		}
	}
	if res, ok := tb.takeByID(fleetID, tr, cost, out); ok {
		r.byID.decided++
		return res, nil
	}
	held := tb.heldNow([]byte(key))
	res, err := tb.takeNamed(ctx, []byte(key), fleetID, tr, cost, out)
	if err == nil && res.Allowed {
		r.byID.allowed++
		if held >= cost {
			r.byID.fromHeld++
		}
	}
	return res, err
}

// lastCall is what a node's last lease call found, for the liveness check:
// when it was made, how long until the limits held what it asked for, and
// whether a quota lacked a request's cost after it.
type lastCall struct {
	at, limitWait int64
	quotaShort    bool
}

// liveLease checks a refusal of a request of cost at now, by the node
// whose last call was c, against the shared bucket sh as it stands: when
// sh holds the cost in every limit and quota (one bucket would admit), the
// refusal must be one the design allows.
func liveLease(sh *buckettest.Shared, now int64, ls []bucket.Limit, qs []bucket.Quota, cost int64, c lastCall) error {
	one := buckettest.Shared{Levels: slices.Clone(sh.Levels), Held: slices.Clone(sh.Held), Quotas: slices.Clone(sh.Quotas)}
	if one.Next(now, ls, qs, cost) > 0 {
		return nil // one bucket refuses too (the tokens out on lease are not in its level)
	}
	switch {
	case now < c.at+c.limitWait+c.limitWait/2+1:
		return nil // the lease hold-off, jitter included
	case c.quotaShort && now < c.at+quotaDenyFor.Microseconds():
		return nil // a quota's refusal, kept as the deny cache keeps it
	}
	return fmt.Errorf("liveness: a request of %d refused at %d µs that one bucket admits (levels %+v, quotas %+v), %d µs after the node's last call (limits' wait %d µs, quota short %v)",
		cost, now, sh.Levels, sh.Quotas, now-c.at, c.limitWait, c.quotaShort)
}

// oddZones are time zones whose calendars test the quotas' periods: DST,
// a half-hour offset, fall-backs at or near midnight.
var oddZones = []string{"UTC", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Antarctica/Casey", "Asia/Amman", "America/Halifax", "Pacific/Apia"}

func randomFleetRound(rng *rand.Rand, steps int) fleetRound {
	rate := bucket.Rate{Tokens: 1 + rng.Int64N(20), Interval: 1_000_000}
	if rng.IntN(3) == 0 {
		var err error
		if rate, err = bucket.ParseRate(buckettest.TraceRates[rng.IntN(len(buckettest.TraceRates))]); err != nil {
			panic(err)
		}
	}
	r := fleetRound{
		limit: bucket.Limit{Capacity: 4 + rng.Int64N(200), Rate: rate},
		size:  LeaseSize{percent: []float64{5, 10, 25, 50, 100}[rng.IntN(5)]},
		ttl:   time.Duration(50+rng.IntN(2000)) * time.Millisecond,
		nodes: 2 + rng.IntN(4),
		steps: steps,
	}
	if rng.IntN(3) == 0 {
		r.size = LeaseSize{tokens: 2 + rng.Int64N(r.limit.Capacity)}
	}
	if rng.IntN(3) == 0 {
		r.limit.Ban = (1 + rng.Int64N(30)) * 1_000_000
	}
	if rng.IntN(3) == 0 {
		r.limit.MaxWait = 1 + rng.Int64N(2*r.limit.Units()/r.limit.Rate.Tokens)
	}
	return r
}

// chargeRound is a round of randomFleetRound whose trace mixes in charges
// (cost_from_response) of the tokens nodes hold on lease and beyond, and
// give-backs of their requests. In three rounds of four the bucket is
// small (4 to 15 tokens) and refills within a part of lease_ttl, so that
// leases outlive a refill and a burst of requests drains it.
func chargeRound(rng *rand.Rand, steps int) fleetRound {
	r := randomFleetRound(rng, steps)
	r.charges = true
	if rng.IntN(4) > 0 {
		r.limit.Capacity = 4 + rng.Int64N(12)
		full := r.ttl.Microseconds() / (1 + rng.Int64N(10))
		r.limit.Rate = bucket.Rate{Tokens: r.limit.Capacity, Interval: max(1000, full)}
		if r.size.tokens > 0 {
			r.size.tokens = 2 + rng.Int64N(r.limit.Capacity)
		}
		if r.limit.MaxWait > 0 {
			r.limit.MaxWait = 1 + rng.Int64N(2*r.limit.Units()/r.limit.Rate.Tokens)
		}
	}
	return r
}

// runFleet plays one random trace and reports the first breach of the
// bound, or nil.
func runFleet(rng *rand.Rand, r fleetRound) error {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000 + rng.Int64N(1_000_000_000))
	if len(r.quotas) > 0 {
		// A few minutes before a period ends, between 2005 and 2030, so
		// that traces cross it.
		at := time.Date(2005+rng.IntN(26), time.Month(1+rng.IntN(12)), 1+rng.IntN(28), rng.IntN(24), 0, 0, 0, time.UTC).UnixMicro()
		_, end := r.quotas[0].Bounds(at)
		clock.micros.Store(end - rng.Int64N(200_000_000))
	}
	l := r.limit
	ls := append([]bucket.Limit{l}, r.more...)
	qs := r.quotas
	tr := oneLimit(l)
	if len(ls) > 1 || len(qs) > 0 {
		tr = bucket.Tier{Limits: ls, Quotas: qs}
	}
	minCap := l.Capacity
	for _, x := range r.more {
		minCap = min(minCap, x.Capacity)
	}
	key := "bucket"
	var bans []banStart
	m := newSharedModel(clock.now)
	m.mutate = r.mutate
	var adm, backs []admission
	m.onLease = func(_ string, sh *buckettest.Shared, res bucket.LeaseResult) {
		if res.Banned {
			bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
		}
	}
	m.onReturn = func(n int64) { backs = append(backs, admission{at: clock.now(), cost: n}) }
	calls := map[string]lastCall{}
	m.onAsk = func(a bucket.LeaseAsk, sh *buckettest.Shared, lr bucket.LeaseResult) {
		// A refused or short lease holds the node off until the limits hold
		// what it asked for (its next lease, or the cost of the request
		// that asked, if more); a short one only while the limits cannot
		// cover a request.
		c := lastCall{at: clock.now()}
		if lr.Granted == 0 || lr.Granted < a.Want && sh.Next(clock.now(), ls, nil, a.Cost) > 0 {
			c.limitWait = sh.Next(clock.now(), ls, nil, max(a.Want, a.Cost))
		}
		for i, q := range qs {
			start, _ := q.Bounds(clock.now())
			c.quotaShort = c.quotaShort || sh.Quotas[i].Start == start && sh.Quotas[i].Used+a.Cost > q.N
		}
		calls[a.Node] = c
	}
	m.mutateWait = r.mutateWait
	m.onReserve = func(_ string, sh *buckettest.Shared, res bucket.Result) {
		if res.Banned {
			bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
		}
	}
	// A random state: part spent, and tokens out on a dead node's lease.
	now := clock.now()
	start := &buckettest.Shared{Levels: make([]bucket.State, len(ls))}
	for i, x := range ls {
		if k := rng.Int64N(x.Capacity + 1); k > 0 {
			start.Levels[i], _ = bucket.Take(bucket.State{}, now, x, k)
		}
	}
	// Each quota part used: what its period may admit from here.
	used0 := make([]int64, len(qs))
	start0, _ := buckettest.QuotaStop(now, nil)
	for i, q := range qs {
		start0, _ = q.Bounds(now)
		used0[i] = rng.Int64N(q.N + 1)
		start.Quotas = append(start.Quotas, bucket.QuotaState{Start: start0, Used: used0[i]})
	}
	if rng.IntN(2) == 0 {
		dead := buckettest.Held{Node: "dead", Tokens: rng.Int64N(minCap/2 + 1), Expires: now + rng.Int64N(3*int64(r.ttl/time.Microsecond)), Seq: 1}
		if len(qs) > 0 {
			// Counted in the quotas when leased.
			dead.QStop, dead.Mask = buckettest.QuotaStop(now, qs)
			dead.Tokens = min(dead.Tokens, slices.Min(used0))
		}
		start.Held = append(start.Held, dead)
	}
	m.states[key] = start

	timeout := time.Duration(rng.IntN(200)) * time.Millisecond
	newTable := func() *leaseTable {
		tb := newLeaseTable(m, m.now, r.size, r.ttl, timeout, 1000, nopLogger)
		tb.jitter = rand.New(rand.NewPCG(rng.Uint64(), 0)).Int64N
		return tb
	}
	tables := make([]*leaseTable, r.nodes)
	for i := range tables {
		tables[i] = newTable()
	}
	defer func() {
		for _, tb := range tables {
			tb.close()
		}
	}()
	// strict decides a request in strict mode: a node without leases, a
	// cost as large as the lease, or a request of a config that a reload
	// unloaded while its call was out.
	strict := func(cost int64) {
		m.mu.Lock()
		out := make([]bucket.Result, len(ls)+len(qs))
		sh := m.bucket(key, len(ls))
		allowed := sh.TakeWithQuotas(clock.now(), ls, qs, cost, out[:len(ls)], out[len(ls):])
		if out[0].Banned {
			bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
		}
		m.mu.Unlock()
		if allowed {
			// It goes on when the slowest limit lets it.
			w := Binding(out, true).Wait
			adm = append(adm, admission{at: clock.now(), due: clock.now() + w, cost: cost, node: -1})
		}
	}
	// lease records a request of node i that its lease table decided, and
	// checks a refusal's liveness.
	lease := func(i int, node string, cost int64, res bucket.Result, err error) error {
		if errors.Is(err, errLeasesClosed) {
			strict(cost)
			return nil
		}
		if err == nil && res.Allowed {
			if res.Wait > l.MaxWait {
				return fmt.Errorf("a request waits %d µs, over max_wait %d", res.Wait, l.MaxWait)
			}
			adm = append(adm, admission{at: clock.now(), due: clock.now() + res.Wait, cost: cost, node: i})
		}
		if err == nil && !res.Allowed && l.MaxWait == 0 && !m.down {
			m.mu.Lock()
			defer m.mu.Unlock()
			return liveLease(m.bucket(key, len(ls)), clock.now(), ls, qs, cost, calls[node])
		}
		return nil
	}
	// request sends a request of cost to node i.
	request := func(i int, cost int64) error {
		before := len(bans)
		res, err := r.take(bg, tables[i], key, tr, cost)
		tableSync(tables[i])
		if err := lease(i, tables[i].node, cost, res, err); err != nil {
			return err
		}
		if err == nil && res.Allowed {
			// Allowed from the tokens held, before the prefetch it
			// started, which may have started a ban.
			for k := before; k < len(bans); k++ {
				bans[k].after = len(adm)
			}
		}
		return nil
	}
	// giveBack gives back the tokens of the k-th admission, as count_status
	// does (RedisStore.GiveBack): to its node's lease when it holds one,
	// else to the shared bucket.
	giveBack := func(k int) {
		a := adm[k]
		if a.returned {
			return
		}
		adm[k].returned = true
		backs = append(backs, admission{at: clock.now(), cost: a.cost})
		if clock.now() < a.due {
			// A waiter that hung up: it never went on.
			adm[k].cost = 0
		} else {
			adm = append(adm, admission{at: clock.now(), from: a.at, due: clock.now(), cost: -a.cost, node: a.node, returned: true})
		}
		rest := a.cost
		if a.node >= 0 {
			rest = tables[a.node].giveBackHeldSince([]byte(key), a.cost, a.at)
		}
		if rest > 0 {
			m.mu.Lock()
			if !m.down {
				sh := m.bucket(key, len(ls))
				sh.GiveBack(clock.now(), ls, rest)
				sh.GiveBackQuotas(clock.now(), a.at, qs, rest)
			}
			m.mu.Unlock()
		}
	}
	// giveBackRecent gives back up to n of node i's last requests, among
	// the trace's last 20.
	giveBackRecent := func(i, n int) {
		for k := len(adm) - 1; k >= max(0, len(adm)-20) && n > 0; k-- {
			if adm[k].node == i && !adm[k].returned && adm[k].cost > 0 {
				giveBack(k)
				n--
			}
		}
	}
	// charge is cost_from_response's charge of n on node i, as
	// Store.Charge makes it: from the node's lease when it holds tokens,
	// the rest to the shared bucket.
	charge := func(i int, n int64) {
		rest := tables[i].chargeHeld([]byte(key), n)
		m.mu.Lock()
		defer m.mu.Unlock()
		if m.down {
			return
		}
		sh := m.bucket(key, len(ls))
		if rest > 0 {
			sh.Charge(clock.now(), ls, rest)
			sh.ChargeQuotas(clock.now(), qs, rest)
			if r.mutateCharge != nil {
				r.mutateCharge(sh, rest)
			}
		}
		if r.mutateChargeHeld != nil && n > rest {
			r.mutateChargeHeld(sh, clock.now(), ls, tables[i].node, n-rest)
		}
	}
	for range r.steps {
		if r.charges && rng.IntN(4) == 0 {
			// A charge of what a response reported, of a part of what
			// the node holds on lease, all of it, or more, the rest to
			// the shared bucket; the give-back of one of its recent
			// requests, which may go into a lease that a charge spent;
			// or a burst of requests at one instant, which drains the
			// bucket.
			i := rng.IntN(len(tables))
			held := tables[i].heldNow([]byte(key))
			if held == 0 {
				// Rather a node that holds tokens.
				i = rng.IntN(len(tables))
				held = tables[i].heldNow([]byte(key))
			}
			switch rng.IntN(6) {
			case 0:
				charge(i, 1+rng.Int64N(max(held, 1)))
			case 1:
				charge(i, max(held, 1))
			case 2:
				charge(i, held+1+rng.Int64N(3))
			case 3:
				// An episode: node i's responses settle at one instant, a
				// charge of what it holds and give-backs of its recent
				// requests; the bucket refills; a burst.
				if rng.IntN(2) == 0 {
					charge(i, max(held, 1))
				} else {
					charge(i, 1+rng.Int64N(max(held, 1)))
				}
				giveBackRecent(i, 1+rng.IntN(4))
				clock.advance(time.Duration(rng.Int64N(int64(r.ttl))))
				for range 2 + rng.IntN(2*int(min(minCap, 20))) {
					j := i
					if rng.IntN(2) == 0 {
						j = rng.IntN(len(tables))
					}
					if err := request(j, 1+rng.Int64N(min(3, minCap))); err != nil {
						return err
					}
				}
			case 4:
				giveBackRecent(i, 1+rng.IntN(4))
			default:
				for range 2 + rng.IntN(10) {
					if err := request(rng.IntN(len(tables)), 1+rng.Int64N(min(3, minCap))); err != nil {
						return err
					}
				}
			}
			continue
		}
		switch op := rng.IntN(104); {
		case op < 60:
			i := rng.IntN(len(tables))
			if err := request(i, 1+rng.Int64N(min(3, minCap))); err != nil {
				return err
			}
		case op < 65:
			strict(1 + rng.Int64N(minCap))
		case op < 80:
			step := rng.Int64N(int64(r.ttl))
			if rng.IntN(3) == 0 {
				step = rng.Int64N(int64(time.Millisecond))
			}
			if rng.IntN(40) == 0 {
				// A jump of hours: a node that slept, periods that ended.
				step = rng.Int64N(int64(40 * time.Hour))
			}
			clock.advance(time.Duration(step))
		case op < 86:
			tb := tables[rng.IntN(len(tables))]
			if back := tb.sweep(clock.now(), false); len(back) > 0 {
				tb.giveBackNow(back)
			}
		case op < 92:
			// count_status: a response that does not count gives its
			// tokens back, as RedisStore.GiveBack does.
			if len(adm) == 0 {
				continue
			}
			giveBack(len(adm) - 1 - rng.IntN(min(len(adm), 20)))
		case op < 96:
			i := rng.IntN(len(tables))
			tables[i].close()
			tables[i] = newTable()
		case op < 98:
			m.mu.Lock()
			m.down = !m.down
			m.mu.Unlock()
		case op < 100:
			// A client that hangs up while its request's call is out: the
			// call goes on for the others and the node.
			i := rng.IntN(len(tables))
			cost := 1 + rng.Int64N(min(3, minCap))
			gate := make(chan struct{})
			m.gate = gate
			ctx, cancel := context.WithCancel(bg)
			cancel()
			res, err := r.take(ctx, tables[i], key, tr, cost)
			close(gate)
			tableSync(tables[i])
			m.gate = nil
			if err == nil {
				if err := lease(i, tables[i].node, cost, res, nil); err != nil {
					return err
				}
			}
		case op < 102:
			// A reload while a request's call is out: the request goes on
			// in strict mode, and the old table gives its tokens back.
			i := rng.IntN(len(tables))
			cost := 1 + rng.Int64N(min(3, minCap))
			gate := make(chan struct{})
			m.gate = gate
			type answer struct {
				res bucket.Result
				err error
			}
			done := make(chan answer, 1)
			old := tables[i]
			go func() {
				res, err := r.take(bg, old, key, tr, cost)
				done <- answer{res, err}
			}()
			closed := make(chan struct{})
			go func() { old.close(); close(closed) }()
			for !old.closed.Load() {
				runtime.Gosched()
			}
			close(gate)
			a := <-done
			<-closed
			m.gate = nil
			tables[i] = newTable()
			if err := lease(i, old.node, cost, a.res, a.err); err != nil {
				return err
			}
		default:
			// cost_from_response of a huge figure, which an origin may
			// relay from a client: charged to the node's lease when it
			// covers it, else to the shared bucket.
			i := rng.IntN(len(tables))
			charge(i, []int64{math.MaxInt64, math.MaxInt64 - rng.Int64N(1000), 1 << (40 + rng.IntN(23)), rng.Int64N(3 * minCap)}[rng.IntN(4)])
		}
	}
	for _, x := range ls {
		if err := checkFleet(adm, backs, bans, x, r.ttl); err != nil {
			return fmt.Errorf("limit %+v: %w", x, err)
		}
	}
	for i, q := range qs {
		if err := checkQuota(adm, q, start0, used0[i]); err != nil {
			return err
		}
	}
	return nil
}

// checkQuota checks that no period of q admits more than its N, net of
// the give-backs made within the period of requests it admitted; in the
// first, of which used0 was used from start0 on, no more than the rest.
func checkQuota(adm []admission, q bucket.Quota, start0, used0 int64) error {
	net := map[int64]int64{start0: used0}
	for _, a := range adm {
		at := a.at
		if a.cost < 0 {
			at = a.from
		}
		p, _ := q.Bounds(at)
		if now, _ := q.Bounds(a.at); now != p {
			continue // given back in a later period: counted where taken
		}
		net[p] += a.cost
		if a.cost > 0 && net[p] > q.N {
			return fmt.Errorf("quota %s: %d admitted, net, in the period from %d µs", q, net[p], p)
		}
	}
	return nil
}

// checkFleet checks the bound over every window between two admissions'
// due times, and each ban's hold. adm holds the admissions and, as negative
// costs, the give-backs, in the order of their decisions.
//
// With max_wait, tokens given back (by a waiter that hung up, count_status
// or a lease's give-back) may be taken again at once by a request due
// before waiters queued earlier, never more than max_wait after the
// give-back: a window's bound grows by the tokens given back from max_wait
// before it to its end, and give-backs are not netted.
func checkFleet(adm, backs []admission, bans []banStart, l bucket.Limit, ttl time.Duration) error {
	byDue := slices.Clone(adm)
	slices.SortStableFunc(byDue, func(a, b admission) int { return cmp.Compare(a.due, b.due) })
	// The give-backs by time, and given[k], the tokens of the first k.
	var backAt, given []int64
	if l.MaxWait > 0 {
		sorted := slices.Clone(backs)
		slices.SortStableFunc(sorted, func(a, b admission) int { return cmp.Compare(a.at, b.at) })
		given = make([]int64, len(sorted)+1)
		for k, g := range sorted {
			backAt = append(backAt, g.at)
			given[k+1] = given[k] + g.cost
		}
	}
	// ahead[i] is the tokens admitted from the i-th on: no window from it
	// takes more, and its bound only grows, so a window that reaches
	// ahead[i] ends the search from i.
	ahead := make([]int64, len(byDue)+1)
	for i := len(byDue) - 1; i >= 0; i-- {
		ahead[i] = ahead[i+1] + max(byDue[i].cost, 0)
	}
	for i := range byDue {
		if byDue[i].cost < 0 {
			continue
		}
		var net int64
		from, _ := slices.BinarySearch(backAt, byDue[i].due-l.MaxWait)
		for j := i; j < len(byDue); j++ {
			if l.MaxWait > 0 && byDue[j].cost < 0 {
				continue
			}
			net += byDue[j].cost
			// A wait is rounded up to the microsecond.
			span := byDue[j].due - byDue[i].due
			if l.MaxWait > 0 {
				span++
			}
			bound := l.Capacity + span*l.Rate.Tokens/l.Rate.Interval
			if l.MaxWait > 0 {
				// The give-backs from max_wait before the window to its end.
				to, _ := slices.BinarySearch(backAt, byDue[j].due+1)
				bound += given[to] - given[from]
			}
			if byDue[j].cost > 0 && net > bound {
				return fmt.Errorf("%d admitted, net of give-backs, due between %d and %d µs, more than C + floor(r*T) = %d", net, byDue[i].due, byDue[j].due, bound)
			}
			if bound >= ahead[i] {
				break
			}
		}
	}
	for _, b := range bans {
		var net int64
		for _, a := range adm[b.after:] {
			if a.at >= b.until {
				break
			}
			net += a.cost
			if a.cost > 0 && a.at >= b.at+ttl.Microseconds() {
				return fmt.Errorf("admitted %d µs into a ban, after lease_ttl %s", a.at-b.at, ttl)
			}
			if net > b.out {
				return fmt.Errorf("%d admitted, net, during a ban that started at %d with %d out on lease", net, b.at, b.out)
			}
		}
	}
	return nil
}

func TestLeasesNeverAdmitMoreThanOneBucketOverAnyWindow(t *testing.T) {
	t.Parallel()
	playRounds(t, rand.New(rand.NewPCG(20, 3)), 300, func(rng *rand.Rand, steps int) fleetRound { return randomFleetRound(rng, steps) })
	// And traces with charges of held tokens and give-backs into the
	// leases they spent (TestTheLeasePropertyCatchesABrokenStore).
	playRounds(t, rand.New(rand.NewPCG(20, 4)), 300, chargeRound)
}

// playRounds plays random traces, as many as rounds (a fifth under
// -short, and shorter), of the rounds round makes, and fails at the first
// breach. It returns the rounds played.
func playRounds(t *testing.T, rng *rand.Rand, rounds int, round func(rng *rand.Rand, steps int) fleetRound) []fleetRound {
	t.Helper()
	steps := 1500
	if testing.Short() {
		rounds, steps = rounds/5, 800
	}
	var played []fleetRound
	for i := range rounds {
		r := round(rng, steps)
		if err := runFleet(rng, r); err != nil {
			t.Fatalf("round %d (limits %+v %+v, quotas %v, lease %+v, ttl %s, %d nodes, charges %v): %v", i, r.limit, r.more, r.quotas, r.size, r.ttl, r.nodes, r.charges, err)
		}
		played = append(played, r)
	}
	return played
}

// The property test fails on a store that breaks the guarantee: one that
// grants a node one token more than it records, one that forgets what is
// out on lease, as the store did before it counted leases, and, in the
// traces with charges, one that stops counting the held tokens a charge
// spent before the node's next call says so (the level then refills over
// tokens that a give-back puts back into the lease).
func TestTheLeasePropertyCatchesABrokenStore(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name       string
		mutate     func(sh *buckettest.Shared, res *bucket.LeaseResult)
		chargeHeld func(sh *buckettest.Shared, now int64, ls []bucket.Limit, node string, n int64)
	}{
		{"one token more", func(_ *buckettest.Shared, res *bucket.LeaseResult) {
			if res.Granted > 0 {
				res.Granted++
			}
		}, nil},
		{"leases not counted", func(sh *buckettest.Shared, _ *bucket.LeaseResult) { sh.Held = nil }, nil},
		{"a waiter goes 1 ms early", nil, nil},
		{"a charge of held tokens releases them at once", nil, func(sh *buckettest.Shared, now int64, ls []bucket.Limit, node string, n int64) {
			sh.GiveBack(now, ls, 0) // a give-back of nothing: the levels brought to now
			for i := range sh.Held {
				if sh.Held[i].Node == node {
					sh.Held[i].Tokens -= min(n, sh.Held[i].Tokens)
				}
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(20, 3))
			for round := range 300 {
				var r fleetRound
				if tt.chargeHeld != nil {
					r = chargeRound(rng, 800)
					r.mutateChargeHeld = tt.chargeHeld
				} else {
					r = randomFleetRound(rng, 800)
				}
				r.mutate = tt.mutate
				if tt.mutate == nil && tt.chargeHeld == nil {
					r.mutateWait = func(_ *buckettest.Shared, res *bucket.Result) {
						res.Wait = max(0, res.Wait-1000)
					}
				}
				if err := runFleet(rng, r); err != nil {
					t.Logf("caught in round %d: %v", round, err)
					return
				}
			}
			t.Fatal("no round caught the broken store")
		})
	}
}

// withTier makes r's tier one of two or three limits, at times with a
// daily quota: each limit another capacity and refill, the ban and
// max_wait the tier's.
func withTier(rng *rand.Rand, r fleetRound) fleetRound {
	for range 1 + rng.IntN(2) {
		x := randomFleetRound(rng, 0).limit
		x.Ban = r.limit.Ban
		r.more = append(r.more, x)
	}
	// The tier's max_wait, within what every limit allows (Validate).
	for _, x := range r.more {
		r.limit.MaxWait = min(r.limit.MaxWait, min(x.Units()*1000, 1<<52-x.Units())/x.Rate.Tokens)
	}
	for i := range r.more {
		r.more[i].MaxWait = r.limit.MaxWait
	}
	if rng.IntN(2) == 0 {
		loc, err := time.LoadLocation(oddZones[rng.IntN(len(oddZones))])
		if err != nil {
			panic(err)
		}
		r.quotas = []bucket.Quota{{N: 5 + rng.Int64N(3*r.limit.Capacity), Period: bucket.Period(1 + rng.IntN(2)), Loc: loc}}
	}
	return r
}

// The guarantee on tiers of two and three limits and a quota: a lease
// takes from every limit and the quota at once, so the fleet admits no
// more than one bucket of each limit over any window, and no quota period
// more than its N, with leases spent across a period's end.
func TestLeasesOnTiersNeverAdmitMoreThanEachLimitOrQuota(t *testing.T) {
	t.Parallel()
	played := playRounds(t, rand.New(rand.NewPCG(25, 14)), 200, func(rng *rand.Rand, steps int) fleetRound {
		return withTier(rng, randomFleetRound(rng, steps))
	})
	if !slices.ContainsFunc(played, func(r fleetRound) bool { return len(r.quotas) > 0 }) {
		t.Fatal("no round had a quota")
	}
}

// The tier property fails on a store that grants one token more than it
// records, on one whose quota counts a lease's grant one token short, on
// one whose quota starts over after a huge charge (a count that wraps),
// and, for liveness, on one that holds a node off a used-up quota until
// its period ends (plus the hold-off's jitter), as leases once did.
func TestTheTierLeasePropertyCatchesABrokenStore(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		quota  bool
		mutate func(sh *buckettest.Shared, res *bucket.LeaseResult)
		charge func(sh *buckettest.Shared, n int64)
	}{
		{"one token more", false, func(_ *buckettest.Shared, res *bucket.LeaseResult) {
			if res.Granted > 0 {
				res.Granted++
			}
		}, nil},
		{"a quota counts one token fewer", true, func(sh *buckettest.Shared, res *bucket.LeaseResult) {
			if res.Granted > 0 && len(sh.Quotas) > 0 && sh.Quotas[0].Used > 0 {
				sh.Quotas[0].Used--
			}
		}, nil},
		{"a huge charge wraps the quota's count", true, nil, func(sh *buckettest.Shared, n int64) {
			if n > 1<<62 {
				sh.Quotas[0].Used = 0
			}
		}},
		{"a used-up quota holds the node off to its period's end", true, func(_ *buckettest.Shared, res *bucket.LeaseResult) {
			res.HoldOff = max(res.HoldOff, res.QuotaHold)
		}, nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(25, 14))
			for round := range 400 {
				r := withTier(rng, randomFleetRound(rng, 800))
				if tt.quota && len(r.quotas) == 0 {
					continue
				}
				r.mutate, r.mutateCharge = tt.mutate, tt.charge
				if err := runFleet(rng, r); err != nil {
					t.Logf("caught in round %d: %v", round, err)
					return
				}
			}
			t.Fatal("no round caught the broken store")
		})
	}
}

// A request that waits (max_wait) while a node holds leased tokens: the
// level never refills over those tokens, so the request goes on only when
// the level holds its cost beside them. Before, it went on when the
// uncapped level held its cost, and the node spent its lease in the same
// instant: 15 tokens at once from a bucket of 10. The property test found
// it (round 352 of 3000 of the single-limit traces).
func TestAWaiterDoesNotGoOnBesideTokensOutOnLease(t *testing.T) {
	t.Parallel()
	l := bucket.Limit{Capacity: 10, Rate: bucket.Rate{Tokens: 10, Interval: 1_000_000}, MaxWait: 5_000_000}
	ls := []bucket.Limit{l}
	sh := &buckettest.Shared{Levels: make([]bucket.State, 1)}
	const start = 1_000_000
	// A node leases 5 of the 10 for a second.
	lr := sh.Lease(start, ls, bucket.LeaseAsk{Node: "a", Seq: 1, Cost: 5, Want: 5, Hold: 1_000_000})
	if lr.Granted != 5 {
		t.Fatalf("lease: %+v, want 5 granted", lr)
	}
	// A request of the whole bucket waits.
	var out [1]bucket.Result
	if !sh.Take(start, ls, 10, out[:]) {
		t.Fatalf("the waiting request was refused: %+v", out[0])
	}
	due := start + out[0].Wait
	// The node spends its lease at once, or later, before it expires.
	for _, spent := range []int64{start, start + 600_000, start + 900_000} {
		adm := []admission{{at: spent, due: spent, cost: 5}, {at: start, due: due, cost: 10}}
		slices.SortFunc(adm, func(a, b admission) int { return cmp.Compare(a.due, b.due) })
		if err := checkFleet(adm, nil, nil, l, time.Second); err != nil {
			t.Errorf("lease spent at %d µs, the request due at %d µs (wait %d µs): %v", spent, due, out[0].Wait, err)
		}
	}
}

// A node may not spend leased tokens past the end of the quota period that
// counted them: after midnight its requests take from a lease the new day
// counts, and the day's count is what it admitted. A give-back of a
// request taken the day before does not go into the new day's lease.
func TestLeasedTokensStayInTheirQuotaPeriod(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	q := bucket.Quota{N: 40, Period: bucket.Day, Loc: time.UTC}
	_, midnight := q.Bounds(1_000_000)
	clock.micros.Store(midnight - 200_000)
	m := newSharedModel(clock.now)
	tr := bucket.Tier{Limits: []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}, Quotas: []bucket.Quota{q}}
	node := newModelTable(m, LeaseSize{tokens: 20}, 10*time.Second)
	defer node.close()
	take := func() {
		t.Helper()
		if res, err := node.take(bg, []byte("k"), tr, 1, nil); err != nil || !res.Allowed {
			t.Fatalf("at %d µs: %+v, %v; want allowed", clock.now(), res, err)
		}
		tableSync(node)
	}
	// The day before: leases grow while requests spend them.
	for range 8 {
		take()
	}
	before := clock.now()
	held := node.snapshot([]byte("k")).tokens
	if held == 0 {
		t.Fatal("the node holds no leased tokens before midnight")
	}
	clock.advance(300 * time.Millisecond) // past midnight
	for range 5 {
		take()
	}
	// The request of the day before, given back after midnight.
	if rest := node.giveBackHeldSince([]byte("k"), 1, before); rest != 1 {
		t.Errorf("a request of the day before went back into the new day's lease: %d of 1 left over", rest)
	}
	m.mu.Lock()
	used := m.states["k"].Quotas[0]
	m.mu.Unlock()
	if used.Start != midnight || used.Used < 5 {
		t.Errorf("the new day counts %+v; want at least the 5 requests admitted since midnight (%d)", used, midnight)
	}
	if spent := node.snapshot([]byte("k")).tokens; used.Used-spent != 5 {
		t.Errorf("the new day counts %d, the node holds %d of them: %d spent, want 5", used.Used, spent, used.Used-spent)
	}
}

// snapshot is a copy of the table's entry for key, or none.
func (t *leaseTable) snapshot(key []byte) lease {
	sh := t.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.m[string(key)]; e != nil {
		return *e
	}
	return lease{}
}

// A tier of a day's and a month's quota: a lease is counted in both, and
// the node may spend it until the day ends. What it still holds then is
// dropped, unspent: the month, whose period goes on, counts only what was
// admitted (a quota counts what was admitted), not the dropped tokens too.
func TestAMonthCountsOnlyWhatWasAdmittedAcrossADaysEnd(t *testing.T) {
	t.Parallel()
	clock := new(fakeClock)
	day := bucket.Quota{N: 1000, Period: bucket.Day, Loc: time.UTC}
	month := bucket.Quota{N: 10000, Period: bucket.Month, Loc: time.UTC}
	_, midnight := day.Bounds(time.Date(2026, 3, 10, 12, 0, 0, 0, time.UTC).UnixMicro())
	clock.micros.Store(midnight - 200_000)
	m := newSharedModel(clock.now)
	tr := bucket.Tier{Limits: []bucket.Limit{{Capacity: 100, Rate: bucket.Rate{Tokens: 100, Interval: 1_000_000}}}, Quotas: []bucket.Quota{day, month}}
	node := newModelTable(m, LeaseSize{tokens: 20}, 10*time.Second)
	defer node.close()
	admitted := int64(0)
	take := func() {
		t.Helper()
		if res, err := node.take(bg, []byte("k"), tr, 1, nil); err != nil || !res.Allowed {
			t.Fatalf("at %d µs: %+v, %v; want allowed", clock.now(), res, err)
		}
		tableSync(node)
		admitted++
	}
	for range 8 {
		take()
	}
	if node.snapshot([]byte("k")).tokens == 0 {
		t.Fatal("the node holds no leased tokens before midnight")
	}
	clock.advance(300 * time.Millisecond) // past midnight, the month goes on
	for range 5 {
		take()
	}
	// What the node holds now goes back, as at its lease_ttl.
	if back := node.sweep(clock.now(), true); len(back) > 0 {
		node.giveBackNow(back)
	}
	m.mu.Lock()
	counts := slices.Clone(m.states["k"].Quotas)
	m.mu.Unlock()
	if counts[1].Used != admitted {
		t.Errorf("the month counts %d, %d were admitted: the tokens the node held at the day's end stay counted", counts[1].Used, admitted)
	}
	if counts[0].Used != 5 {
		t.Errorf("the new day counts %d; want the 5 admitted since midnight", counts[0].Used)
	}
}

// The window bound under concurrency: at each instant of a fake clock, 4 to
// 16 requests run at once on 2 to 4 nodes (so they join calls in flight,
// spend while a prefetch is out, and race its answer), then, at the next
// instant, count_status give-backs, sweeps, reloads and outages run at
// once. In every other round the tables hold one entry a shard and other
// clients' requests evict the bucket's entry. Over every window between
// two admissions the fleet takes at most C + floor(r*(b-a)) net of
// give-backs (checkFleet, without its ban check, which needs an order
// within an instant). A store that grants one token more than it records
// is caught.
func TestAConcurrentFleetKeepsTheWindowBound(t *testing.T) {
	t.Parallel()
	rounds := 60
	if testing.Short() {
		rounds = 15
	}
	// The rounds in two halves that run side by side, a seed each: the
	// race detector makes a round slow, and the halves share nothing.
	for half := range 2 {
		t.Run(fmt.Sprintf("rounds %d of 2", half+1), func(t *testing.T) {
			t.Parallel()
			rng := rand.New(rand.NewPCG(20, 99+uint64(half)))
			for round := half; round < rounds; round += 2 {
				r := randomFleetRound(rng, 0)
				if err := runConcurrentFleet(rng, r, 150, round%2 == 1); err != nil {
					t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes): %v", round, r.limit, r.size, r.ttl, r.nodes, err)
				}
			}
		})
	}
	// The harness has teeth: a store that grants one token more than it
	// records is caught.
	t.Run("a broken store is caught", func(t *testing.T) {
		t.Parallel()
		rng := rand.New(rand.NewPCG(20, 101))
		for round := range 60 {
			r := randomFleetRound(rng, 0)
			r.mutate = func(_ *buckettest.Shared, res *bucket.LeaseResult) {
				if res.Granted > 0 {
					res.Granted++
				}
			}
			if err := runConcurrentFleet(rng, r, 150, false); err != nil {
				t.Logf("a broken store is caught in round %d: %v", round, err)
				return
			}
		}
		t.Error("no round caught a store that grants one token more than it records")
	})
}

// runConcurrentFleet plays one round of TestAConcurrentFleetKeepsTheWindowBound
// and reports the first breach of the bound, or nil.
func runConcurrentFleet(rng *rand.Rand, r fleetRound, instants int, tiny bool) error {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000 + rng.Int64N(1_000_000_000))
	l := r.limit
	ls := []bucket.Limit{l}
	key := "bucket"
	m := newSharedModel(clock.now)
	m.mutate = r.mutate
	now := clock.now()
	start := &buckettest.Shared{Levels: []bucket.State{{}}}
	if k := rng.Int64N(l.Capacity + 1); k > 0 {
		start.Levels[0], _ = bucket.Take(bucket.State{}, now, l, k)
	}
	m.states[key] = start
	timeout := time.Duration(rng.IntN(200)) * time.Millisecond
	newTable := func() *leaseTable {
		entries := 1000
		if tiny {
			entries = leaseShards // one entry a shard: another key evicts
		}
		tb := newLeaseTable(m, m.now, r.size, r.ttl, timeout, entries, nopLogger)
		tb.jitter = rand.New(rand.NewPCG(rng.Uint64(), 0)).Int64N
		return tb
	}
	tables := make([]*leaseTable, r.nodes)
	for i := range tables {
		tables[i] = newTable()
	}
	defer func() {
		for _, tb := range tables {
			tb.close()
		}
	}()
	var mu sync.Mutex
	var adm, backs []admission
	m.onReturn = func(n int64) {
		mu.Lock()
		backs = append(backs, admission{at: clock.now(), cost: n})
		mu.Unlock()
	}
	syncAll := func() {
		for _, tb := range tables {
			tableSync(tb)
		}
	}
	for range instants {
		clock.advance(time.Duration(rng.Int64N(int64(r.ttl) / 2)))
		// The requests of this instant, at once.
		var wg sync.WaitGroup
		at := clock.now()
		for range 4 + rng.IntN(13) {
			i := rng.IntN(len(tables))
			tb := tables[i]
			cost := 1 + rng.Int64N(min(3, l.Capacity))
			if tiny && rng.IntN(2) == 0 {
				// Another client: in a table of one entry a shard, one
				// in 64 of these evicts the bucket's entry.
				other := []byte{'o', byte(rng.IntN(256))}
				wg.Go(func() {
					if r.byID != nil {
						// Its id shares the bucket's hint slot.
						r.byID.takeConcurrently(&mu, tb, other, fleetID+(uint64(other[1])+1)*hintSlots, oneLimit(l), 1)
						return
					}
					tb.take(bg, other, oneLimit(l), 1, nil)
				})
				continue
			}
			wg.Go(func() {
				var res bucket.Result
				var err error
				if r.byID != nil {
					res, err = r.byID.takeConcurrently(&mu, tb, []byte(key), fleetID, oneLimit(l), cost)
				} else {
					res, err = tb.take(bg, []byte(key), oneLimit(l), cost, nil)
				}
				if err == nil && res.Allowed {
					mu.Lock()
					adm = append(adm, admission{at: at, due: at + res.Wait, cost: cost, node: i})
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		syncAll()
		// Then, a microsecond later, what runs beside them.
		clock.advance(time.Microsecond)
		at = clock.now()
		var returned []admission
		for k := len(adm) - 1; k >= 0 && k >= len(adm)-20; k-- {
			if !adm[k].returned && adm[k].cost > 0 && rng.IntN(3) == 0 {
				adm[k].returned = true
				returned = append(returned, adm[k])
			}
		}
		for _, a := range returned {
			tb := tables[a.node]
			mu.Lock()
			backs = append(backs, admission{at: at, cost: a.cost})
			mu.Unlock()
			adm = append(adm, admission{at: at, due: at, cost: -a.cost, node: a.node, returned: true})
			wg.Go(func() {
				rest := tb.giveBackHeld([]byte(key), a.cost)
				if rest > 0 {
					m.mu.Lock()
					if !m.down {
						m.bucket(key, 1).GiveBack(m.now(), ls, rest)
					}
					m.mu.Unlock()
				}
			})
		}
		for _, tb := range tables {
			if rng.IntN(4) == 0 {
				wg.Go(func() {
					if back := tb.sweep(clock.now(), false); len(back) > 0 {
						tb.giveBackNow(back)
					}
				})
			}
		}
		wg.Wait()
		if rng.IntN(20) == 0 {
			i := rng.IntN(len(tables))
			tables[i].close()
			tables[i] = newTable()
		}
		if rng.IntN(30) == 0 {
			m.mu.Lock()
			m.down = !m.down
			m.mu.Unlock()
		}
		syncAll()
	}
	return checkFleet(adm, backs, nil, l, r.ttl)
}

// sideBySide plays one client's arrivals on the nodes of a fleet (lease
// tables on the model store) and on one bucket (strict mode), side by side,
// on a fake clock.
type sideBySide struct {
	t     *testing.T
	clock *fakeClock
	m     *sharedModel
	l     bucket.Limit
	one   bucket.State
	// oneLast is one bucket's answer to the last request.
	oneLast bucket.Result
	// admitted by the fleet and by one bucket; when each first banned.
	fleet, single       int
	fleetBan, singleBan int64
}

func newSideBySide(t *testing.T, l bucket.Limit) *sideBySide {
	clock, m := newModelStore()
	return &sideBySide{t: t, clock: clock, m: m, l: l, fleetBan: -1, singleBan: -1}
}

// node is a lease table of the fleet, closed when the test ends.
func (f *sideBySide) node(size LeaseSize, ttl time.Duration) *leaseTable {
	tb := newModelTable(f.m, size, ttl)
	f.t.Cleanup(tb.close)
	return tb
}

// sweep runs each node's lease_ttl sweep and gives back what it finds.
func (f *sideBySide) sweep(nodes ...*leaseTable) {
	for _, n := range nodes {
		if back := n.sweep(f.clock.now(), false); len(back) > 0 {
			n.giveBackNow(back)
		}
	}
}

// request sends one request to node, or, with node nil, to a node in
// strict mode (a node without leases, or a cost as large as the lease),
// and the same request to one bucket.
func (f *sideBySide) request(node *leaseTable) bucket.Result {
	f.t.Helper()
	var res bucket.Result
	if node != nil {
		var err error
		res, err = node.take(bg, []byte("k"), oneLimit(f.l), 1, nil)
		tableSync(node)
		if err != nil {
			f.t.Fatal(err)
		}
	} else {
		f.m.mu.Lock()
		var out [1]bucket.Result
		f.m.bucket("k", 1).Take(f.clock.now(), []bucket.Limit{f.l}, 1, out[:])
		f.m.mu.Unlock()
		res = out[0]
	}
	if res.Allowed {
		f.fleet++
	}
	if res.Banned && f.fleetBan < 0 {
		f.fleetBan = f.clock.now()
	}
	var r bucket.Result
	if f.one, r = bucket.Take(f.one, f.clock.now(), f.l, 1); r.Allowed {
		f.single++
	}
	if r.Banned && f.singleBan < 0 {
		f.singleBan = f.clock.now()
	}
	f.oneLast = r
	return res
}

// record is the shared store's record of node's lease on "k", if any.
func (f *sideBySide) record(node *leaseTable) (buckettest.Held, bool) {
	f.m.mu.Lock()
	defer f.m.mu.Unlock()
	now := f.clock.now()
	for _, h := range f.m.bucket("k", 1).Held {
		if h.Node == node.node && h.Expires > now {
			return h, true
		}
	}
	return buckettest.Held{}, false
}

// sharedModel is the shared store as a plain model: shared.go's Shared on
// one bucket per key, on an injected clock. It counts its calls.
type sharedModel struct {
	mu     sync.Mutex
	now    func() int64
	states map[string]*buckettest.Shared
	calls  int
	down   bool
	// gate, when set, holds every lease call until it is closed.
	gate chan struct{}
	// mutate, when set, breaks the store after each lease call, so that a
	// property test can show it would catch the defect.
	mutate func(sh *buckettest.Shared, res *bucket.LeaseResult)
	// onLease, when set, sees each lease call's outcome, under the lock.
	onLease func(key string, sh *buckettest.Shared, res bucket.LeaseResult)
	// onReserve, when set, sees each strict take's outcome, under the lock.
	onReserve func(key string, sh *buckettest.Shared, res bucket.Result)
	// mutateWait, when set, breaks each strict take's result.
	mutateWait func(sh *buckettest.Shared, res *bucket.Result)
	// onReturn, when set, sees the tokens each lease give-back returned.
	onReturn func(n int64)
	// onAsk, when set, sees each lease call's ask and the bucket after it,
	// under the lock.
	onAsk func(a bucket.LeaseAsk, sh *buckettest.Shared, res bucket.LeaseResult)
}

// newModelStore is an empty model store on a fake clock at 1 s, the
// clock every node of a test's fleet reads.
func newModelStore() (*fakeClock, *sharedModel) {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	return clock, newSharedModel(clock.now)
}

// newSharedModel is an empty model store on the clock now.
func newSharedModel(now func() int64) *sharedModel {
	return &sharedModel{now: now, states: map[string]*buckettest.Shared{}}
}

func (m *sharedModel) bucket(key string, n int) *buckettest.Shared {
	sh := m.states[key]
	if sh == nil {
		sh = &buckettest.Shared{Levels: make([]bucket.State, n)}
		m.states[key] = sh
	}
	return sh
}

func (m *sharedModel) lease(ctx context.Context, key string, tr bucket.Tier, a bucket.LeaseAsk, each []bucket.Result) (bucket.LeaseResult, error) {
	if m.gate != nil {
		<-m.gate
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.down {
		return bucket.LeaseResult{}, errBreakerOpen
	}
	ls := tr.Limits
	sh := m.bucket(key, len(ls))
	res := sh.LeaseQuotas(m.now(), ls, tr.Quotas, a)
	if each != nil {
		sh.ReportEach(m.now(), ls, tr.Quotas, each)
	}
	if m.mutate != nil {
		m.mutate(sh, &res)
	}
	if m.onLease != nil {
		m.onLease(key, sh, res)
	}
	if m.onAsk != nil {
		m.onAsk(a, sh, res)
	}
	return res, nil
}

func (m *sharedModel) giveBack(node string, back []leaseReturn) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.down {
		return 0, errBreakerOpen
	}
	var n int64
	for _, g := range back {
		ls := g.tier.Limits
		n += m.bucket(g.key, len(ls)).ReturnQuotas(m.now(), ls, g.tier.Quotas, node, g.seq, g.tokens)
	}
	if m.onReturn != nil && n > 0 {
		m.onReturn(n)
	}
	return n, nil
}

func (m *sharedModel) reserve(_ context.Context, key string, tr bucket.Tier, cost int64) (bucket.Result, []bucket.Result, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls++
	if m.down {
		return bucket.Result{}, nil, errBreakerOpen
	}
	ls := tr.Limits
	all := make([]bucket.Result, len(ls)+len(tr.Quotas))
	sh := m.bucket(key, len(ls))
	allowed := sh.TakeWithQuotas(m.now(), ls, tr.Quotas, cost, all[:len(ls)], all[len(ls):])
	res := Binding(all, allowed)
	if m.mutateWait != nil {
		m.mutateWait(sh, &res)
	}
	if m.onReserve != nil {
		m.onReserve(key, sh, res)
	}
	return res, all, nil
}

// level is the shared bucket's whole tokens at now.
func (m *sharedModel) level(key string, l bucket.Limit) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out [1]bucket.Result
	m.bucket(key, 1).Peek(m.now(), []bucket.Limit{l}, out[:])
	return out[0].Remaining
}

// newModelTable is a lease table on the model, whose calls finish before
// the test goes on: tableSync waits for them.
func newModelTable(m *sharedModel, size LeaseSize, ttl time.Duration) *leaseTable {
	return newLeaseTable(m, m.now, size, ttl, 100*time.Millisecond, 1000, zap.NewNop())
}

func tableSync(t *leaseTable) { t.calls.Wait() }
