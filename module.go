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
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
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
//
// The handler sets these placeholders, for logs, `header`, `respond` and
// `handle_errors`:
//
// Placeholder | Description
// ------------|-------------
// `{http.rate_limit.policy}` | the policy's name
// `{http.rate_limit.tier}` | the tier that applied
// `{http.rate_limit.decision}` | allowed, denied, dry_run, unlimited or error
// `{http.rate_limit.limit}` | the capacity of the binding limit (the one with the least remaining)
// `{http.rate_limit.remaining}` | the whole tokens left
// `{http.rate_limit.reset}` | the Unix second at which the bucket is full again
// `{http.rate_limit.retry_after}` | the seconds to wait, when denied; 0 otherwise
// `{http.rate_limit.waited}` | the milliseconds the request waited for its tokens (max_wait); 0 when it did not
// `{http.rate_limit.key_id}` | a fingerprint of the client's key, never the key itself
// `{http.rate_limit.claim.*}` | a claim of the verified JWT, such as `{http.rate_limit.claim.sub}`
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

	// OnStoreErrorShare, with on_store_error local beside a shared store,
	// scales what this node enforces alone while the store fails: each
	// limit's capacity and refill, each quota and concurrency, rounded
	// down, at least 1 (and at least the tier's cost). A fraction such as
	// "1/6" or a decimal such as "0.25", above 0 and at most 1: "1/<nodes>"
	// keeps a node cut off from the store to its part of the fleet's
	// limit. Headers on its decisions report the scaled limit, which is
	// what it enforces. Default: the whole limit.
	OnStoreErrorShare string `json:"on_store_error_share,omitempty"`

	// OnStoreErrorReconcile, with on_store_error local beside a shared
	// store, charges each shared bucket, as soon as a call to the store
	// succeeds again, what this node admitted alone in it (taken minus
	// given back), in the background, as cost_from_response does: the
	// bucket may go into debt, and a ban the charge meets holds. Tokens
	// spent from a lease are not charged again. The counts of buckets
	// beyond the fallback's max keys, and those a reload or shutdown
	// cannot charge within the store's timeout, are lost: counted in
	// caddy_http_rate_limit_reconcile_lost_tokens_total and logged
	// (docs/fleet.md).
	OnStoreErrorReconcile bool `json:"on_store_error_reconcile,omitempty"`

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

	// CountStatus, when set, keeps a request's tokens taken only when its
	// response has one of these statuses: codes such as "401", or classes
	// such as "4xx". Tokens are taken before the request goes on, as
	// always, and given back after any other response, so that a login
	// form limits failed attempts only.
	CountStatus []string `json:"count_status,omitempty"`

	// Ban, when set, holds a client's bucket empty for this long from a
	// denial that one bucket would give, in the shared store too (with
	// leases, a refusal caused only by tokens on other nodes' leases bans
	// nobody: docs/fleet.md). Denials during the ban do not extend it;
	// when it ends, the bucket refills from empty.
	Ban caddy.Duration `json:"ban,omitempty"`

	// MaxWait, when set, lets a request whose tokens are due within it wait
	// for them instead of being refused: it takes them at once, waits
	// until they are due, then goes on, so that a burst reaches the origin
	// at the limit's pace. One that would wait longer is refused at once,
	// taking nothing, with Retry-After the seconds until it would fit. A
	// waiter whose client goes away gives its tokens back. A tier may set
	// its own. nginx's `limit_req burst=<C + max_wait*rate - 1>
	// delay=<C - 1>` (nginx does not count a burst's first request).
	MaxWait caddy.Duration `json:"max_wait,omitempty"`

	// Timezone is the IANA time zone in which the tiers' quotas count
	// their days, weeks, months and years, such as Europe/Berlin.
	// Default UTC.
	Timezone string `json:"timezone,omitempty"`

	// MaxWaiting bounds the requests of this policy that wait at once on
	// this node (max_wait); one more is refused at once. Default 10000.
	MaxWaiting int `json:"max_waiting,omitempty"`

	// NoKey says what happens when no keyer names the client: "ip" keys it
	// by its IP address; "deny" answers 400 and the request goes no
	// further, so that a client cannot leave the per-user bucket by sending
	// a body the body keyers cannot read. "deny" needs at least one keyer.
	// Default "ip".
	NoKey string `json:"no_key,omitempty"`

	// clocks are what the local buckets and the record of denials read:
	// the system's unless a test hands the handler its own before Provision.
	clocks   clocks
	keyers   []Keyer
	fallback *IPKeyer
	store    store
	// local limits per node while the shared store fails, with on_store_error local.
	local *LocalStore
	// share scales the tiers local enforces (Tier.fallback), and owed
	// counts what local admitted, to charge the store with once it
	// answers again (on_store_error local reconcile; nil without).
	share share
	owed  *reconciler
	// owedMax bounds owed's buckets; 0 is the fallback's max keys. Tests set it.
	owedMax     int
	keySecret   string
	xHeaders    bool
	ietfHeaders bool
	logger      *zap.Logger
	storeLog    *zap.Logger
	storeTime   prometheus.Observer
	storeErrors prometheus.Counter

	// checked says that Provision has checked the settings and applied
	// what they imply (Validate).
	checked bool
	// noKeyDeny is NoKey == "deny".
	noKeyDeny bool
	// counted is CountStatus as a set; nil counts every response.
	counted *statusSet
	// denials is the policy's record of its denials on this node, which
	// notes feeds off the request path.
	denials *denials
	notes   *denialNotes
	// waiting counts the policy's waiting requests on this node, up to
	// maxWaiting.
	waiting    *atomic.Int64
	maxWaiting int
	// loadKey names the config load the handler is part of, unnamed says
	// that the config gave it no name, and where is its server's
	// listeners (registry.go).
	loadKey *prometheus.Registry
	unnamed bool
	where   string
	// written is the handler's config as JSON, and server the server it
	// runs in, which tell copies of one handler from two.
	written []byte
	server  *caddyhttp.Server
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets the handler up: it applies the defaults, checks the
// settings and applies what they imply (check, once a load), then loads
// the keyers, the tiers' matchers and the store, and joins the running
// handlers of its policy (registry.go).
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	// Store trouble can come with every request; a few lines a second say it.
	h.storeLog = h.logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 3, 0)
	}))
	unnamed := h.Name == ""
	h.clocks = h.clocks.or()
	h.applyDefaults()
	v, err := h.check()
	if err != nil {
		return err
	}
	h.apply(v)
	h.checked = true
	if err := h.provisionKeySecret(); err != nil {
		return err
	}
	if h.JWT != nil {
		if err := h.JWT.provision(ctx); err != nil {
			return err
		}
	}

	if err := h.provisionKeyers(ctx); err != nil {
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
		t.prefixes = h.keyerPrefixes(t)
		if len(t.Claims) > 0 && h.JWT == nil {
			return fmt.Errorf("tier %q: a claim condition needs a jwt block to verify tokens", t.Name)
		}
	}

	if err := h.provisionStore(ctx); err != nil {
		return err
	}
	if lw, ok := h.store.(leaseWarner); ok {
		lw.warnLeaseCaps(h.logger, h.Tiers)
	}
	if w, ok := h.store.(roundTripWatcher); ok {
		w.watchRoundTrip(h.logger, h.Tiers)
	}
	h.denials = denialsFor(h.Name)
	h.provisionWait()
	if err := h.scaleForFallback(); err != nil {
		return err
	}
	if err := h.joinConfig(ctx, unnamed); err != nil {
		return err
	}
	h.shareRoundTrip()
	// The http app loads the events app before its handlers; outside a
	// server (tests that provision a handler alone) there is none.
	var events *caddyevents.App
	if app, err := ctx.AppIfConfigured("events"); err == nil {
		events = app.(*caddyevents.App)
	}
	h.notes = startNoting(h.Name, h.denials, h.logger, events, ctx, h.clocks.now)
	h.register()
	return nil
}

