package redisbucket

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// The fleet's guarantee, as a property over random traces on the model
// store (shared.go) with real lease tables: over every window [a, b]
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
// due times, and the ban's over decisions.

// admission is one request the fleet allowed. returned marks, in the
// events of a trace, the give-back of an earlier one's cost.
type admission struct {
	at, cost int64
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
	limit  bucket.Limit
	size   LeaseSize
	ttl    time.Duration
	nodes  int
	steps  int
	mutate func(sh *bucket.Shared, res *bucket.LeaseResult)
	// mutateWait, when set, breaks the strict take that a waiting request
	// makes.
	mutateWait func(sh *bucket.Shared, res *bucket.Result)
}

func randomFleetRound(rng *rand.Rand, steps int) fleetRound {
	rate := bucket.Rate{Tokens: 1 + rng.Int64N(20), Interval: 1_000_000}
	if rng.IntN(3) == 0 {
		var err error
		if rate, err = bucket.ParseRate(bucket.TraceRates[rng.IntN(len(bucket.TraceRates))]); err != nil {
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

// runFleet plays one random trace and reports the first breach of the
// bound, or nil.
func runFleet(rng *rand.Rand, r fleetRound) error {
	clock := new(fakeClock)
	clock.micros.Store(1_000_000 + rng.Int64N(1_000_000_000))
	l := r.limit
	ls := []bucket.Limit{l}
	key := "bucket"
	var bans []banStart
	m := &sharedModel{now: clock.now, states: map[string]*bucket.Shared{}, mutate: r.mutate}
	var adm, backs []admission
	m.onLease = func(_ string, sh *bucket.Shared, res bucket.LeaseResult) {
		if res.Banned {
			bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
		}
	}
	m.onReturn = func(n int64) { backs = append(backs, admission{at: clock.now(), cost: n}) }
	m.mutateWait = r.mutateWait
	m.onReserve = func(_ string, sh *bucket.Shared, res bucket.Result) {
		if res.Banned {
			bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
		}
	}
	// A random state: part spent, and tokens out on a dead node's lease.
	now := clock.now()
	start := &bucket.Shared{Levels: []bucket.State{{}}}
	if k := rng.Int64N(l.Capacity + 1); k > 0 {
		start.Levels[0], _ = bucket.Take(bucket.State{}, now, l, k)
	}
	if rng.IntN(2) == 0 {
		start.Held = append(start.Held, bucket.Held{Node: "dead", Tokens: rng.Int64N(l.Capacity/2 + 1), Expires: now + rng.Int64N(3*int64(r.ttl/time.Microsecond)), Seq: 1})
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
	for range r.steps {
		switch op := rng.IntN(100); {
		case op < 60:
			i := rng.IntN(len(tables))
			cost := 1 + rng.Int64N(min(3, l.Capacity))
			before := len(bans)
			res, err := tables[i].take(bg, []byte(key), l, cost)
			tableSync(tables[i])
			if err == nil && res.Allowed {
				// Allowed from the tokens held, before the prefetch it
				// started, which may have started a ban.
				if res.Wait > l.MaxWait {
					return fmt.Errorf("a request waits %d µs, over max_wait %d", res.Wait, l.MaxWait)
				}
				adm = append(adm, admission{at: clock.now(), due: clock.now() + res.Wait, cost: cost, node: i})
				for k := before; k < len(bans); k++ {
					bans[k].after = len(adm)
				}
			}
		case op < 65:
			// A request in strict mode: a node without leases, or a cost
			// as large as the lease.
			cost := 1 + rng.Int64N(l.Capacity)
			m.mu.Lock()
			var out [1]bucket.Result
			sh := m.bucket(key, 1)
			allowed := sh.Take(clock.now(), ls, cost, out[:])
			if out[0].Banned {
				bans = append(bans, banStart{at: clock.now(), out: sh.Out(), until: clock.now() + l.Ban, after: len(adm)})
			}
			m.mu.Unlock()
			if allowed {
				adm = append(adm, admission{at: clock.now(), due: clock.now() + out[0].Wait, cost: cost, node: -1})
			}
		case op < 80:
			step := rng.Int64N(int64(r.ttl))
			if rng.IntN(3) == 0 {
				step = rng.Int64N(int64(time.Millisecond))
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
			k := len(adm) - 1 - rng.IntN(min(len(adm), 20))
			a := adm[k]
			if a.returned {
				continue
			}
			adm[k].returned = true
			backs = append(backs, admission{at: clock.now(), cost: a.cost})
			if clock.now() < a.due {
				// A waiter that hung up: it never went on.
				adm[k].cost = 0
			} else {
				adm = append(adm, admission{at: clock.now(), due: clock.now(), cost: -a.cost, node: a.node, returned: true})
			}
			rest := a.cost
			if a.node >= 0 {
				rest = tables[a.node].giveBackHeld([]byte(key), a.cost)
			}
			if rest > 0 {
				m.mu.Lock()
				if !m.down {
					m.bucket(key, 1).GiveBack(clock.now(), ls, rest)
				}
				m.mu.Unlock()
			}
		case op < 96:
			i := rng.IntN(len(tables))
			tables[i].close()
			tables[i] = newTable()
		default:
			m.mu.Lock()
			m.down = !m.down
			m.mu.Unlock()
		}
	}
	return checkFleet(adm, backs, bans, l, r.ttl)
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
	for i := range byDue {
		if byDue[i].cost < 0 {
			continue
		}
		var net int64
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
				for _, g := range backs {
					if g.at >= byDue[i].due-l.MaxWait && g.at <= byDue[j].due {
						bound += g.cost
					}
				}
			}
			if byDue[j].cost > 0 && net > bound {
				return fmt.Errorf("%d admitted, net of give-backs, due between %d and %d µs, more than C + floor(r*T) = %d", net, byDue[i].due, byDue[j].due, bound)
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
	rng := rand.New(rand.NewPCG(20, 3))
	rounds, steps := 300, 1500
	if testing.Short() {
		rounds, steps = 60, 800
	}
	for round := range rounds {
		r := randomFleetRound(rng, steps)
		if err := runFleet(rng, r); err != nil {
			t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes): %v", round, r.limit, r.size, r.ttl, r.nodes, err)
		}
	}
}

// The property test fails on a store that breaks the guarantee: one that
// grants a node one token more than it records, and one that forgets what
// is out on lease, as the store did before it counted leases.
func TestTheLeasePropertyCatchesABrokenStore(t *testing.T) {
	for _, tt := range []struct {
		name   string
		mutate func(sh *bucket.Shared, res *bucket.LeaseResult)
	}{
		{"one token more", func(_ *bucket.Shared, res *bucket.LeaseResult) {
			if res.Granted > 0 {
				res.Granted++
			}
		}},
		{"leases not counted", func(sh *bucket.Shared, _ *bucket.LeaseResult) { sh.Held = nil }},
		{"a waiter goes 1 ms early", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(20, 3))
			for round := range 300 {
				r := randomFleetRound(rng, 800)
				r.mutate = tt.mutate
				if tt.mutate == nil {
					r.mutateWait = func(_ *bucket.Shared, res *bucket.Result) {
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
