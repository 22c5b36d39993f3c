package ratelimit

import (
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.Before, "basic_auth")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(Handler)
	err := rl.UnmarshalCaddyfile(h.Dispenser)
	return rl, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens:
//
//	rate_limit [<matcher>] [<capacity> <refill>] {
//	    name <policy>
//	    key ip [<v4 prefix> [<v6 prefix>]]
//	    key header <field>
//	    key cookie <name>
//	    key jwt <claim>
//	    key form <field>
//	    key json <dot.path>
//	    key placeholder <string>
//	    jwt {
//	        from header <field> | cookie <name> | query <param>
//	        secret <hmac secret>
//	        public_key <pem file>
//	        jwks <file or https url>
//	        jwks_refresh <duration>
//	        algorithms <alg...>
//	        issuer <iss>
//	        audience <aud>
//	        leeway <duration>
//	    }
//	    tier <name> [<capacity> <refill>] {
//	        capacity <n>
//	        refill <amount>/<duration>
//	        cost <n> | <placeholder>
//	        limit <capacity> <refill>
//	        cost_from_response <field>
//	        max_wait <duration>
//	        concurrency <n>
//	        quota <n>/<day|week|month|year>
//	        match { <request matchers> }
//	        claim <claim> <value...>
//	        keyer ip|header|cookie|jwt|form|json|placeholder
//	        unlimited
//	        deny
//	    }
//	    store local|redis { ... }
//	    on_store_error local [<share>] [reconcile] | allow | deny
//	    headers x|ietf|both|none
//	    upstream_headers
//	    status <code>
//	    dry_run
//	    key_secret <secret>
//	    no_key ip|deny
//	    limit <capacity> <refill>
//	    cost <n> | <placeholder>
//	    cost_from_response <field>
//	    quota <n>/<day|week|month|year>
//	    concurrency <n>
//	    count_status <code|class...>
//	    ban <duration>
//	    max_wait <duration>
//	    max_waiting <n>
//	    timezone <IANA zone>
//	}
//
// The capacity and refill on the first line make the catch-all tier
// "default", tried after every tier block; the block's limit, cost,
// cost_from_response, quota and concurrency lines are that tier's too, as
// in a tier block. Values are checked here as well as at provision, so
// that a mistake fails `caddy adapt`.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // rate_limit
	var catchAll *Tier
	switch args := d.RemainingArgs(); len(args) {
	case 0:
	case 2:
		catchAll = &Tier{Name: "default"}
		if err := parseShape(d, catchAll, args); err != nil {
			return err
		}
	default:
		return d.Errf("rate_limit: want <capacity> <refill> on the first line, such as `rate_limit 100 10/s`; got %d values", len(args))
	}

	seen := make(map[string]bool)
	for d.NextBlock(0) {
		if err := once(d, seen, "name", "on_store_error", "headers", "upstream_headers", "dry_run", "status", "key_secret", "no_key", "count_status", "ban", "max_wait", "max_waiting", "timezone"); err != nil {
			return err
		}
		if err := h.parseSetting(d, seen, &catchAll); err != nil {
			return err
		}
	}

	if catchAll != nil {
		h.Tiers = append(h.Tiers, catchAll)
	}
	if _, err := h.check(); err != nil {
		return d.Errf("rate_limit: %v", err)
	}
	return nil
}

// parseSetting reads one subdirective of the rate_limit block. A line of
// a tier's own limits (limitLines) is the catch-all tier's, made on first
// use, and read as a tier block reads it.
func (h *Handler) parseSetting(d *caddyfile.Dispenser, seen map[string]bool, catchAll **Tier) error {
	if slices.Contains(limitLines, d.Val()) {
		if *catchAll == nil {
			*catchAll = &Tier{Name: "default"}
		}
		return parseLimitLine(d, seen, *catchAll)
	}
	var err error
	switch sub := d.Val(); sub {
	case "name":
		err = oneArg(d, &h.Name)
	case "key":
		err = h.parseKey(d)
	case "tier":
		err = h.parseTier(d)
	case "store":
		err = h.parseStore(d)
	case "on_store_error":
		err = h.parseOnStoreError(d)
	case "headers":
		err = oneArg(d, &h.Headers)
	case "upstream_headers":
		err = flag(d, &h.UpstreamHeaders)
	case "dry_run":
		err = flag(d, &h.DryRun)
	case "key_secret":
		err = oneArg(d, &h.KeySecret)
	case "no_key":
		err = oneArg(d, &h.NoKey)
	case "count_status":
		if h.CountStatus = d.RemainingArgs(); len(h.CountStatus) == 0 {
			return d.Err("count_status: want one or more status codes or classes, such as 401 or 4xx")
		}
		if _, err := parseStatusSet(h.CountStatus); err != nil {
			return d.Err(err.Error())
		}
	case "ban":
		err = positiveDuration(d, &h.Ban)
	case "max_wait":
		err = positiveDuration(d, &h.MaxWait)
	case "timezone":
		err = oneArg(d, &h.Timezone)
	case "max_waiting":
		var n int64
		if n, err = intArg(d); err == nil && n < 1 {
			err = d.Errf("max_waiting %d: must be at least 1", n)
		}
		h.MaxWaiting = int(n)
	case "status":
		var n int64
		if n, err = intArg(d); err == nil {
			h.Status = int(n)
		}
	case "jwt":
		err = parseJWT(h, d)
	default:
		return d.Errf("rate_limit: unknown subdirective %q", sub)
	}
	return err
}

