// Package ratelimit is a Caddy HTTP handler that limits each client's
// request rate with a token bucket, at the edge, before the origin.
//
// A request finds its client's bucket through keyers (the client IP, a
// header, a cookie, a verified JWT claim, a body field or a placeholder),
// picks a tier (the first whose conditions hold), and takes tokens from the
// bucket in a store (this process's memory, or Redis shared by a fleet). A
// request that finds the bucket empty gets 429 with Retry-After.
package ratelimit

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler limits the rate of requests per client.
//
// Each client has a token bucket per tier. The bucket starts full with
// Capacity tokens and refills at the tier's rate; each request takes Cost
// tokens, and one that finds too few is rejected with Status (429) and a
// Retry-After header. Responses tell clients where they stand through the
// X-RateLimit-* or IETF RateLimit headers.
type Handler struct {
	// Name is the policy's name. Handlers with the same name share buckets,
	// so one limit can span several routes or sites. Default "default".
	Name string `json:"name,omitempty"`

	// KeyersRaw name the client, tried in order: the first that yields a
	// non-empty value wins. When none does, the client IP names the client.
	// Default: the client IP alone.
	KeyersRaw []json.RawMessage `json:"keys,omitempty" caddy:"namespace=http.handlers.rate_limit.keys inline_key=keyer"`

	// JWT verifies bearer tokens, for the jwt keyer and claim conditions.
	JWT *JWTConfig `json:"jwt,omitempty"`

	// Tiers are tried in order; the first whose conditions hold applies.
	// The last must have no conditions, so that every request has a tier.
	Tiers []*Tier `json:"tiers,omitempty"`

	// StoreRaw keeps the buckets. Default: the local in-memory store.
	StoreRaw json.RawMessage `json:"store,omitempty" caddy:"namespace=http.handlers.rate_limit.stores inline_key=store"`

	// OnStoreError says what happens when the store fails: "local" limits
	// with this node's own buckets, "allow" lets the request through,
	// "deny" answers 503 with Retry-After: 1. Default "local".
	OnStoreError string `json:"on_store_error,omitempty"`

	// Headers chooses the response headers: "x" (X-RateLimit-Limit,
	// -Remaining, -Reset), "ietf" (RateLimit and RateLimit-Policy), "both"
	// or "none". Retry-After is sent on every rejection whatever this says.
	// Default "x".
	Headers string `json:"headers,omitempty"`

	// UpstreamHeaders also sets the limit headers on the request, so that
	// later handlers and the origin see them.
	UpstreamHeaders bool `json:"upstream_headers,omitempty"`

	// Status is the status code of a rejection. Default 429.
	Status int `json:"status,omitempty"`

	// DryRun decides, counts, logs and sets headers, but never rejects.
	DryRun bool `json:"dry_run,omitempty"`

	// NoKey says what happens when no keyer names the client: "ip" keys it
	// by its IP address; "deny" answers 400 and the request goes no
	// further, so that a client cannot leave the per-user bucket by sending
	// a body the body keyers cannot read. "deny" needs at least one keyer.
	// Default "ip".
	NoKey string `json:"no_key,omitempty"`

	keyers   []Keyer
	fallback Keyer
	store    Store
	// local limits per node while the shared store fails, with on_store_error local.
	local       *LocalStore
	xHeaders    bool
	ietfHeaders bool
	logger      *zap.Logger
	storeLog    *zap.Logger
	storeTime   prometheus.Observer
	storeErrors prometheus.Counter

	// noKeyDeny is NoKey == "deny".
	noKeyDeny bool
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets the handler up: defaults, keyers, tiers and store.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	// Store trouble can come with every request; a few lines a second say it.
	h.storeLog = h.logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 3, 0)
	}))
	if err := h.check(); err != nil {
		return err
	}
	if h.JWT != nil {
		if err := h.JWT.provision(ctx); err != nil {
			return err
		}
	}

	mods, err := ctx.LoadModule(h, "KeyersRaw")
	if err != nil {
		return fmt.Errorf("loading keyers: %v", err)
	}
	for _, mod := range mods.([]any) {
		k := mod.(Keyer)
		if user, ok := k.(jwtUser); ok {
			if h.JWT == nil {
				return fmt.Errorf("key %s: needs a jwt block to verify tokens", k.ID())
			}
			user.useJWT(h.JWT)
		}
		h.keyers = append(h.keyers, k)
	}
	fallback := &IPKeyer{}
	if err := fallback.Provision(ctx); err != nil {
		return err
	}
	h.fallback = fallback

	if err := registerMetrics(ctx.GetMetricsRegistry()); err != nil {
		return fmt.Errorf("registering metrics: %v", err)
	}
	for _, t := range h.Tiers {
		if err := t.provision(ctx); err != nil {
			return err
		}
		t.counters = newOutcomeCounters(h.Name, t.Name)
		if len(t.Claims) > 0 && h.JWT == nil {
			return fmt.Errorf("tier %q: a claim condition needs a jwt block to verify tokens", t.Name)
		}
	}

	if h.StoreRaw == nil {
		h.StoreRaw = json.RawMessage(`{"store":"local"}`)
	}
	mod, err := ctx.LoadModule(h, "StoreRaw")
	if err != nil {
		return fmt.Errorf("loading store: %v", err)
	}
	h.store = mod.(Store)
	storeName := caddy.GetModuleName(mod)
	h.storeTime = storeDuration.WithLabelValues(storeName)
	h.storeErrors = storeErrorsTotal.WithLabelValues(storeName)
	if ps, ok := h.store.(policyStore); ok {
		if err := ps.bind(h.Name); err != nil {
			return err
		}
	}
	if _, isLocal := h.store.(*LocalStore); !isLocal && h.OnStoreError == "local" {
		// Named apart from the main local store, so that a policy that
		// switches between local and Redis does not mix the two.
		h.local = new(LocalStore)
		if err := h.local.bind(h.Name + "/on_store_error"); err != nil {
			return err
		}
	}
	registerHandler(h)
	return nil
}

