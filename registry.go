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

// Handlers share buckets by policy name. Handlers with no name would all
// be the policy "default", so two of them (two pasted recipes, two sites)
// would limit each other's clients: a config with two is refused. Copies
// of one handler are not two: a site of two addresses on two ports is
// served by two servers, each with a copy of the site's routes, so handlers
// written alike in two servers are taken for copies. Handlers that share a name on purpose but limit differently are
// warned of.

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