// parseShape reads `<capacity> <refill>` into t.
func parseShape(d *caddyfile.Dispenser, t *Tier, args []string) error {
	n, err := strconv.ParseInt(args[0], 10, 64)
	if err != nil {
		return d.Errf("capacity %q: want a whole number of tokens", args[0])
	}
	t.Capacity = n
	t.Refill = args[1]
	if _, err := bucket.ParseRate(t.Refill); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// parseKey reads `key <kind> <args...>` into a keyer module.
func (h *Handler) parseKey(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Err("key: want a keyer: ip, header, cookie, jwt, form, json or placeholder")
	}
	kind := d.Val()
	raw, err := unmarshalGuest(d, keyerModulePrefix, "keyer", kind)
	if err != nil {
		return err
	}
	h.KeyersRaw = append(h.KeyersRaw, raw)
	return nil
}

// parseStore reads `store <name> { ... }` into a store module.
func (h *Handler) parseStore(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Err("store: want local or redis")
	}
	if h.StoreRaw != nil {
		return d.Err("store: given twice")
	}
	raw, err := unmarshalGuest(d, "http.handlers.rate_limit.stores.", "store", d.Val())
	if err != nil {
		return err
	}
	h.StoreRaw = raw
	return nil
}

// unmarshalGuest hands the tokens from the current one (the module's name)
// to the end of its segment to the guest module's Caddyfile unmarshaler,
// and returns its JSON with inlineKey naming the module.
func unmarshalGuest(d *caddyfile.Dispenser, namespace, inlineKey, name string) (json.RawMessage, error) {
	mod, err := caddy.GetModule(namespace + name)
	if err != nil {
		return nil, d.Errf("%s %q: unknown: %v", inlineKey, name, err)
	}
	unm, ok := mod.New().(caddyfile.Unmarshaler)
	if !ok {
		return nil, d.Errf("%s %q: cannot be set up from a Caddyfile", inlineKey, name)
	}
	if err := unm.UnmarshalCaddyfile(d.NewFromNextSegment()); err != nil {
		return nil, err
	}
	var warnings []caddyconfig.Warning
	raw := caddyconfig.JSONModuleObject(unm, inlineKey, name, &warnings)
	if len(warnings) > 0 {
		return nil, d.Errf("%s %q: %s", inlineKey, name, warnings[0].Message)
	}
	return raw, nil
}

// parseTier reads a tier block.
func (h *Handler) parseTier(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) != 1 && len(args) != 3 {
		return d.Err("tier: want <name> [<capacity> <refill>]")
	}
	t := &Tier{Name: args[0]}
	if len(args) == 3 {
		if err := parseShape(d, t, args[1:]); err != nil {
			return err
		}
	}
	seen := make(map[string]bool)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := once(d, seen, "capacity", "refill", "keyer", "unlimited", "deny", "max_wait"); err != nil {
			return err
		}
		if slices.Contains(limitLines, d.Val()) {
			if err := parseLimitLine(d, seen, t); err != nil {
				return err
			}
			continue
		}
		var err error
		switch sub := d.Val(); sub {
		case "capacity":
			t.Capacity, err = intArg(d)
		case "refill":
			err = oneArg(d, &t.Refill)
		case "max_wait":
			err = positiveDuration(d, &t.MaxWait)
		case "keyer":
			err = oneArg(d, &t.Keyer)
		case "unlimited":
			err = flag(d, &t.Unlimited)
		case "deny":
			err = flag(d, &t.Deny)
		case "match":
			var set caddy.ModuleMap
			file, line := d.File(), d.Line()
			if set, err = caddyhttp.ParseCaddyfileNestedMatcherSet(d); err == nil {
				if len(set) == 0 {
					return fmt.Errorf("tier %q: match: an empty block would match every request; give a matcher, or drop the block, at %s:%d", t.Name, file, line)
				}
				t.MatcherSetsRaw = append(t.MatcherSetsRaw, set)
			}
		case "claim":
			vals := d.RemainingArgs()
			if len(vals) < 2 {
				return d.Err("claim: want <claim> <value...>")
			}
			if t.Claims == nil {
				t.Claims = make(map[string][]string)
			}
			t.Claims[vals[0]] = append(t.Claims[vals[0]], vals[1:]...)
		default:
			return d.Errf("tier %q: unknown subdirective %q", t.Name, sub)
		}
		if err != nil {
			return err
		}
	}
	if _, err := t.check(tierContext{}); err != nil {
		return d.Err(err.Error())
	}
	h.Tiers = append(h.Tiers, t)
	return nil
}

