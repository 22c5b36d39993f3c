package localbucket

import "hash/maphash"

// Hasher gives buckets their ids. A bucket is named by its policy, tier
// and keyer (its prefix) and its client's value. Its id is the hash of
// the prefix under one seed xor the hash of the value under another: a
// handler hashes each of its prefixes once, at provision, and a request
// hashes only its client's value, about a fifth of what hashing the whole
// name in one piece costs (BenchmarkBucketID). With one seed for both, a
// value that spells policy A's prefix, taken under policy B, and one that
// spells B's, under A, would share an id; two seeds, neither known to
// clients, keep every two names apart but by a 64-bit chance
// (TestBucketsNamedApartHaveIDsApart).
type Hasher struct {
	prefix, value maphash.Seed
}

// NewHasher returns a Hasher with seeds of its own.
func NewHasher() Hasher {
	return Hasher{prefix: maphash.MakeSeed(), value: maphash.MakeSeed()}
}

// Prefix is the hash of the part of a bucket's name its handler sets: the
// policy, tier and keyer, each followed by a 0.
func (h Hasher) Prefix(policy, tier, keyer string) uint64 {
	var m maphash.Hash
	m.SetSeed(h.prefix)
	m.WriteString(policy)
	m.WriteByte(0)
	m.WriteString(tier)
	m.WriteByte(0)
	m.WriteString(keyer)
	m.WriteByte(0)
	return m.Sum64()
}

// ID is the id of the bucket of prefix (Prefix) and a client's value.
func (h Hasher) ID(prefix uint64, value []byte) uint64 {
	return maphash.Bytes(h.value, value) ^ prefix
}
