package redisbucket

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// The debt rule holds across a reload: a key whose credit charge left the
// shared bucket in debt gets no credit from the next config's lease table
// either, on the same connection, until the debt is paid; else every
// reload would admit nodes x k more. Strict mode refuses the request.
func TestAReloadDoesNotCreditAKeyInDebtAgain(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	plan, err := NewPlan(Options{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	conn := plan.Connect(nopLogger)
	defer func() { _ = conn.Close() }()
	opts := StoreOptions{Lease: LeaseSize{tokens: 2}, Credit: 1}
	l := slowLimit(4)
	key := bucketFor("in debt across reloads")
	out := make([]bucket.Result, 1)
	strict := NewStore(conn, StoreOptions{})
	if allowed, err := strict.Take(bg, key, oneLimit(l), 4, out); err != nil || !allowed {
		t.Fatalf("spending the bucket: %v %v", allowed, err)
	}
	s := NewStore(conn, opts)
	if allowed, err := s.Take(bg, key, oneLimit(l), 1, out); err != nil || !allowed {
		t.Fatalf("the first request on credit: %v %v", allowed, err)
	}
	tableSync(s.leases)
	for i := range 3 {
		// A reload: the next config's store, then the old one closed.
		next := NewStore(conn, opts)
		s.Close()
		s = next
		allowed, err := s.Take(bg, key, oneLimit(l), 1, out)
		tableSync(s.leases)
		if err != nil || allowed {
			s.Close()
			t.Fatalf("reload %d: a request on a bucket of %d spent and 1 in debt: allowed %v (%v); want refused, no credit while in debt", i+1, l.Capacity, allowed, err)
		}
	}
	s.Close()
}

// The connection's book of keys in debt stays within its bound under a
// flood of keys in debt: once it is full of debts not yet ended, a new
// key gets no credit; once they end, it does again.
func TestTheBookOfDebtsTurnsCreditOffWhenFull(t *testing.T) {
	t.Parallel()
	b := newDebtBook(2)
	b.charged("a", 100, 0)
	b.charged("b", 200, 0)
	b.charged("c", 300, 0) // no room: the book keeps its bound
	if n := len(b.until); n != 2 {
		t.Fatalf("%d keys in a book of 2", n)
	}
	if k, until := b.creditFor("a", 3, 50); k != 0 || until != 100 {
		t.Errorf("a key in debt until 100, at 50: credit %d, kept until %d; want none, until 100", k, until)
	}
	if k, _ := b.creditFor("d", 3, 50); k != 0 {
		t.Errorf("a new key while the book is full of debts: credit %d; want none", k)
	}
	if k, until := b.creditFor("d", 3, 150); k != 3 || until != 0 {
		t.Errorf("a new key once a debt ended: credit %d, kept until %d; want 3, not kept", k, until)
	}
}

// The credit property (runCredit) with every node's config reloaded
// before each attack: over every window at most C + floor(rT) + nodes x k,
// since each node's book of debts carries the debt rule to the next table.
func TestCreditAcrossReloadsNeverAdmitsMoreThanNodesTimesK(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(36, seed))
	rounds := 120
	if testing.Short() {
		rounds = 40
	}
	for i := range rounds {
		r := randomCreditRound(rng, 300)
		r.reload = true
		if _, err := runCredit(rng, r); err != nil {
			t.Fatalf("round %d (limit %+v, lease %+v, ttl %s, %d nodes, credit %d): %v", i, r.limit, r.size, r.ttl, r.nodes, r.credit, err)
		}
	}
}

// The property catches nodes whose next config forgets the keys in debt:
// each reload credits them again.
func TestTheReloadCreditPropertyCatchesATableWithoutTheBook(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(36, 5))
	for round := range 60 {
		r := randomCreditRound(rng, 300)
		r.reload, r.noBook = true, true
		if _, err := runCredit(rng, r); err != nil {
			t.Logf("caught in round %d: %v", round, err)
			return
		}
	}
	t.Fatal("no round caught the tables without the book of debts")
}

// A reload while the old table's credit charge is still out: the next
// table gives the key no credit before that charge answers, since it may
// leave the bucket in debt (the book marks the key while it is charged).
func TestAReloadDuringACreditChargeDoesNotCreditTheKeyAgain(t *testing.T) {
	t.Parallel()
	clock, sm := newModelStore()
	c := &creditModel{sharedModel: sm, gate: make(chan struct{})}
	l := slowLimit(4)
	key := []byte("charged across a reload")
	sm.bucket(string(key), 1).Take(clock.now(), []bucket.Limit{l}, 4, make([]bucket.Result, 1)) // spent
	book := newDebtBook(1000)
	old := newCreditTable(c, LeaseSize{tokens: 2}, time.Second, 1000, 1)
	old.debts = book
	if res, err := old.take(bg, key, oneLimit(l), 1, nil); err != nil || !res.Allowed {
		t.Fatalf("credited: %+v %v", res, err)
	}
	next := newCreditTable(c, LeaseSize{tokens: 2}, time.Second, 1000, 1)
	next.debts = book
	defer next.close()
	res, err := next.take(bg, key, oneLimit(l), 1, nil)
	c.mu.Lock()
	close(c.gate)
	c.gate = nil
	c.mu.Unlock()
	old.close()
	tableSync(next)
	if err != nil || res.Allowed {
		t.Fatalf("the next config's first request on a spent bucket, the old one's charge out: %+v %v; want refused by a lease call, no credit", res, err)
	}
	// The charge left a debt: the next table's entry is not kept past it
	// by the mark the charge left while it was out.
	clock.advance(48 * time.Hour)
	next.sweep(clock.now(), false)
	if next.holds(key) {
		t.Error("the next table keeps the key two days after the debt of a token an hour ended")
	}
}
