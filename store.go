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

// store keeps buckets: the local store, Redis (strict or with leases) and
// the on_store_error local fallback. Every call takes the tier's shape,
// its limits then its quotas (bucket.Tier), and writes or reads each one's
// result in that order, so that the handler writes each step once,
// whatever the shape and the store. Calls on one bucket are atomic: two
// concurrent takes behave as if one came first.
type store interface {
	// take applies a request costing cost to every limit and quota of
	// the bucket, all or none: it writes each one's result into out
	// (room for tr.Parts()) and reports whether the request was allowed.
	take(ctx context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error)
	// peek reports every limit and quota of the bucket into out, as take
	// does, changing nothing and starting no ban.
	peek(ctx context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error
	// giveBack returns limitsN tokens to every limit, up to its capacity,
	// and n, which a request took at the moment at (Unix µs), to every
	// quota while the period that counted them lasts: for count_status,
	// max_wait and concurrency, when a request does not keep what it
	// took. limitsN is at most n: after a reload that changed the limits,
	// what they may take back.
	giveBack(ctx context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error
	// charge takes n more tokens from every limit and quota after the
	// fact, for cost_from_response: a limit may go into debt.
	charge(ctx context.Context, b *Bucket, tr bucket.Tier, n int64) error
	// reset makes the bucket full again.
	reset(ctx context.Context, b *Bucket) error
	// acquire takes one of n in-flight slots of the bucket (concurrency):
	// it reports the slot to free, how many are in use with it, and
	// whether it got one.
	acquire(ctx context.Context, b *Bucket, n int64) (slot uint64, inUse int64, ok bool, err error)
	// release frees a slot acquire gave.
	release(b *Bucket, slot uint64)
	// inFlight is the bucket's slots in use.
	inFlight(ctx context.Context, b *Bucket) (int64, error)
}

// reporter is a store that says how it stands, for GET
// /rate_limit/policies. A store that is not one is shown by name alone.
type reporter interface {
	report() storeReport
}

// storeReport is how a store stands on this node.
type storeReport struct {
	// keys is the buckets it holds in this process's memory.
	keys int
	// breaker is closed, open or half-open, for a store with one.
	breaker string
	// leases is the buckets this node holds leased tokens of.
	leases int
	// master is the address of the master in use, for a store that finds
	// it through Sentinel.
	master string
}

// layeredResetter is a store whose reset clears several layers, some on
// this node whatever becomes of the others (a deny cache before Redis): it
// resets each, and names them with each one's error, for DELETE
// /rate_limit/buckets.
type layeredResetter interface {
	resetLayers(ctx context.Context, b *Bucket) (layers []string, errs []error)
}

// policyStore is a store that keeps each policy's buckets apart, in this
// process: the handler binds it to its policy once it has loaded it, and
// needs no fallback beside it (on_store_error local).
type policyStore interface {
	store
	bind(policy string) error
}

// leaseWarner is a store that warns, at load, of what its settings make
// of the tiers (a lease the tiers' capacities cap).
type leaseWarner interface {
	warnLeaseCaps(logger *zap.Logger, tiers []*Tier)
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

// take applies the request to its bucket in s: every limit and quota of
// its tier in one step. A cost of 0 takes nothing, and is allowed unless
// the bucket is banned or in debt. The result is the binding one's
// (bucket.Binding): of the limits and quotas, the one with the least
// remaining or, refused, the one that makes the client wait longest; its
// Wait is the longest of the limits'.
func (d *decision) take(ctx context.Context, s store) (bucket.Result, error) {
	d.took = s
	out := d.parts()
	if len(out) == 0 {
		// Only in-flight requests: the slot decides.
		return bucket.Result{Allowed: true}, nil
	}
	allowed, err := s.take(ctx, &d.bucket, d.tier.shape(), d.cost, out)
	if err != nil {
		// Nothing was decided, whatever the store wrote.
		d.result = bucket.Result{}
		return bucket.Result{}, err
	}
	// A hidden limit (quotaLimit) never binds.
	hidden := d.tier.hidden
	d.binding = uint8(hidden + bucket.Binding(out[hidden:], allowed))
	res := out[d.binding]
	res.Allowed = allowed
	for _, r := range out[:len(d.tier.limits)] {
		res.Wait = max(res.Wait, r.Wait)
	}
	return res, nil
}

// fallBack applies on_store_error to a store that failed to decide the
// request: it lets the request through undecided (allow), refuses it with
// 503 (deny), or decides it with this node's own buckets (local).
func (h *Handler) fallBack(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, err error) error {
	if r.Context().Err() != nil {
		// The client went away while the store decided: no store failed.
		return h.clientGone(w, d, outcomeError)
	}
	switch h.onStoreError(err, "rate limit store failed", h.DryRun) {
	case goOnUndecided:
		d.decide(outcomeError)
		return next.ServeHTTP(w, r)
	case refuseUndecided:
		return h.storeDown(w, r, d, err)
	}
	res, _ := d.take(r.Context(), h.local)
	return h.answer(w, r, next, d, res)
}

// storeFallback is what on_store_error makes of a store's failure.
type storeFallback uint8

const (
	// useLocal decides with this node's own buckets (local).
	useLocal storeFallback = iota
	// goOnUndecided lets the request through (allow; deny in a dry run,
	// which never refuses).
	goOnUndecided
	// refuseUndecided answers 503 (deny).
	refuseUndecided
)

// onStoreError counts and logs a store's failure, msg saying what failed,
// and says what on_store_error makes of it.
func (h *Handler) onStoreError(err error, msg string, dryRun bool) storeFallback {
	h.storeErrors.Inc()
	h.storeLog.Warn(msg, zap.String("policy", h.Name), zap.String("on_store_error", h.OnStoreError), zap.Error(err))
	switch h.OnStoreError {
	case "allow":
		return goOnUndecided
	case "deny":
		if dryRun {
			return goOnUndecided
		}
		return refuseUndecided
	}
	return useLocal
}

// storeDown refuses a request that the store could not decide, with
// on_store_error deny: 503 with Retry-After: 1. Nothing was decided, so
// its placeholders are empty, whatever the rate limit allowed before.
func (h *Handler) storeDown(w http.ResponseWriter, r *http.Request, d *decision, err error) error {
	d.result = bucket.Result{}
	d.decide(outcomeError)
	return storeUnavailable(w, r, fmt.Errorf("rate limit store unavailable: %w", err))
}

// clientGone answers a request whose client went away before it was
// answered: as reverse_proxy does, the access log gets 499 (client closed
// request).
func (h *Handler) clientGone(w http.ResponseWriter, d *decision, o outcome) error {
	d.decide(o)
	w.WriteHeader(499)
	return nil
}
