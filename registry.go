package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// The running handlers, by policy, newest last: the live config that
// give-backs, charges, in-flight slots and lease returns read on the
// request path, and the admin API. Readers take no lock: the map is never
// changed, only replaced, by register and unregister at provision and
// cleanup, which copy it under runningMu.
var (
	running   atomic.Pointer[map[string][]*Handler]
	runningMu sync.Mutex
)

// runningHandlers is the running handlers by policy, newest last. The
// caller must not change it.
func runningHandlers() map[string][]*Handler {
	if m := running.Load(); m != nil {
		return *m
	}
	return nil
}

// register adds h to the running handlers, newest of its policy.
func (h *Handler) register() {
	runningMu.Lock()
	defer runningMu.Unlock()
	next := maps.Clone(runningHandlers())
	if next == nil {
		next = make(map[string][]*Handler)
	}
	// Clipped, so that the append copies: readers still hold the old.
	next[h.Name] = append(slices.Clip(next[h.Name]), h)
	running.Store(&next)
}

// unregister takes h out of the running handlers.
func (h *Handler) unregister() {
	runningMu.Lock()
	defer runningMu.Unlock()
	next := maps.Clone(runningHandlers())
	hs := slices.DeleteFunc(slices.Clone(next[h.Name]), func(x *Handler) bool { return x == h })
	if len(hs) == 0 {
		delete(next, h.Name)
	} else {
		next[h.Name] = hs
	}
	running.Store(&next)
}

// liveLimit is the running config's first limit, as a tier of one, for a
// bucket of policy and tier that a request or a lease took under taker
// (nil for a lease): what a give-back or a charge computed under an older
// config is counted in. It is false while taker runs, or when the policy
// is not running (a shutdown): the taker's own limit stands. Otherwise it
// is the tier's limit in the newest handler of the policy that has the
// tier (routes of one policy may have different tiers), and false when no
// handler has the tier any more, or it no longer limits.
func liveLimit(policy, tier string, taker *Handler) ([]bucket.Limit, bool) {
	runs := slices.Contains(runningHandlers()[policy], taker)
	t, running := liveTier(policy, tier)
	if runs || !running || t == nil || t.Unlimited || t.Deny || len(t.limits) == 0 {
		return nil, false
	}
	return t.limits[:1], true
}

// liveTier is the tier of that name in the newest handler of policy that
// has it, nil when none has; running is false when no handler of the
// policy runs (a shutdown).
func liveTier(policy, tier string) (t *Tier, running bool) {
	hs := runningHandlers()[policy]
	for i := len(hs) - 1; i >= 0; i-- {
		for _, t := range hs[i].Tiers {
			if t.Name == tier {
				return t, true
			}
		}
	}
	return nil, len(hs) > 0
}

// latestHandler is the newest running handler of policy, nil when none
// runs.
func latestHandler(policy string) *Handler {
	hs := runningHandlers()[policy]
	if len(hs) == 0 {
		return nil
	}
	return hs[len(hs)-1]
}

// liveLimits are the limits a give-back of n tokens that a request of
// tier t took under h goes to, and how many tokens each takes back: t's
// own and n while they run (sameLimitsRun). After a reload that changed
// them, the running tier's, each taking back the n tokens as
// bucket.Limit.Converted counts them from the limit at its place in t,
// where its state was kept: no more than the time their refill took
// under that limit buys under the new one. A limit the reload added took
// nothing, and takes back nothing. The store gives every limit the same,
// so they all take the least: a reload never creates tokens. Nil when the
// tier no longer runs, or runs without limits (unlimited, deny).
func liveLimits(h *Handler, t *Tier, n int64) ([]bucket.Limit, int64) {
	if sameLimitsRun(h, t) {
		return t.limits, n
	}
	cur, _ := liveTier(h.Name, t.Name)
	if cur == nil || cur.Unlimited || cur.Deny || len(cur.limits) == 0 {
		return nil, 0
	}
	back := n
	for i, l := range cur.limits {
		if i >= len(t.limits) {
			return cur.limits, 0
		}
		back = min(back, l.Converted(n, t.limits[i]))
	}
	return cur.limits, back
}

// sameLimitsRun reports whether the limits a request of tier t took under
// h still run: h runs (or runs outside a server, in tests), or the newest
// config of its policy has a tier of that name with the same limits, as
// after a reload that did not change them.
func sameLimitsRun(h *Handler, t *Tier) bool {
	hs := runningHandlers()[h.Name]
	if len(hs) == 0 || slices.Contains(hs, h) {
		return true
	}
	for _, x := range hs[len(hs)-1].Tiers {
		if x.Name == t.Name {
			return slices.Equal(x.limits, t.limits)
		}
	}
	return false
}

