package localbucket

// In-flight slots (concurrency): a bucket's count of requests in flight is
// kept beside its states, under the same shard lock, only while it has
// some.

// Acquire takes one of n slots of bucket id: it reports how many are in
// use with it, and whether it got one.
func (s *Store) Acquire(id uint64, n int64) (inUse int64, ok bool) {
	sh := s.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	c := int64(sh.slots[id])
	if c >= n {
		return c, false
	}
	if sh.slots == nil {
		sh.slots = map[uint64]int32{}
	}
	sh.slots[id] = int32(c + 1)
	return c + 1, true
}

// Release frees a slot Acquire gave.
func (s *Store) Release(id uint64) {
	sh := s.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if c := sh.slots[id]; c > 1 {
		sh.slots[id] = c - 1
	} else {
		delete(sh.slots, id)
	}
}

// InFlight is bucket id's slots in use.
func (s *Store) InFlight(id uint64) int64 {
	sh := s.shard(id)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	return int64(sh.slots[id])
}
