package ratelimit

import (
	"net/http"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The {http.rate_limit.*} placeholders (their list is Handler's doc
// comment): each request's decision answers them, lazily, for as long as
// the request's replacer lives. Where several rate_limit handlers are
// stacked on a route, the first answers for all, from the last decision.

// placeholderPrefix starts every name the handler answers.
const placeholderPrefix = "http.rate_limit."

// decisionVar is the request variable (caddyhttp's vars) under which the
// first rate_limit handler of a request keeps its decision, for the later
// ones to find: a Caddyfile cannot name it. A map lookup, where asking the
// replacer would ask each of Caddy's placeholder providers first.
const decisionVar = "\x00rate_limit.decision"

// decisionRef is the placeholder name under which the first handler
// answers its decision, for a request without vars (one that did not come
// through a Caddy server: a test's).
const decisionRef = "\x00decision"

// provide answers r's rate_limit placeholders from d. Only the first
// handler of the request answers them, since Caddy asks its providers in
// order: it answers from the latest decision, which d becomes.
func (d *decision) provide(r *http.Request) {
	ctx := r.Context()
	repl, ok := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	vars, _ := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any)
	// A vars directive may name the variable with a client's value (a
	// query's, whose %00 decodes): what it holds then is no decision, and
	// the replacer still knows the first handler's. A request whose vars
	// lack the variable has met no rate_limit handler yet: the first one
	// would have set it, in the same map. Only then is the replacer not
	// asked, which would ask each of Caddy's providers first.
	held, set := vars[decisionVar]
	last, ok := held.(*decision)
	if !ok && (vars == nil || set) {
		first, _ := repl.Get(placeholderPrefix + decisionRef)
		last, ok = first.(*decision)
	}
	if !ok {
		if vars != nil {
			vars[decisionVar] = d
		}
		repl.Map(d.placeholder)
		return
	}
	for last.later != nil {
		last = last.later
	}
	last.later = d
}

// placeholder answers the request's rate_limit placeholders: from the
// decision of the last rate_limit handler the request went through, when
// several are stacked on its route, which is the one that refused it if
// one did.
func (d *decision) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	if name == decisionRef {
		return d, true
	}
	for d.later != nil {
		d = d.later
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
	case "waited":
		// The wait of an allowed request is the one it waited.
		return (d.result.Wait + 500) / 1000, true
	}
	if d.tier.Unlimited || d.tier.Deny || d.outcome == outcomeError && d.result == (bucket.Result{}) {
		return "", true
	}
	switch name {
	case "limit":
		// The limit the X- headers report: with several, the binding one.
		if len(d.tier.limits) == 0 {
			// Only in-flight requests: the X- fields report the slots.
			return d.tier.Concurrency, true
		}
		if j := int(d.binding) - len(d.tier.limits); j >= 0 {
			return d.tier.quotas[j].N, true
		}
		return d.tier.limits[d.binding].Capacity, true
	case "remaining":
		return d.goingOn(int(d.binding), d.result).Remaining, true
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