// check applies defaults and validates what needs no Caddy context. The
// Caddyfile adapter runs it too, so that mistakes fail `caddy adapt`.
func (h *Handler) check() error {
	if h.Name == "" {
		h.Name = "default"
	}
	if h.OnStoreError == "" {
		h.OnStoreError = "local"
	}
	if h.Headers == "" {
		h.Headers = "x"
	}
	if h.Status == 0 {
		h.Status = http.StatusTooManyRequests
	}
	switch h.OnStoreError {
	case "local", "allow", "deny":
	default:
		return fmt.Errorf("on_store_error %q: want local, allow or deny", h.OnStoreError)
	}
	if err := h.checkNoKey(); err != nil {
		return err
	}
	switch h.Headers {
	case "x", "ietf", "both", "none":
	default:
		return fmt.Errorf("headers %q: want x, ietf, both or none", h.Headers)
	}
	h.xHeaders = h.Headers == "x" || h.Headers == "both"
	h.ietfHeaders = h.Headers == "ietf" || h.Headers == "both"
	if h.Status < 400 || h.Status > 599 {
		return fmt.Errorf("status %d: want a 4xx or 5xx code", h.Status)
	}
	if len(h.Tiers) == 0 {
		return fmt.Errorf("policy %q: no tier: give a capacity and refill, such as `rate_limit 100 10/s`", h.Name)
	}
	seen := make(map[string]bool, len(h.Tiers))
	for i, t := range h.Tiers {
		if err := t.check(); err != nil {
			return err
		}
		if seen[t.Name] {
			return fmt.Errorf("tier %q is defined twice", t.Name)
		}
		seen[t.Name] = true
		if t.catchAll() && i < len(h.Tiers)-1 {
			return fmt.Errorf("tier %q has no conditions, so the tiers after it would never apply", t.Name)
		}
	}
	if last := h.Tiers[len(h.Tiers)-1]; !last.catchAll() {
		return fmt.Errorf("policy %q: no catch-all tier: every tier has a condition, so some requests would have none; add a capacity and refill to the rate_limit line, such as `rate_limit 100 10/s`", h.Name)
	}
	return nil
}

