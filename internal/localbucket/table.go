package localbucket

import "github.com/bramsley/caddy-ratelimit/internal/bucket"

// stateTable maps a bucket's 64-bit hash to its State, in about 20 bytes a
// bucket: open addressing with linear probing over three parallel arrays,
// and no per-entry pointers for the garbage collector to scan. A Go map of
// the same would take a 24-byte slot plus control bytes and spare room.
//
// The hashes are already uniform (a keyed maphash), so their low bits index
// the table directly. Hash 0 marks an empty slot; a real 0 is stored as 1,
// which merges two buckets once in 2^64. Deletion shifts the rest of a
// cluster back, so there are no tombstones and lookups stay short.
//
// It is not safe for concurrent use: each shard of a Store has one,
// under the shard's lock.
type stateTable struct {
	keys   []uint64
	fullAt []int64
	slack  []uint32
	n      int
}

// maxLoad is the fill, out of 8, at which the table doubles: it then holds
// between 7/16 and 7/8 of its slots, 23 to 46 bytes a bucket.
const maxLoad = 7

func tableKey(id uint64) uint64 { return max(id, 1) }

// find returns the slot holding key, or the empty slot where it would go.
func (t *stateTable) find(key uint64) (int, bool) {
	if len(t.keys) == 0 {
		return -1, false
	}
	mask := len(t.keys) - 1
	for i := int(key) & mask; ; i = (i + 1) & mask {
		switch t.keys[i] {
		case key:
			return i, true
		case 0:
			return i, false
		}
	}
}

// get returns the state stored for id, or the zero State (a full bucket).
func (t *stateTable) get(id uint64) (bucket.State, bool) {
	i, ok := t.find(tableKey(id))
	if !ok {
		return bucket.State{}, false
	}
	return t.at(i), true
}

// at is the state in slot i, which holds one.
func (t *stateTable) at(i int) bucket.State {
	return bucket.State{FullAt: t.fullAt[i], Slack: int64(t.slack[i] &^ bannedBit), Banned: t.slack[i]&bannedBit != 0}
}

// set stores st in slot i, which holds a state: a put with no second
// probe.
func (t *stateTable) set(i int, st bucket.State) {
	t.fullAt[i] = st.FullAt
	t.slack[i] = uint32(st.Slack)
	if st.Banned {
		t.slack[i] |= bannedBit
	}
}

// bannedBit marks, in a slot's slack, a state that a ban wrote, or a quota
// count used up (tableQuota): eviction spares both while it can
// (Store.makeRoom). Slack is below Rate.Tokens, which Limit.Validate
// bounds to 31 bits, and a count is below 2^31, so the top bit is free.
const bannedBit = 1 << 31

// put stores the state for id.
func (t *stateTable) put(id uint64, st bucket.State) {
	key := tableKey(id)
	i, ok := t.find(key)
	if !ok {
		if (t.n+1)*8 > len(t.keys)*maxLoad {
			t.grow()
			i, _ = t.find(key)
		}
		t.keys[i] = key
		t.n++
	}
	t.set(i, st)
}

// remove deletes id's state, if any.
func (t *stateTable) remove(id uint64) {
	if i, ok := t.find(tableKey(id)); ok {
		t.removeAt(i)
	}
}

// removeAt empties slot i and shifts back the entries after it in its
// cluster that would no longer be found. An entry from later in the cluster
// may land in slot i, so a caller scanning the table looks at i again.
func (t *stateTable) removeAt(i int) {
	mask := len(t.keys) - 1
	for j := (i + 1) & mask; t.keys[j] != 0; j = (j + 1) & mask {
		home := int(t.keys[j]) & mask
		// Move j back to i if its home is not in the cyclic range (i, j].
		if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
			t.keys[i], t.fullAt[i], t.slack[i] = t.keys[j], t.fullAt[j], t.slack[j]
			i = j
		}
	}
	t.keys[i] = 0
	t.n--
}

func (t *stateTable) grow() {
	size := max(8, 2*len(t.keys))
	old := *t
	*t = stateTable{keys: make([]uint64, size), fullAt: make([]int64, size), slack: make([]uint32, size)}
	for i, key := range old.keys {
		if key != 0 {
			j, _ := t.find(key)
			t.keys[j], t.fullAt[j], t.slack[j] = key, old.fullAt[i], old.slack[i]
			t.n++
		}
	}
}

// sweep removes entries for which drop says so, given their fullAt and
// slack, looking at every slot once, from slot start on and round, until
// it has removed limit entries. It returns how many it removed.
func (t *stateTable) sweep(start, limit int, drop func(fullAt int64, slack uint32) bool) int {
	size := len(t.keys)
	if size == 0 {
		return 0
	}
	removed := 0
	// Each removal may bring one entry back to the slot just looked at.
	for steps, i := 0, start&(size-1); steps < size+removed && removed < limit; steps++ {
		if t.keys[i] != 0 && drop(t.fullAt[i], t.slack[i]) {
			t.removeAt(i)
			removed++
			continue // slot i may hold a shifted entry now
		}
		i = (i + 1) & (size - 1)
	}
	return removed
}
