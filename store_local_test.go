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
	if res, _ := takeLimit(ctx, s, b, l, 1); !res.Allowed {
		t.Fatal("first request denied")
	}
	if res, _ := peekLimit(ctx, s, b, l); res.Allowed || res.Remaining != 0 {
		t.Fatalf("peek after the only token: %+v, want 0 remaining", res)
	}
	if err := s.reset(ctx, b); err != nil {
		t.Fatal(err)
	}
	if res, _ := takeLimit(ctx, s, b, l, 1); !res.Allowed {
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
		if res, _ := takeLimit(bg, s, b, l, 1); !res.Allowed {
			t.Errorf("bucket %+v shares a bucket with an earlier one", b)
		}
	}
}

// takeLimit is a store's take on the tier of the one limit l.
func takeLimit(ctx context.Context, s store, b *Bucket, l bucket.Limit, cost int64) (bucket.Result, error) {
	var out [1]bucket.Result
	_, err := s.take(ctx, b, bucket.Tier{Limits: []bucket.Limit{l}}, cost, out[:])
	return out[0], err
}

// peekLimit is a store's peek on the tier of the one limit l.
func peekLimit(ctx context.Context, s store, b *Bucket, l bucket.Limit) (bucket.Result, error) {
	var out [1]bucket.Result
	err := s.peek(ctx, b, bucket.Tier{Limits: []bucket.Limit{l}}, out[:])
	return out[0], err
}
