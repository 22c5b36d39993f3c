package ratelimit

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"hash"
	"net/http"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Bucket names one client's bucket: the policy, the tier, the keyer that
// named the client and the value it read. Stores hash it: the value is
// whatever the client sent and is never stored or shown in clear.
type Bucket struct {
	Policy string
	Tier   string
	Keyer  string
	Value  []byte
	// secret keys the digest of Keyer and Value (key_secret), when set.
	secret []byte
}

// Store keeps buckets. Take must be atomic per bucket: two concurrent Takes
// on one bucket behave as if one came first.
type Store interface {
	// Take applies a request costing cost tokens to the bucket.
	Take(ctx context.Context, b *Bucket, l bucket.Limit, cost int64) (bucket.Result, error)
	// TakeAll applies a request to the bucket's several limits, atomically:
	// it takes cost tokens from every one, or, when one is short, from
	// none. It writes each limit's result into out and reports whether the
	// request was allowed.
	TakeAll(ctx context.Context, b *Bucket, ls []bucket.Limit, cost int64, out []bucket.Result) (bool, error)
	// Peek reports the bucket without changing it.
	Peek(ctx context.Context, b *Bucket, l bucket.Limit) (bucket.Result, error)
	// Reset makes the bucket full again.
	Reset(ctx context.Context, b *Bucket) error
	// Charge takes n more tokens after the fact, for cost_from_response:
	// the bucket may go into debt.
	Charge(ctx context.Context, b *Bucket, l bucket.Limit, n int64) error
	// GiveBack returns n tokens that a Take took, up to the capacity: for
	// count_status, when the response's status is not one that counts.
	GiveBack(ctx context.Context, b *Bucket, l bucket.Limit, n int64) error
	// GiveBackAll is GiveBack for a bucket of several limits: n tokens
	// back to each, as TakeAll took them.
	GiveBackAll(ctx context.Context, b *Bucket, ls []bucket.Limit, n int64) error
}

// StoreReporter is a store that says how it stands, for GET
// /rate_limit/policies. A store that is not one is shown by name alone.
type StoreReporter interface {
	Report() StoreReport
}

// StoreReport is how a store stands on this node.
type StoreReport struct {
	// Keys is the buckets it holds in this process's memory.
	Keys int
	// Breaker is closed, open or half-open, for a store with one.
	Breaker string
	// Leases is the buckets this node holds leased tokens of.
	Leases int
	// Master is the address of the master in use, for a store that finds
	// it through Sentinel.
	Master string
}

// LeaseHolder is a store whose node may hold tokens of a bucket apart from
// it (Redis leases): a request they cover is allowed on this node whatever
// the bucket holds. Its Peek counts them in each remaining.
type LeaseHolder interface {
	// Held is how many tokens of the bucket b this node holds and may
	// spend now.
	Held(b *Bucket) int64
}

// LayeredResetter is a store whose Reset clears several layers, some on
// this node whatever becomes of the others (a deny cache before Redis): it
// resets each, and names them with each one's error, for DELETE
// /rate_limit/buckets.
type LayeredResetter interface {
	ResetLayers(ctx context.Context, b *Bucket) (layers []string, errs []error)
}

// policyStore is a store that keeps each policy's buckets apart. The handler
// binds it to its policy once it has loaded it.
type policyStore interface {
	Store
	bind(policy string) error
}

// processStart anchors the monotonic clock. One is added so that the zero
// State, full at time 0, is full at every time the clock gives.
var processStart = time.Now()

func monotonicMicros() int64 { return time.Since(processStart).Microseconds() + 1 }

// keyID is a fingerprint of a bucket's client, for logs, the admin API and
// the {http.rate_limit.key_id} placeholder: the first 8 bytes of its digest.
func keyID(b *Bucket) string {
	sum := b.Digest()
	return hex.EncodeToString(sum[:8])
}

// Digest hashes the client part of a bucket's name: the keyer and the
// value, with HMAC-SHA256 under key_secret when there is one, else plain
// SHA-256. It is stable across processes, for stores shared by several
// nodes.
func (b *Bucket) Digest() [sha256.Size]byte {
	if len(b.secret) == 0 && len(b.Keyer)+1+len(b.Value) <= 256 {
		// Most keys are short: hashed from the stack, with no allocation.
		var buf [256]byte
		n := copy(buf[:], b.Keyer)
		n++ // the 0 between keyer and value
		n += copy(buf[n:], b.Value)
		return sha256.Sum256(buf[:n])
	}
	var h hash.Hash
	if len(b.secret) > 0 {
		h = hmac.New(sha256.New, b.secret)
	} else {
		h = sha256.New()
	}
	h.Write([]byte(b.Keyer))
	h.Write([]byte{0})
	h.Write(b.Value)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// take applies the request to its bucket. A cost of 0 takes nothing, and
// is allowed unless the bucket is banned or in debt.
func (h *Handler) take(ctx context.Context, d *decision) (bucket.Result, error) {
	began := time.Now()
	defer func() { h.storeTime.Observe(time.Since(began).Seconds()) }()
	d.took = h.store
	if len(d.tier.limits) == 0 {
		// Only in-flight requests: the slot decides.
		return bucket.Result{Allowed: true}, nil
	}
	if len(d.tier.quotas) > 0 {
		return d.takeQuotas(ctx, h.store)
	}
	if len(d.tier.limits) > 1 {
		return d.takeAll(ctx, h.store)
	}
	return h.store.Take(ctx, &d.bucket, d.tier.limit, d.cost)
}

// storeFailed applies on_store_error.
func (h *Handler) storeFailed(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, err error) error {
	if r.Context().Err() != nil {
		// The client went away while the store decided: no store failed.
		// As reverse_proxy does, the access log gets 499.
		d.decide(outcomeError)
		w.WriteHeader(499)
		return nil
	}
	h.storeErrors.Inc()
	h.storeLog.Warn("rate limit store failed", zap.String("policy", h.Name), zap.String("on_store_error", h.OnStoreError), zap.Error(err))
	switch h.OnStoreError {
	case "allow":
		d.decide(outcomeError)
		return next.ServeHTTP(w, r)
	case "deny":
		d.decide(outcomeError)
		if h.DryRun {
			// A dry run never refuses, not even for a store it cannot reach.
			return next.ServeHTTP(w, r)
		}
		return storeUnavailable(w, r, fmt.Errorf("rate limit store unavailable: %w", err))
	}
	var res bucket.Result
	if len(d.tier.quotas) > 0 {
		res, _ = d.takeQuotas(r.Context(), h.local)
	} else if len(d.tier.limits) > 1 {
		res, _ = d.takeAll(r.Context(), h.local)
	} else {
		res, _ = h.local.Take(r.Context(), &d.bucket, d.tier.limit, d.cost)
	}
	d.took = h.local
	return h.answer(w, r, next, d, res)
}
