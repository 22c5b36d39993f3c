package ratelimit

import (
	"testing"
)

// TestRedisKeysKeepPoliciesAndTiersApart takes the one token of a bucket,
// then asks for a bucket of another policy and tier whose names, joined
// with ":", read the same. Each has its own key, so the second is full.
func TestRedisKeysKeepPoliciesAndTiersApart(t *testing.T) {
	srv := startRedis(t)
	s := newRedisStoreFor(t, &RedisStore{Addresses: []string{srv.url()}})
	for i, c := range []struct{ policy1, tier1, policy2, tier2 string }{
		{"a:b", "c", "a", "b:c"},
		{"a:", "b", "a", ":b"},
		{"x", "", "", "x"},
		{"1:a", "2", "1", "a:2"},
	} {
		value := []byte{byte(i)} // one client per case
		first := &Bucket{Policy: c.policy1, Tier: c.tier1, Keyer: "ip", Value: value}
		second := &Bucket{Policy: c.policy2, Tier: c.tier2, Keyer: "ip", Value: value}
		if k1, k2 := s.keyOf(first), s.keyOf(second); k1 == k2 {
			t.Errorf("policy %q tier %q and policy %q tier %q: one key %q", c.policy1, c.tier1, c.policy2, c.tier2, k1)
		}
		if res, err := takeLimit(bg, s, first, slowLimit(1), 1); err != nil || !res.Allowed {
			t.Fatalf("first take on policy %q tier %q: %+v, %v", c.policy1, c.tier1, res, err)
		}
		if res, err := takeLimit(bg, s, second, slowLimit(1), 1); err != nil || !res.Allowed {
			t.Errorf("policy %q tier %q, after policy %q tier %q spent its token: %+v, %v; want allowed, its own bucket",
				c.policy2, c.tier2, c.policy1, c.tier1, res, err)
		}
	}
}