// checkNoKey validates no_key. Its default is left unwritten, so that the
// adapted config shows only what the Caddyfile says.
func (h *Handler) checkNoKey() error {
	switch h.NoKey {
	case "", "ip":
	case "deny":
		if len(h.KeyersRaw) == 0 {
			return fmt.Errorf("no_key deny: give a key to try first; with none, every request would be denied")
		}
	default:
		return fmt.Errorf("no_key %q: want ip or deny", h.NoKey)
	}
	h.noKeyDeny = h.NoKey == "deny"
	return nil
}

// Cleanup releases the on_store_error store. Caddy cleans up the store
// itself, as a module it loaded for the handler.
func (h *Handler) Cleanup() error {
	unregisterHandler(h)
	if h.local != nil {
		return h.local.Cleanup()
	}
	return nil
}

// errLimited is the error behind a rejection, for Caddy's error handling.
var errLimited = errors.New("rate limit exceeded")

// errDenyTier is the error behind a deny tier's 403.
var errDenyTier = errors.New("client is on a deny tier")

// errNoKey is the error behind no_key deny's 400.
var errNoKey = errors.New("no keyer named the client")

// rejection is the error for a request this handler refuses: the
// caddyhttp.HandlerError that caddyhttp.Error makes, so that handle_errors
// and the {http.error.*} placeholders see what they expect. Its ID and
// trace are filled in here, because caddyhttp.Error finds and formats its
// caller's file and line with runtime.Caller on every call: under a flood
// of denials that was the handler's largest cost (bench/README.md). The
// place is always this one, so the trace is a constant.
func rejection(status int, err error) error {
	return caddyhttp.Error(status, caddyhttp.HandlerError{StatusCode: status, Err: err, ID: errorID(), Trace: rejectionTrace})
}

const rejectionTrace = "ratelimit.rejection (module.go)"

// errorID is a random error ID in caddyhttp's own form, 9 characters from
// its 32-letter alphabet, from one random number.
func errorID() string {
	const alphabet = "abcdefghijkmnpqrstuvwxyz23456789"
	var id [9]byte
	n := rand.Uint64()
	for i := range id {
		id[i] = alphabet[n&31]
		n >>= 5
	}
	return string(id[:])
}

// ServeHTTP limits the request, then passes it on or rejects it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	d := &decision{handler: h, start: time.Now()}
	if h.UpstreamHeaders {
		// Later handlers trust these, so a client may not send its own.
		for _, name := range limitHeaderNames {
			delete(r.Header, name)
		}
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Map(d.placeholder)
	}

	keyer := h.fallback
	value := d.value[:0]
	for _, k := range h.keyers {
		if v, ok := k.Key(r, value); ok && len(v) > 0 {
			keyer, value = k, v
			break
		}
	}
	if keyer == h.fallback {
		value, _ = keyer.Key(r, value)
	}
	var claims Claims
	if h.JWT != nil {
		claims = h.JWT.claims(r)
	}
	d.claims = claims
	tier, err := h.tierFor(r, keyer.Kind(), claims)
	if err != nil {
		return err
	}
	d.tier = tier
	d.bucket = Bucket{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), Value: value}

	switch {
	case tier.Unlimited:
		d.decide(outcomeUnlimited)
		return next.ServeHTTP(w, r)
	case tier.Deny:
		d.decide(outcomeDenied)
		if ce := h.logger.Check(zapcore.DebugLevel, "client on a deny tier"); ce != nil {
			ce.Write(zap.String("policy", h.Name), zap.String("tier", tier.Name), zap.String("key_id", d.keyID()))
		}
		return rejection(http.StatusForbidden, errDenyTier)
	case h.noKeyDeny && keyer == h.fallback:
		return h.refuseNoKey(w, r, next, d)
	}

	began := time.Now()
	res, err := h.store.Take(r.Context(), &d.bucket, tier.limit, tier.cost)
	h.storeTime.Observe(time.Since(began).Seconds())
	if err != nil {
		h.storeErrors.Inc()
		return h.storeFailed(w, r, next, d, err)
	}
	return h.finish(w, r, next, d, res)
}