// liveSlots is where a request of a tier of policy takes its slot once
// the slots of its own config, and of those tried, have closed: the newest
// running handler of the policy whose tier of that name has concurrency,
// and that concurrency. The bucket is the same there, named by policy and
// tier. It is nil when none has: the running config does not limit that
// tier's requests in flight.
func liveSlots(policy, tier string, tried []*Handler) (*Handler, int64) {
	hs := runningHandlers()[policy]
	for i := len(hs) - 1; i >= 0; i-- {
		if slices.Contains(tried, hs[i]) {
			continue
		}
		for _, t := range hs[i].Tiers {
			if t.Name == tier && t.Concurrency > 0 {
				return hs[i], t.Concurrency
			}
		}
	}
	return nil, 0
}

// Handlers share buckets by policy name. Handlers with no name would all
// be the policy "default", so two of them (two pasted recipes, two sites)
// would limit each other's clients: a config with two is refused. Copies
// of one handler are not two: a site of two addresses on two ports is
// served by two servers, each with a copy of the site's routes, so handlers
// written alike in two servers are taken for copies. Handlers that share
// a name on purpose but limit differently are warned of.

// configLoads groups the provisioned handlers by the config load they
// belong to: each load has a metrics registry of its own.
var configLoads = struct {
	sync.Mutex
	m map[*prometheus.Registry][]*Handler
}{m: make(map[*prometheus.Registry][]*Handler)}

// joinConfig records h among the handlers of its config load, and checks
// it against them: unnamed says whether the config gave h no name.
func (h *Handler) joinConfig(ctx caddy.Context, unnamed bool) error {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return nil
	}
	h.loadKey, h.unnamed, h.where = reg, unnamed, listenersOf(ctx)
	h.server, _ = ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	h.written, _ = json.Marshal(h)
	configLoads.Lock()
	defer configLoads.Unlock()
	for _, other := range configLoads.m[reg] {
		switch {
		case unnamed && other.unnamed && (!bytes.Equal(h.written, other.written) || h.server == other.server):
			// Copies of one handler are each in a server of their own; two
			// in one server are two lines someone wrote.
			return fmt.Errorf("two rate_limit handlers in this config have no name, so both would be the policy %q and limit each other's clients: one %s, the other %s; give each its own name, such as `name api` and `name login` (or one name to both, to share one limit on purpose)",
				h.Name, other.describe(), h.describe())
		case other.Name == h.Name && other.tierShapes() != h.tierShapes():
			h.logger.Warn("rate_limit handlers of one name limit differently; they share buckets by tier name, and each request is limited as its own handler says",
				zap.String("policy", h.Name), zap.String("one", other.describe()), zap.String("other", h.describe()))
		}
	}
	configLoads.m[reg] = append(configLoads.m[reg], h)
	return nil
}

// leaveConfig forgets h, at Cleanup.
func (h *Handler) leaveConfig() {
	if h.loadKey == nil {
		return
	}
	configLoads.Lock()
	defer configLoads.Unlock()
	hs := slices.DeleteFunc(configLoads.m[h.loadKey], func(x *Handler) bool { return x == h })
	if len(hs) == 0 {
		delete(configLoads.m, h.loadKey)
		return
	}
	configLoads.m[h.loadKey] = hs
}

// describe names a handler for a message: its tiers' limits, and where it
// listens.
func (h *Handler) describe() string {
	s := "with tiers " + h.tierShapes()
	if h.where != "" {
		s += " on " + h.where
	}
	return s
}

// tierShapes is the handler's tiers as written: each name, its limits and
// quotas.
func (h *Handler) tierShapes() string {
	var b strings.Builder
	for i, t := range h.Tiers {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(t.Name)
		switch {
		case t.Unlimited:
			b.WriteString(" (unlimited)")
			continue
		case t.Deny:
			b.WriteString(" (deny)")
			continue
		}
		b.WriteString(" (")
		var parts []string
		for _, s := range t.limitsWritten() {
			if s.Capacity != 0 || s.Refill != "" {
				parts = append(parts, fmt.Sprintf("%d %s", s.Capacity, s.Refill))
			}
		}
		parts = append(parts, t.Quotas...)
		if t.Concurrency > 0 {
			parts = append(parts, fmt.Sprintf("concurrency %d", t.Concurrency))
		}
		b.WriteString(strings.Join(parts, ", "))
		b.WriteString(")")
	}
	return b.String()
}

// listenersOf is the addresses the handler's server listens on, when it
// runs in one.
func listenersOf(ctx caddy.Context) string {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok {
		return ""
	}
	return strings.Join(srv.Listen, " ")
}