// provisionKeyers loads the keyers, hands the jwt block to those that read
// verified claims, and sets up the client IP keyer that names any client
// no keyer names.
func (h *Handler) provisionKeyers(ctx caddy.Context) error {
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
	return h.checkListeners(ctx)
}

// keyerPrefixes are the local store's hashes of t's bucket names for each
// of the handler's keyers and then its fallback (Tier.prefixes), so that a
// request hashes only its client's value.
func (h *Handler) keyerPrefixes(t *Tier) []uint64 {
	ps := make([]uint64, 0, len(h.keyers)+1)
	for _, k := range h.keyers {
		ps = append(ps, bucketIDs.Prefix(h.Name, t.Name, k.ID()))
	}
	return append(ps, bucketIDs.Prefix(h.Name, t.Name, h.fallback.ID()))
}

// provisionStore loads the store (local by default), binds it to the
// policy, and, with on_store_error local beside a shared store, sets up
// this node's own fallback buckets.
func (h *Handler) provisionStore(ctx caddy.Context) error {
	if h.StoreRaw == nil {
		h.StoreRaw = json.RawMessage(`{"store":"local"}`)
	}
	mod, err := ctx.LoadModule(h, "StoreRaw")
	if err != nil {
		return fmt.Errorf("loading store: %v", err)
	}
	s, ok := mod.(store)
	if !ok {
		return fmt.Errorf("store %s: not a rate limit store", caddy.GetModuleName(mod))
	}
	h.store = s
	storeName := caddy.GetModuleName(mod)
	if _, inMemory := s.(*LocalStore); !inMemory {
		// The local store decides in well under the histogram's lowest
		// bucket (10 µs): timing it would cost each decision a second
		// clock read and say nothing requests_total does not.
		h.storeTime = storeDuration.WithLabelValues(storeName)
	}
	h.storeErrors = storeErrorsTotal.WithLabelValues(storeName)
	ps, local := h.store.(policyStore)
	if local {
		if err := ps.bind(h.Name, h.clocks); err != nil {
			return err
		}
	}
	if !local && h.OnStoreError == "local" {
		var err error
		if h.local, err = localFallback(ctx, h.Name, h.clocks); err != nil {
			return err
		}
		return h.provisionFallback(ctx)
	}
	return nil
}

