package ratelimit

import (
	"context"
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
)

func bucketFor(value string) *Bucket {
	return &Bucket{Policy: "p", Tier: "default", Keyer: "ip/32/64", Value: []byte(value)}
}

func TestResetRefillsABucket(t *testing.T) {
	s := &LocalStore{buckets: localbucket.New(localOptions(10))}
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	b := bucketFor("127.0.0.1")
	ctx := context.Background()
	if res, _ := s.Take(ctx, b, l, 1); !res.Allowed {
		t.Fatal("first request denied")
	}
	if res, _ := s.Peek(ctx, b, l); res.Allowed || res.Remaining != 0 {
		t.Fatalf("peek after the only token: %+v, want 0 remaining", res)
	}
	if err := s.Reset(ctx, b); err != nil {
		t.Fatal(err)
	}
	if res, _ := s.Take(ctx, b, l, 1); !res.Allowed {
		t.Fatal("request after reset denied")
	}
}

func TestBucketsOfDifferentTiersAndKeyersAreApart(t *testing.T) {
	s := &LocalStore{buckets: localbucket.New(localOptions(100))}
	l := bucket.Limit{Capacity: 1, Rate: bucket.Rate{Tokens: 1, Interval: 3_600_000_000}}
	for _, b := range []*Bucket{
		{Policy: "p", Tier: "a", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "b", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "a", Keyer: "header/X-Key", Value: []byte("x")},
		{Policy: "q", Tier: "a", Keyer: "ip/32/64", Value: []byte("x")},
		{Policy: "p", Tier: "a", Keyer: "ip/32/64", Value: []byte("y")},
	} {
		if res, _ := s.Take(bg, b, l, 1); !res.Allowed {
			t.Errorf("bucket %+v shares a bucket with an earlier one", b)
		}
	}
}