// refuseNoKey applies no_key deny: 400, and the body reaches nobody. The
// decision is counted and logged as a denial on the request's tier, with
// the client IP's key id, so that logs show who sends unkeyable requests.
func (h *Handler) refuseNoKey(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision) error {
	o, msg := outcomeDenied, "no keyer named the client"
	if h.DryRun {
		o, msg = outcomeDryRun, "no keyer named the client (dry run: let through)"
	}
	d.decide(o)
	if ce := h.logger.Check(zapcore.DebugLevel, msg); ce != nil {
		ce.Write(zap.String("policy", h.Name), zap.String("tier", d.tier.Name), zap.String("key_id", d.keyID()))
	}
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	return rejection(http.StatusBadRequest, errNoKey)
}

// finish sets the headers for the store's answer and passes the request on,
// or rejects it.
func (h *Handler) finish(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, res Result) error {
	d.result = res
	h.render(d)
	h.setHeaders(w.Header(), d)
	if res.Allowed {
		d.decide(outcomeAllowed)
	} else {
		w.Header()["Retry-After"] = d.retry[:]
		o, msg := outcomeDenied, "rate limited"
		if h.DryRun {
			o, msg = outcomeDryRun, "rate limited (dry run: let through)"
		}
		d.decide(o)
		if ce := h.logger.Check(zapcore.DebugLevel, msg); ce != nil {
			ce.Write(zap.String("policy", h.Name), zap.String("tier", d.tier.Name), zap.String("key_id", d.keyID()), zap.String("retry_after", d.retry[0]))
		}
		if !h.DryRun {
			return rejection(h.Status, errLimited)
		}
	}
	if h.UpstreamHeaders {
		h.setHeaders(r.Header, d)
	}
	return next.ServeHTTP(w, r)
}

// storeFailed applies on_store_error.
func (h *Handler) storeFailed(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, err error) error {
	h.storeLog.Warn("rate limit store failed", zap.String("policy", h.Name), zap.String("on_store_error", h.OnStoreError), zap.Error(err))
	switch h.OnStoreError {
	case "allow":
		d.decide(outcomeError)
		return next.ServeHTTP(w, r)
	case "deny":
		d.decide(outcomeError)
		w.Header()["Retry-After"] = []string{"1"}
		return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("rate limit store unavailable: %w", err))
	}
	res, _ := h.local.Take(r.Context(), &d.bucket, d.tier.limit, d.tier.cost)
	return h.finish(w, r, next, d, res)
}

// tierFor returns the first tier whose conditions hold.
func (h *Handler) tierFor(r *http.Request, keyerKind string, claims Claims) (*Tier, error) {
	for _, t := range h.Tiers {
		ok, err := t.applies(r, keyerKind, claims)
		if err != nil {
			return nil, caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("tier %q: %w", t.Name, err))
		}
		if ok {
			return t, nil
		}
	}
	// Unreachable: check guarantees a catch-all tier.
	return h.Tiers[len(h.Tiers)-1], nil
}

// setHeaders writes the limit headers chosen by Headers into hdr, which is
// the response's or, with upstream_headers, the request's.
func (h *Handler) setHeaders(hdr http.Header, d *decision) {
	t := d.tier
	if h.xHeaders {
		hdr["X-Ratelimit-Limit"] = t.limitHeader
		hdr["X-Ratelimit-Remaining"] = d.remaining[:]
		hdr["X-Ratelimit-Reset"] = d.reset[:]
	}
	if h.ietfHeaders {
		hdr["Ratelimit-Policy"] = t.policyHeader
		hdr["Ratelimit"] = d.ietf[:]
	}
}

// render writes the header values for the decision's result once, into the
// decision itself, so that headers cost no allocation of their own.
func (h *Handler) render(d *decision) {
	buf := d.text[:0]
	var at [3]int // where the x values and Retry-After end
	if h.xHeaders {
		buf = strconv.AppendInt(buf, d.result.Remaining, 10)
		at[0] = len(buf)
		buf = strconv.AppendInt(buf, d.resetEpoch(), 10)
		at[1] = len(buf)
	}
	if !d.result.Allowed {
		buf = strconv.AppendInt(buf, d.retryAfterSeconds(), 10)
	}
	at[2] = len(buf)
	if h.ietfHeaders {
		buf = append(buf, d.tier.quotedName...)
		buf = append(buf, ";r="...)
		buf = strconv.AppendInt(buf, d.result.Remaining, 10)
		buf = append(buf, ";t="...)
		buf = strconv.AppendInt(buf, secondsUp(d.result.ResetAfter), 10)
	}
	// The strings share the decision's memory, which nothing writes again,
	// and which the strings keep alive.
	text := unsafe.String(unsafe.SliceData(buf), len(buf))
	if h.xHeaders {
		d.remaining[0] = text[:at[0]]
		d.reset[0] = text[at[0]:at[1]]
	}
	d.retry[0] = text[at[1]:at[2]]
	if h.ietfHeaders {
		d.ietf[0] = text[at[2]:]
	}
}