// limitLines are the lines of a tier's own limits: a tier block takes
// them, and the rate_limit block for its catch-all tier.
var limitLines = []string{"limit", "cost", "cost_from_response", "quota", "concurrency"}

// parseLimitLine reads one of limitLines into t. Seen is the block's: a
// line that may be given once fails the second time.
func parseLimitLine(d *caddyfile.Dispenser, seen map[string]bool, t *Tier) error {
	if err := once(d, seen, "cost", "cost_from_response", "concurrency"); err != nil {
		return err
	}
	var err error
	switch sub := d.Val(); sub {
	case "limit":
		err = parseLimit(d, &t.Limits)
	case "cost":
		err = parseCost(d, t)
	case "cost_from_response":
		err = oneArg(d, &t.CostFromResponse)
	case "quota":
		var q string
		if err = oneArg(d, &q); err == nil {
			if _, err = bucket.ParseQuota(q, nil); err != nil {
				err = d.Err(err.Error())
			}
			t.Quotas = append(t.Quotas, q)
		}
	case "concurrency":
		if t.Concurrency, err = intArg(d); err == nil && t.Concurrency < 1 {
			err = d.Errf("concurrency %d: must be at least 1", t.Concurrency)
		}
	}
	return err
}

// parseLimit reads `limit <capacity> <refill>` onto limits.
func parseLimit(d *caddyfile.Dispenser, limits *[]TierLimit) error {
	args := d.RemainingArgs()
	if len(args) != 2 {
		return d.Err("limit: want <capacity> <refill>, such as `limit 10000 10000/24h`")
	}
	var t Tier
	if err := parseShape(d, &t, args); err != nil {
		return err
	}
	if t.Capacity < 1 {
		return d.Errf("limit: capacity %d: must be at least 1", t.Capacity)
	}
	*limits = append(*limits, TierLimit{Capacity: t.Capacity, Refill: t.Refill})
	return nil
}

// parseCost reads `cost <n>` or `cost <placeholder>`.
func parseCost(d *caddyfile.Dispenser, t *Tier) error {
	var s string
	if err := oneArg(d, &s); err != nil {
		return err
	}
	if strings.Contains(s, "{") {
		t.CostPlaceholder = s
		return nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return d.Errf("cost %q: want a whole number, or a placeholder such as {http.request.header.X-Batch}", s)
	}
	// In the JSON, cost 0 is no cost given, which means 1: a 0 written here
	// must not silently become 1.
	if n < 1 {
		return d.Errf("cost %d: must be at least 1; use a placeholder for per-request costs, which may be 0", n)
	}
	t.Cost = n
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)