// applyDefaults fills in what the config leaves out. Provision does it,
// never check, so that `caddy adapt` shows only what was written.
func (h *Handler) applyDefaults() {
	h.Name = cmp.Or(h.Name, "default")
	h.OnStoreError = cmp.Or(h.OnStoreError, "local")
	h.Headers = cmp.Or(h.Headers, "x")
	h.Status = cmp.Or(h.Status, http.StatusTooManyRequests)
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
	h.keySecret = secret
	return nil
}

// checkListeners refuses a server that listens on a Unix socket without
// trusted_proxies_unix: every client there has the remote address "@" and
// no IP, so the client IP, which names any client no keyer names, would
// put them all in one bucket. With trusted_proxies_unix, Caddy reads the
// client IP from the proxy's headers.
func (h *Handler) checkListeners(ctx caddy.Context) error {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv.TrustedProxiesUnix || h.noKeyDeny {
		return nil
	}
	for _, ln := range srv.Listen {
		na, err := caddy.ParseNetworkAddress(ln)
		if err == nil && na.IsUnixNetwork() {
			return fmt.Errorf("policy %q: the server listens on the Unix socket %q, where clients have no IP address, so all would share one bucket: set the global server option trusted_proxies_unix (Caddy then reads the client IP from the proxy's headers), or no_key deny with a key that names every client", h.Name, ln)
		}
	}
	return nil
}

// provisionWait sets up the waiting bound (max_waiting); the tiers' wait
// and in-flight metrics are looked up here, not per request.
func (h *Handler) provisionWait() {
	h.maxWaiting = cmp.Or(h.MaxWaiting, defaultMaxWaiting)
	h.waiting = waitersFor(h.Name)
	for _, t := range h.Tiers {
		t.waitTime = waitSeconds.WithLabelValues(h.Name, t.Name)
		t.inFlight = inFlightGauge.WithLabelValues(h.Name, t.Name)
	}
}

// Validate checks the handler's settings, and changes none. Caddy calls it
// after Provision, which has run the same check (and worked out what the
// settings imply) before it loaded the keyers, the matchers and the store,
// whose JSON Caddy then drops: a provisioned handler passed it once.
func (h *Handler) Validate() error {
	if h.checked {
		return nil
	}
	_, err := h.check()
	return err
}

// settings is what a handler's settings imply, worked out by check and
// applied once, at provision.
type settings struct {
	xHeaders, ietfHeaders, noKeyDeny bool
	// counted is CountStatus as a set; nil counts every response.
	counted *statusSet
	// share is on_store_error local's share.
	share share
	// tiers are each tier's, in the order of Tiers.
	tiers []tierSettings
}

