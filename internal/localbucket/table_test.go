package localbucket

import (
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"math/rand/v2"
	"strings"
	"testing"
)

// TestStateTableMatchesAMap runs random puts, removes and sweeps on the
// table and on a Go map, and compares them after every step. Keys come
// from a small range, so that clusters form and wrap around the table.
func TestStateTableMatchesAMap(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(5, 6))
	for round := range 20 {
		var tab stateTable
		ref := make(map[uint64]bucket.State)
		keyRange := uint64(8 + rng.IntN(2000))
		for step := range 5000 {
			// Hashes that share their low bits collide in the table.
			key := rng.Uint64N(keyRange) << uint(rng.IntN(3)*20)
			switch op := rng.IntN(10); {
			case op < 6:
				st := bucket.State{FullAt: rng.Int64N(1000), Slack: rng.Int64N(1 << 31)}
				tab.put(key, st)
				ref[tableKey(key)] = st
			case op < 9:
				tab.remove(key)
				delete(ref, tableKey(key))
			default:
				cut := rng.Int64N(1000)
				removed := tab.sweep(rng.Int(), len(ref), func(fullAt int64, _ uint32) bool { return fullAt < cut })
				want := 0
				for k, st := range ref {
					if st.FullAt < cut {
						delete(ref, k)
						want++
					}
				}
				if removed != want {
					t.Fatalf("round %d step %d: sweep removed %d, want %d", round, step, removed, want)
				}
			}
			if tab.n != len(ref) {
				t.Fatalf("round %d step %d: %d entries, want %d", round, step, tab.n, len(ref))
			}
		}
		for k, want := range ref {
			if got, ok := tab.get(k); !ok || got != want {
				t.Fatalf("round %d: key %d: got %+v %v, want %+v", round, k, got, ok, want)
			}
		}
		for i, k := range tab.keys {
			if _, ok := ref[k]; k != 0 && !ok {
				t.Fatalf("round %d: slot %d holds key %d that was removed", round, i, k)
			}
		}
	}
}

func TestStateTableSweepStopsAtItsLimit(t *testing.T) {
	t.Parallel()
	var tab stateTable
	for i := range uint64(100) {
		tab.put(i+1, bucket.State{FullAt: 5})
	}
	if got := tab.sweep(17, 10, func(int64, uint32) bool { return true }); got != 10 || tab.n != 90 {
		t.Fatalf("sweep with limit 10 removed %d, left %d; want 10 and 90", got, tab.n)
	}
}

func TestHashZeroIsStored(t *testing.T) {
	t.Parallel()
	var tab stateTable
	tab.put(0, bucket.State{FullAt: 42})
	if st, ok := tab.get(0); !ok || st.FullAt != 42 {
		t.Fatalf("get(0) = %+v, %v; want FullAt 42", st, ok)
	}
}

// Buckets whose names differ get ids apart: in the value, in any part of
// the prefix, or where a value spells another policy's prefix. With one
// seed for prefixes and values, the last pair (a value that spells B's
// prefix under A, and one that spells A's under B) would share an id.
// A prefix hashed afresh gives the id a handler's cached one gives.
func TestBucketsNamedApartHaveIDsApart(t *testing.T) {
	type name struct{ policy, tier, keyer, value string }
	names := []name{
		{"p", "default", "ip/32/64", "127.0.0.1"},
		{"p", "default", "ip/32/64", "127.0.0.2"},
		{"p", "default", "ip/32/64", ""},
		{"q", "default", "ip/32/64", "127.0.0.1"},
		{"p", "gold", "ip/32/64", "127.0.0.1"},
		{"p", "default", "header/X-Key", "127.0.0.1"},
		{"pd", "efault", "ip/32/64", "127.0.0.1"},
		{"a", "t", "k", "b\x00t\x00k\x00"},
		{"b", "t", "k", "a\x00t\x00k\x00"},
		{"p", "default", "ip/32/64", strings.Repeat("v", 5000)},
	}
	seen := map[uint64]name{}
	for _, n := range names {
		id := ids.ID(ids.Prefix(n.policy, n.tier, n.keyer), []byte(n.value))
		if other, ok := seen[id]; ok {
			t.Errorf("%q and %q share id %x", n, other, id)
		}
		seen[id] = n
	}
	// One seed for both parts, as a mutation: the crossed pair collides,
	// which is what the two seeds are for.
	one := NewHasher()
	one.value = one.prefix
	a := one.ID(one.Prefix("a", "t", "k"), []byte("b\x00t\x00k\x00"))
	b := one.ID(one.Prefix("b", "t", "k"), []byte("a\x00t\x00k\x00"))
	if a != b {
		t.Errorf("with one seed the crossed names have ids %x and %x; the test no longer shows why two seeds are needed", a, b)
	}
	if got, want := bucketID([]byte("127.0.0.1")), ids.ID(ids.Prefix("p", "default", "ip/32/64"), []byte("127.0.0.1")); got != want {
		t.Errorf("the cached prefix gives %x, a fresh one %x", got, want)
	}
}