// parseJWT reads the jwt block:
//
//	jwt {
//	    from header <field> | cookie <name> | query <param>
//	    secret <hmac secret>
//	    public_key <pem file>
//	    jwks <file or https url>
//	    jwks_refresh <duration>
//	    algorithms <alg...>
//	    issuer <iss>
//	    audience <aud>
//	    leeway <duration>
//	    require <claim...>
//	}
func parseJWT(h *Handler, d *caddyfile.Dispenser) error {
	seg := d.NewFromNextSegment()
	seg.Next() // jwt
	if h.JWT != nil {
		return seg.Err("jwt: given twice")
	}
	if seg.NextArg() {
		return seg.Errf("jwt: takes a block, not %q", seg.Val())
	}
	j := new(JWTConfig)
	for seg.NextBlock(0) {
		var err error
		switch sub := seg.Val(); sub {
		case "from":
			var where, name string
			if !seg.AllArgs(&where, &name) {
				return seg.Err("jwt from: want header <field>, cookie <name> or query <param>")
			}
			switch where {
			case "header":
				j.FromHeader = name
			case "cookie":
				j.FromCookie = name
			case "query":
				j.FromQuery = name
			default:
				return seg.Errf("jwt from %q: want header, cookie or query", where)
			}
		case "secret":
			err = oneArg(seg, &j.Secret)
		case "public_key":
			err = oneArg(seg, &j.PublicKey)
		case "jwks":
			err = oneArg(seg, &j.JWKS)
		case "jwks_refresh":
			err = durationArg(seg, &j.JWKSRefresh)
		case "algorithms":
			j.Algorithms = append(j.Algorithms, seg.RemainingArgs()...)
			if len(j.Algorithms) == 0 {
				return seg.Err("jwt algorithms: want one or more, such as RS256")
			}
		case "issuer":
			err = oneArg(seg, &j.Issuer)
		case "audience":
			err = oneArg(seg, &j.Audience)
		case "leeway":
			err = durationArg(seg, &j.Leeway)
		case "require":
			names := seg.RemainingArgs()
			if len(names) == 0 {
				return seg.Err("jwt require: want one or more claims, such as exp")
			}
			j.Require = append(j.Require, names...)
		default:
			return seg.Errf("jwt: unknown subdirective %q", sub)
		}
		if err != nil {
			return err
		}
	}
	if err := j.validate(); err != nil {
		seg.Reset()
		seg.Next()
		return seg.Err(err.Error())
	}
	h.JWT = j
	return nil
}

// The argument helpers every Caddyfile block shares: each reads one
// subdirective's arguments, and names it and its value in any error.

// once fails when the current subdirective is one of single and was seen
// before in this block: the later value would silently win.
func once(d *caddyfile.Dispenser, seen map[string]bool, single ...string) error {
	sub := d.Val()
	for _, name := range single {
		if name == sub {
			if seen[sub] {
				return d.Errf("%s: given twice in one block; give it once", sub)
			}
			seen[sub] = true
		}
	}
	return nil
}

// oneArg reads exactly one argument into s.
func oneArg(d *caddyfile.Dispenser, s *string) error {
	name := d.Val()
	if !d.AllArgs(s) {
		return d.Errf("%s: want exactly one value", name)
	}
	return nil
}

// flag reads a subdirective that takes no argument.
func flag(d *caddyfile.Dispenser, b *bool) error {
	name := d.Val()
	if d.NextArg() {
		return d.Errf("%s takes no value; got %q", name, d.Val())
	}
	*b = true
	return nil
}

// intArg reads exactly one whole-number argument.
func intArg(d *caddyfile.Dispenser) (int64, error) {
	name := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return 0, d.Errf("%s: want exactly one number", name)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, d.Errf("%s %q: want a whole number", name, s)
	}
	return n, nil
}

// intBetween reads a subdirective's one whole number, which must lie in
// [lo, hi], into v.
func intBetween(d *caddyfile.Dispenser, lo, hi int64, v *int) error {
	name := d.Val()
	n, err := intArg(d)
	if err != nil {
		return err
	}
	if n < lo || n > hi {
		return d.Errf("%s %d: want %d to %d", name, n, lo, hi)
	}
	*v = int(n)
	return nil
}

// durationArg reads exactly one duration argument.
func durationArg(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return d.Errf("%s: want exactly one duration", name)
	}
	v, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("%s %q: want a duration such as 30s", name, s)
	}
	if v < 0 {
		return d.Errf("%s %q: must not be negative", name, s)
	}
	*dur = caddy.Duration(v)
	return nil
}

// positiveDuration reads a subdirective's one duration, which must be
// above zero.
func positiveDuration(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	if err := durationArg(d, dur); err != nil {
		return err
	}
	if *dur == 0 {
		return d.Errf("%s %q: must be above 0", name, d.Val())
	}
	return nil
}

// parseOnStoreError reads `on_store_error local [<share>] [reconcile]`, or
// allow or deny. A share (1/6, 0.25) is checked here, to name the value
// where it was written; what it goes with, by check.
func (h *Handler) parseOnStoreError(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Err("on_store_error: want local [<share>] [reconcile], allow or deny")
	}
	h.OnStoreError, args = args[0], args[1:]
	if len(args) > 0 && args[0] != "reconcile" {
		if _, err := parseShare(args[0]); err != nil {
			return d.Err(err.Error())
		}
		h.OnStoreErrorShare, args = args[0], args[1:]
	}
	if len(args) > 0 && args[0] == "reconcile" {
		h.OnStoreErrorReconcile, args = true, args[1:]
	}
	if len(args) > 0 {
		return d.Errf("on_store_error %s: unexpected %q: want local [<share>] [reconcile]", h.OnStoreError, args[0])
	}
	return nil
}