// check checks what needs no Caddy context, and works out what the
// settings imply, changing none: the Caddyfile adapter runs it too, so
// that mistakes fail `caddy adapt`, and the adapted config shows only
// what was written.
func (h *Handler) check() (settings, error) {
	var v settings
	var err error
	policy := cmp.Or(h.Name, "default")
	onStoreError := cmp.Or(h.OnStoreError, "local")
	headers := cmp.Or(h.Headers, "x")
	status := cmp.Or(h.Status, http.StatusTooManyRequests)
	if h.KeySecret != "" && !strings.Contains(h.KeySecret, "{") && len(h.KeySecret) < minKeySecret {
		return v, fmt.Errorf("key_secret: the value given is %d bytes long; want at least %d", len(h.KeySecret), minKeySecret)
	}
	switch onStoreError {
	case "local", "allow", "deny":
	default:
		return v, fmt.Errorf("on_store_error %q: want local, allow or deny", h.OnStoreError)
	}
	if v.share, err = h.checkFallback(onStoreError); err != nil {
		return v, err
	}
	if err := h.checkNoKey(); err != nil {
		return v, err
	}
	v.noKeyDeny = h.NoKey == "deny"
	counted, ban, err := checkLogin(h.CountStatus, h.Ban)
	if err != nil {
		return v, err
	}
	v.counted = counted
	if err := checkWait(h.MaxWait, h.MaxWaiting, h.Tiers); err != nil {
		return v, err
	}
	loc, err := checkTimezone(h.Timezone)
	if err != nil {
		return v, err
	}
	switch headers {
	case "x", "ietf", "both", "none":
	default:
		return v, fmt.Errorf("headers %q: want x, ietf, both or none", h.Headers)
	}
	v.xHeaders = headers == "x" || headers == "both"
	v.ietfHeaders = headers == "ietf" || headers == "both"
	if status < 400 || status > 599 {
		return v, fmt.Errorf("status %d: want a 4xx or 5xx code", h.Status)
	}
	if len(h.Tiers) == 0 {
		return v, fmt.Errorf("policy %q: no tier: give a capacity and refill, such as `rate_limit 100 10/s`", policy)
	}
	seen := make(map[string]bool, len(h.Tiers))
	for i, t := range h.Tiers {
		maxWait := time.Duration(cmp.Or(t.MaxWait, h.MaxWait)).Microseconds()
		ts, err := t.check(tierContext{ban: ban, maxWait: maxWait, loc: loc})
		if err != nil {
			return v, err
		}
		if err := v.share.scaledLimits(ts, t.CostPlaceholder); err != nil {
			return v, fmt.Errorf("tier %q: %w", t.Name, err)
		}
		v.tiers = append(v.tiers, ts)
		if seen[t.Name] {
			return v, fmt.Errorf("tier %q is defined twice", t.Name)
		}
		seen[t.Name] = true
		if t.catchAll() && i < len(h.Tiers)-1 {
			return v, fmt.Errorf("tier %q has no conditions, so the tiers after it would never apply", t.Name)
		}
	}
	if err := checkCredit(h.StoreRaw, h.Tiers); err != nil {
		return v, err
	}
	if last := h.Tiers[len(h.Tiers)-1]; !last.catchAll() {
		return v, fmt.Errorf("policy %q: no catch-all tier: every tier has a condition, so some requests would have none; add a capacity and refill to the rate_limit line, such as `rate_limit 100 10/s`", policy)
	}
	return v, nil
}

// checkNoKey checks no_key. Its default is left unwritten, so that the
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
	return nil
}

// apply sets the handler and its tiers up as their settings imply.
func (h *Handler) apply(v settings) {
	h.xHeaders, h.ietfHeaders, h.noKeyDeny, h.counted = v.xHeaders, v.ietfHeaders, v.noKeyDeny, v.counted
	h.share = v.share
	for i, t := range h.Tiers {
		t.apply(v.tiers[i])
	}
}

// Cleanup takes the handler out of the running ones, ends its denial
// recorder, charges what reconcile still counts (within the store's
// timeout) and releases the on_store_error store. Caddy cleans up the
// store itself, as a module it loaded for the handler.
func (h *Handler) Cleanup() error {
	h.unregister()
	h.leaveConfig()
	h.notes.end()
	if h.owed != nil {
		h.owed.drain()
	}
	if h.local != nil {
		return h.local.Cleanup()
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