// limitHeaderNames are the headers setHeaders may write, in canonical form.
var limitHeaderNames = []string{"X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset", "Ratelimit-Policy", "Ratelimit"}

// outcome is what the handler decided for a request.
type outcome uint8

const (
	outcomeAllowed outcome = iota
	outcomeDenied
	outcomeDryRun
	outcomeUnlimited
	outcomeError
	outcomeCount
)

// String is the outcome as the {http.rate_limit.decision} placeholder and
// the metrics' decision label show it.
func (o outcome) String() string {
	return [outcomeCount]string{"allowed", "denied", "dry_run", "unlimited", "error"}[o]
}

// decide records the outcome and counts it.
func (d *decision) decide(o outcome) {
	d.outcome = o
	d.tier.counters[o].Inc()
}

// decision is one request's passage through the handler. It answers the
// placeholders, lazily, for as long as the request's replacer lives.
type decision struct {
	handler *Handler
	start   time.Time
	tier    *Tier
	bucket  Bucket
	claims  Claims
	result  Result
	outcome outcome
	// value holds a short client value without another allocation.
	value [64]byte
	// The header values, rendered once into text.
	remaining, reset, retry, ietf [1]string
	text                          [96]byte
}

const placeholderPrefix = "http.rate_limit."

func (d *decision) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	if claim, ok := strings.CutPrefix(name, "claim."); ok {
		if d.claims == nil {
			return "", true
		}
		return strings.Join(d.claims.Claim(claim), ","), true
	}
	switch name {
	case "policy":
		return d.handler.Name, true
	case "decision":
		if d.tier == nil {
			return "", true
		}
		return d.outcome.String(), true
	}
	if d.tier == nil {
		return "", true
	}
	switch name {
	case "tier":
		return d.tier.Name, true
	case "key_id":
		return d.keyID(), true
	}
	if d.tier.Unlimited || d.tier.Deny || d.outcome == outcomeError && d.result == (Result{}) {
		return "", true
	}
	switch name {
	case "limit":
		return d.tier.limit.Capacity, true
	case "remaining":
		return d.result.Remaining, true
	case "reset":
		return d.resetEpoch(), true
	case "retry_after":
		if d.result.Allowed {
			return 0, true
		}
		return d.retryAfterSeconds(), true
	}
	return nil, false
}

// keyID is a fingerprint of the client's key, for logs: the first 8 bytes
// of SHA-256 over the keyer and the value. It is stable across nodes, so
// that logs can be joined, and never shows the value itself.
func (d *decision) keyID() string { return keyID(&d.bucket) }

func keyID(b *Bucket) string {
	sum := bucketDigest(b)
	return hex.EncodeToString(sum[:8])
}

// bucketDigest hashes the client part of a bucket's name: the keyer and the
// value. It is stable across processes, for stores shared by several nodes.
func bucketDigest(b *Bucket) [sha256.Size]byte {
	h := sha256.New()
	h.Write([]byte(b.Keyer))
	h.Write([]byte{0})
	h.Write(b.Value)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	return sum
}

// resetEpoch is the Unix second at which the bucket is full again.
func (d *decision) resetEpoch() int64 {
	return secondsUp(d.start.UnixMicro() + d.result.ResetAfter)
}

// retryAfterSeconds is Retry-After: whole seconds, at least 1.
func (d *decision) retryAfterSeconds() int64 {
	return max(1, secondsUp(d.result.RetryAfter))
}

func secondsUp(micros int64) int64 { return ceilDiv(micros, 1e6) }

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
