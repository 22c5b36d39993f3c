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
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
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

	// KeySecret, when set, keys the hash that turns a client's value into
	// its bucket's Redis key and its key_id (HMAC-SHA256). Without it they
	// are an unkeyed SHA-256: pseudonyms, which anyone can reverse for
	// values as few as the IPv4 addresses. At least 16 bytes; placeholders
	// such as {env.RATE_LIMIT_KEY_SECRET} are expanded at provision. Every
	// node sharing a Redis store needs the same secret.
	KeySecret string `json:"key_secret,omitempty"`

	keyers   []Keyer
	fallback *IPKeyer
	store    Store
	// local limits per node while the shared store fails, with on_store_error local.
	local       *LocalStore
	keySecret   []byte
	xHeaders    bool
	ietfHeaders bool
	logger      *zap.Logger
	storeLog    *zap.Logger
	storeTime   prometheus.Observer
	storeErrors prometheus.Counter
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
	if err := h.provisionKeySecret(); err != nil {
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
	if err := h.checkListeners(ctx); err != nil {
		return err
	}

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
	if h.KeySecret != "" && !strings.Contains(h.KeySecret, "{") && len(h.KeySecret) < minKeySecret {
		return fmt.Errorf("key_secret: the value given is %d bytes long; want at least %d", len(h.KeySecret), minKeySecret)
	}
	switch h.OnStoreError {
	case "local", "allow", "deny":
	default:
		return fmt.Errorf("on_store_error %q: want local, allow or deny", h.OnStoreError)
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

// minKeySecret is the shortest key_secret accepted, in bytes.
const minKeySecret = 16

// provisionKeySecret expands key_secret. Its value is never shown in an
// error: only what it was written as, when that is a placeholder.
func (h *Handler) provisionKeySecret() error {
	if h.KeySecret == "" {
		return nil
	}
	secret := caddy.NewReplacer().ReplaceKnown(h.KeySecret, "")
	if len(secret) < minKeySecret {
		shown := "the value given"
		if strings.Contains(h.KeySecret, "{") {
			shown = strconv.Quote(h.KeySecret)
		}
		return fmt.Errorf("key_secret: %s is %d bytes long; want at least %d", shown, len(secret), minKeySecret)
	}
	h.keySecret = []byte(secret)
	return nil
}

// checkListeners refuses a server that listens on a Unix socket without
// trusted_proxies_unix: every client there has the remote address "@" and
// no IP, so the client IP, which names any client no keyer names, would
// put them all in one bucket. With trusted_proxies_unix, Caddy reads the
// client IP from the proxy's headers.
func (h *Handler) checkListeners(ctx caddy.Context) error {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv.TrustedProxiesUnix {
		return nil
	}
	for _, ln := range srv.Listen {
		na, err := caddy.ParseNetworkAddress(ln)
		if err == nil && na.IsUnixNetwork() {
			return fmt.Errorf("policy %q: the server listens on the Unix socket %q, where clients have no IP address, so all would share one bucket: set the global server option trusted_proxies_unix (Caddy then reads the client IP from the proxy's headers)", h.Name, ln)
		}
	}
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
	d.claims = requestClaims{jwt: h.JWT, r: r}
	if h.UpstreamHeaders {
		// Later handlers trust these, so a client may not send its own.
		for _, name := range limitHeaderNames {
			delete(r.Header, name)
		}
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		repl.Map(d.placeholder)
	}

	var keyer Keyer = h.fallback
	value := d.value[:0]
	for _, k := range h.keyers {
		if v, ok := keyWith(k, r, value, &d.claims); ok && len(v) > 0 {
			keyer, value = k, v
			break
		}
	}
	if keyer == h.fallback {
		value = h.fallback.fallbackKey(r, value)
	}
	tier, err := h.tierFor(r, keyer.Kind(), &d.claims)
	if err != nil {
		return err
	}
	d.tier = tier
	d.bucket = Bucket{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), Value: value, secret: h.keySecret}

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

// finish sets the headers for the store's answer and passes the request on,
// or rejects it.
func (h *Handler) finish(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, res Result) error {
	d.result = res
	h.render(d)
	setHeaders(w.Header(), &d.resp)
	if res.Allowed {
		d.decide(outcomeAllowed)
	} else {
		if !h.DryRun {
			w.Header()["Retry-After"] = d.retry[:]
		}
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
		d.upstream = d.resp
		setHeaders(r.Header, &d.upstream)
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

// headerValues are the limit headers of one response, or of one request
// with upstream_headers. Each message owns its slices, because a later
// handler (a deferred `header` replace) may edit them in place; the strings
// themselves are immutable and may be shared. A nil entry is not sent.
type headerValues struct {
	limit, remaining, reset, policy, ietf [1]string
	x, ietfOn                             bool
}

// setHeaders writes the limit headers into hdr: the response's or, with
// upstream_headers, the request's.
func setHeaders(hdr http.Header, v *headerValues) {
	if v.x {
		hdr["X-Ratelimit-Limit"] = v.limit[:]
		hdr["X-Ratelimit-Remaining"] = v.remaining[:]
		hdr["X-Ratelimit-Reset"] = v.reset[:]
	}
	if v.ietfOn {
		hdr["Ratelimit-Policy"] = v.policy[:]
		hdr["Ratelimit"] = v.ietf[:]
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
	v := &d.resp
	v.x, v.ietfOn = h.xHeaders, h.ietfHeaders
	if h.xHeaders {
		v.limit[0] = d.tier.limitText
		v.remaining[0] = text[:at[0]]
		v.reset[0] = text[at[0]:at[1]]
	}
	d.retry[0] = text[at[1]:at[2]]
	if h.ietfHeaders {
		v.policy[0] = d.tier.policyText
		v.ietf[0] = text[at[2]:]
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
	claims  requestClaims
	result  Result
	outcome outcome
	// value holds a short client value without another allocation.
	value [64]byte
	// The header values, rendered once into text: the response's, and a
	// copy for the request with upstream_headers.
	resp, upstream headerValues
	retry          [1]string
	text           [96]byte
}

const placeholderPrefix = "http.rate_limit."

func (d *decision) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	if claim, ok := strings.CutPrefix(name, "claim."); ok {
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
// of the bucket's digest. It is stable across nodes, so that logs can be
// joined, and never shows the value itself.
func (d *decision) keyID() string { return keyID(&d.bucket) }

func keyID(b *Bucket) string {
	sum := bucketDigest(b)
	return hex.EncodeToString(sum[:8])
}

// bucketDigest hashes the client part of a bucket's name: the keyer and the
// value, with HMAC-SHA256 under key_secret when there is one, else plain
// SHA-256. It is stable across processes, for stores shared by several
// nodes.
func bucketDigest(b *Bucket) [sha256.Size]byte {
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
