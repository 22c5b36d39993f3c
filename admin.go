package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"net/http"
	"net/netip"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
)

func init() {
	caddy.RegisterModule(Admin{})
}

// Admin is the admin API of the rate limiter, at /rate_limit/ on Caddy's
// admin endpoint:
//
//	GET    /rate_limit/buckets?policy=&tier=&keyer=&value=   a bucket's state
//	DELETE /rate_limit/buckets?policy=&tier=&keyer=&value=   refill it, to unblock a client
//	GET    /rate_limit/policies                              every policy, its store's health
//	GET    /rate_limit/top?policy=&n=10                      the buckets denied most lately
//
// policy defaults to "default", tier to the policy's catch-all tier and
// keyer to "ip". keyer is a keyer's kind (ip, header, ...) or, where a
// policy has several of one kind, its id as in "header/X-Api-Key". value is
// what that keyer reads: an IP address, an API key, a username.
type Admin struct{}

// CaddyModule returns the Caddy module information.
func (Admin) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return new(Admin) },
	}
}

// Routes returns the admin routes.
func (a *Admin) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/rate_limit/buckets", Handler: caddy.AdminHandlerFunc(a.serveBuckets)},
		{Pattern: "/rate_limit/policies", Handler: caddy.AdminHandlerFunc(a.servePolicies)},
		{Pattern: "/rate_limit/top", Handler: caddy.AdminHandlerFunc(a.serveTop)},
	}
}

// liveHandlers are the provisioned handlers by policy, newest last, so the
// admin API finds the stores and tiers of the running config.
var liveHandlers = struct {
	sync.Mutex
	byPolicy map[string][]*Handler
}{byPolicy: make(map[string][]*Handler)}

func registerHandler(h *Handler) {
	liveHandlers.Lock()
	liveHandlers.byPolicy[h.Name] = append(liveHandlers.byPolicy[h.Name], h)
	liveHandlers.Unlock()
}

func unregisterHandler(h *Handler) {
	liveHandlers.Lock()
	defer liveHandlers.Unlock()
	hs := slices.DeleteFunc(liveHandlers.byPolicy[h.Name], func(x *Handler) bool { return x == h })
	if len(hs) == 0 {
		delete(liveHandlers.byPolicy, h.Name)
		return
	}
	liveHandlers.byPolicy[h.Name] = hs
}

// handlerFor finds the running handler of the query's policy ("default"
// when none is named), or the admin API's 404.
func handlerFor(q url.Values) (*Handler, error) {
	policy := q.Get("policy")
	if policy == "" {
		policy = "default"
	}
	h := latestHandler(policy)
	if h == nil {
		return nil, caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("policy %q: no such policy in the running config", policy)}
	}
	return h, nil
}

// liveLimit is the running config's limit for a bucket of policy and tier
// that a request or a lease took under l, through taker (nil for a lease):
// what a give-back or a charge computed under an older config is counted
// in. While taker runs, it is l. Otherwise it is the tier's limit in the
// newest handler of the policy that has the tier (routes of one policy may
// have different tiers), l when the policy is not running (a shutdown),
// and false when no handler has the tier any more, or it no longer limits.
func liveLimit(policy, tier string, l bucket.Limit, taker *Handler) (bucket.Limit, bool) {
	liveHandlers.Lock()
	defer liveHandlers.Unlock()
	hs := liveHandlers.byPolicy[policy]
	if len(hs) == 0 {
		return l, true
	}
	if slices.Contains(hs, taker) {
		return l, true
	}
	for i := len(hs) - 1; i >= 0; i-- {
		for _, t := range hs[i].Tiers {
			if t.Name == tier {
				return t.limit, !t.Unlimited && !t.Deny
			}
		}
	}
	return bucket.Limit{}, false
}

func latestHandler(policy string) *Handler {
	liveHandlers.Lock()
	defer liveHandlers.Unlock()
	hs := liveHandlers.byPolicy[policy]
	if len(hs) == 0 {
		return nil
	}
	return hs[len(hs)-1]
}

// bucketState is the admin API's view of a bucket.
type bucketState struct {
	Policy string `json:"policy"`
	Tier   string `json:"tier"`
	Keyer  string `json:"keyer"`
	KeyID  string `json:"key_id"`
	// limitState is the limit with the least remaining, the one the X-
	// headers report.
	limitState
	// Limits, for a tier of several limits, shows each, in the tier's order.
	Limits []limitState `json:"limits,omitempty"`
	// Quotas, for a tier with quotas, shows each: used and left in the
	// period, and when it starts over.
	Quotas []quotaView `json:"quotas,omitempty"`
	// Concurrency and InFlight, for a tier with concurrency, are its limit
	// and the client's requests in flight now, fleet-wide with Redis.
	Concurrency int64  `json:"concurrency,omitempty"`
	InFlight    *int64 `json:"in_flight,omitempty"`
	// Deleted is set when DELETE refilled the bucket in every layer.
	Deleted bool `json:"deleted,omitempty"`
	// LayersReset names the layers DELETE reset: deny_cache and redis, or
	// local; and local_fallback (on_store_error local).
	LayersReset []string `json:"layers_reset,omitempty"`
	// LayersFailed gives, by layer, why DELETE could not reset it.
	LayersFailed map[string]string `json:"layers_failed,omitempty"`
}

// quotaView is one quota of a bucket, as the admin API shows it.
type quotaView struct {
	Quota string `json:"quota"`
	Used  int64  `json:"used"`
	Left  int64  `json:"left"`
	// Reset is the Unix second at which the period ends and the count
	// starts over; ResetAfter the seconds until then.
	Reset      int64 `json:"reset"`
	ResetAfter int64 `json:"reset_after"`
}

// limitState is one limit of a bucket, as the admin API shows it.
type limitState struct {
	Capacity int64  `json:"capacity"`
	Refill   string `json:"refill"`
	// Remaining is the whole tokens in the bucket now.
	Remaining int64 `json:"remaining"`
	// Reset is the Unix second at which the bucket is full again.
	Reset int64 `json:"reset"`
	// ResetAfter is the seconds until then.
	ResetAfter int64 `json:"reset_after"`
}

func (a *Admin) serveBuckets(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet && r.Method != http.MethodDelete {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s: use GET or DELETE", r.Method)}
	}
	q := r.URL.Query()
	h, err := handlerFor(q)
	if err != nil {
		return err
	}
	tier, err := h.tierNamed(q.Get("tier"))
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: err}
	}
	keyerName := q.Get("keyer")
	if keyerName == "" {
		keyerName = "ip"
	}
	keyer := h.keyerNamed(keyerName)
	if keyer == nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: fmt.Errorf("keyer %q: policy %q has no such keyer", keyerName, h.Name)}
	}
	value := q.Get("value")
	if value == "" {
		return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("value: required: what the keyer reads, such as the client's IP address")}
	}
	raw := []byte(value)
	if ipk, ok := keyer.(*IPKeyer); ok {
		addr, err := netip.ParseAddr(value)
		if err != nil {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("value %q: not an IP address", value)}
		}
		raw, _ = ipk.appendAddr(nil, addr)
	}
	b := &Bucket{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), Value: raw, secret: h.keySecret}

	state := bucketState{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), KeyID: keyID(b)}
	w.Header().Set("Content-Type", "application/json")
	if r.Method == http.MethodDelete {
		state.LayersReset, state.LayersFailed = h.resetBucket(r.Context(), b)
		if len(state.LayersFailed) > 0 {
			// Some layer kept the bucket; nothing to read it from.
			w.WriteHeader(http.StatusBadGateway)
			return json.NewEncoder(w).Encode(state)
		}
		state.Deleted = true
	}
	if err := h.readBucket(r.Context(), b, tier, &state); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadGateway, Err: fmt.Errorf("reading the bucket: %v", err)}
	}
	return json.NewEncoder(w).Encode(state)
}

// readBucket fills state with the bucket's limits, read where requests
// take from them, without changing them: a tier of several limits keeps
// them apart from a tier of one (in Redis, under another key), so it is
// read by a take of cost 0.
func (h *Handler) readBucket(ctx context.Context, b *Bucket, tier *Tier, state *bucketState) error {
	if tier.Concurrency > 0 {
		n, err := h.store.(SlotStore).InFlight(ctx, b)
		if err != nil {
			return err
		}
		state.InFlight, state.Concurrency = &n, tier.Concurrency
	}
	shapes := tier.shapes()
	now := time.Now().UnixMicro()
	if len(tier.limits) == 0 {
		return nil
	}
	if len(tier.quotas) > 0 {
		return h.readQuotas(ctx, b, tier, state, now)
	}
	if len(tier.limits) == 1 {
		res, err := h.store.Peek(ctx, b, tier.limit)
		if err != nil {
			return err
		}
		state.limitState = newLimitState(shapes[0], res, now)
		return nil
	}
	out := make([]bucket.Result, len(tier.limits))
	allowed := true
	if qs, ok := h.store.(QuotaStore); ok {
		// A peek: a take of cost 0 could start a ban (with max_wait, on
		// a bucket in debt).
		if err := qs.PeekQuotas(ctx, b, tier.limits, nil, out, nil); err != nil {
			return err
		}
		for _, r := range out {
			allowed = allowed && r.Allowed
		}
	} else {
		var err error
		if allowed, err = h.store.TakeAll(ctx, b, tier.limits, 0, out); err != nil {
			return err
		}
	}
	for i, res := range out {
		state.Limits = append(state.Limits, newLimitState(shapes[i], res, now))
	}
	state.limitState = state.Limits[bindingLimit(out, allowed)]
	return nil
}

// readQuotas fills state with a tier's limits and quotas, read by a take
// of cost 0, which changes nothing.
func (h *Handler) readQuotas(ctx context.Context, b *Bucket, tier *Tier, state *bucketState, now int64) error {
	qs, ok := h.store.(QuotaStore)
	if !ok {
		return fmt.Errorf("the store keeps no quotas")
	}
	out := make([]bucket.Result, len(tier.limits)+len(tier.quotas))
	if err := qs.PeekQuotas(ctx, b, tier.limits, tier.quotas, out[:len(tier.limits)], out[len(tier.limits):]); err != nil {
		return err
	}
	allowed := true
	for _, r := range out {
		allowed = allowed && r.Allowed
	}
	shapes := tier.shapes()
	for i, res := range out[:len(tier.limits)] {
		state.Limits = append(state.Limits, newLimitState(shapes[i], res, now))
	}
	for j, res := range out[len(tier.limits):] {
		q := tier.quotas[j]
		state.Quotas = append(state.Quotas, quotaView{Quota: q.String(), Used: q.N - res.Remaining, Left: res.Remaining, ResetAfter: secondsUp(res.ResetAfter), Reset: secondsUp(now + res.ResetAfter)})
	}
	if j := bindingLimit(out, allowed); j < len(tier.limits) {
		state.limitState = state.Limits[j]
	} else {
		state.limitState = state.Limits[0]
	}
	return nil
}

func newLimitState(shape TierLimit, res bucket.Result, now int64) limitState {
	return limitState{
		Capacity:   shape.Capacity,
		Refill:     shape.Refill,
		Remaining:  res.Remaining,
		ResetAfter: secondsUp(res.ResetAfter),
		Reset:      secondsUp(now + res.ResetAfter),
	}
}

// resetBucket resets the bucket in every layer this node holds, whether or
// not the others could be reached, and says which it reset and which it
// could not. With Redis down, the local fallback still refills, so the
// client gets through on this node while on_store_error local applies.
func (h *Handler) resetBucket(ctx context.Context, b *Bucket) (reset []string, failed map[string]string) {
	note := func(layer string, err error) {
		if err == nil {
			reset = append(reset, layer)
			return
		}
		if failed == nil {
			failed = make(map[string]string)
		}
		failed[layer] = err.Error()
	}
	if lr, ok := h.store.(LayeredResetter); ok {
		layers, errs := lr.ResetLayers(ctx, b)
		for i, layer := range layers {
			note(layer, errs[i])
		}
	} else {
		note(caddy.GetModuleName(h.store), h.store.Reset(ctx, b))
	}
	if h.local != nil {
		note("local_fallback", h.local.Reset(ctx, b))
	}
	return reset, failed
}

// tierNamed finds a tier that has buckets; "" names the catch-all.
func (h *Handler) tierNamed(name string) (*Tier, error) {
	var t *Tier
	if name == "" {
		t = h.Tiers[len(h.Tiers)-1]
	} else {
		for _, c := range h.Tiers {
			if c.Name == name {
				t = c
			}
		}
	}
	if t == nil {
		return nil, fmt.Errorf("tier %q: policy %q has no such tier", name, h.Name)
	}
	if t.Unlimited || t.Deny {
		return nil, fmt.Errorf("tier %q: an unlimited or deny tier has no buckets", t.Name)
	}
	return t, nil
}

// keyerNamed finds a keyer by id or kind; "ip" always finds one, since the
// client IP names clients that no keyer names.
func (h *Handler) keyerNamed(name string) Keyer {
	for _, k := range h.keyers {
		if k.ID() == name || k.Kind() == name {
			return k
		}
	}
	if h.fallback.Kind() == name || h.fallback.ID() == name {
		return h.fallback
	}
	return nil
}

// policyView is GET /rate_limit/policies's view of one policy: what an
// operator checks first.
type policyView struct {
	Policy string     `json:"policy"`
	Keyers []string   `json:"keyers"`
	Tiers  []tierView `json:"tiers"`
	// Store is local or redis.
	Store string `json:"store"`
	// Keys is the buckets this node's local store holds: the policy's, or,
	// beside Redis, its on_store_error local fallback's.
	Keys int `json:"keys"`
	// Breaker is closed, open or half-open (Redis only).
	Breaker string `json:"breaker,omitempty"`
	// Leases is the buckets this node holds leased tokens of (Redis with
	// lease only).
	Leases int `json:"leases"`
	// Waiting is the policy's requests waiting for their tokens on this
	// node now (max_wait), and MaxWaiting their bound.
	Waiting    int64 `json:"waiting"`
	MaxWaiting int   `json:"max_waiting"`
}

type tierView struct {
	Name   string      `json:"name"`
	Limits []limitView `json:"limits,omitempty"`
	Cost   int64       `json:"cost,omitempty"`
	// CostPlaceholder, instead of Cost, is where each request's cost is read.
	CostPlaceholder string `json:"cost_placeholder,omitempty"`
	// MaxWait is how long a request may wait for its tokens, when it may.
	MaxWait string `json:"max_wait,omitempty"`
	// Concurrency is how many of one client's requests may be in flight.
	Concurrency int64 `json:"concurrency,omitempty"`
	// Quotas are the tier's calendar quotas, and Timezone the zone they
	// count in.
	Quotas   []string `json:"quotas,omitempty"`
	Timezone string   `json:"timezone,omitempty"`
	// Unlimited or Deny mark allow- and block-list tiers.
	Unlimited bool `json:"unlimited,omitempty"`
	Deny      bool `json:"deny,omitempty"`
}

type limitView struct {
	Capacity int64  `json:"capacity"`
	Refill   string `json:"refill"`
}

func (a *Admin) servePolicies(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s: use GET", r.Method)}
	}
	liveHandlers.Lock()
	var handlers []*Handler
	for _, hs := range liveHandlers.byPolicy {
		handlers = append(handlers, hs[len(hs)-1])
	}
	liveHandlers.Unlock()
	slices.SortFunc(handlers, func(a, b *Handler) int { return strings.Compare(a.Name, b.Name) })
	views := make([]policyView, 0, len(handlers))
	for _, h := range handlers {
		views = append(views, h.view())
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(views)
}

// view describes the handler's policy as it runs now.
func (h *Handler) view() policyView {
	v := policyView{Policy: h.Name, Keyers: []string{}, Waiting: h.waiting.Load(), MaxWaiting: h.maxWaiting}
	for _, k := range h.keyers {
		v.Keyers = append(v.Keyers, k.ID())
	}
	if !h.noKeyDeny {
		v.Keyers = append(v.Keyers, h.fallback.ID())
	}
	for _, t := range h.Tiers {
		tv := tierView{Name: t.Name, Unlimited: t.Unlimited, Deny: t.Deny}
		if !t.Unlimited && !t.Deny && len(t.limits) > 0 {
			for _, sh := range t.shapes() {
				tv.Limits = append(tv.Limits, limitView(sh))
			}
			if tv.CostPlaceholder = t.CostPlaceholder; tv.CostPlaceholder == "" {
				tv.Cost = t.cost
			}
			if t.maxWait > 0 {
				tv.MaxWait = (time.Duration(t.maxWait) * time.Microsecond).String()
			}
		}
		tv.Concurrency = t.Concurrency
		if len(t.quotas) > 0 {
			tv.Quotas, tv.Timezone = t.Quotas, t.loc.String()
		}
		v.Tiers = append(v.Tiers, tv)
	}
	v.Store = caddy.GetModuleName(h.store)
	if r, ok := h.store.(StoreReporter); ok {
		rep := r.Report()
		v.Keys, v.Breaker, v.Leases = rep.Keys, rep.Breaker, rep.Leases
	}
	if h.local != nil && h.local.buckets != nil {
		// Beside a shared store: the on_store_error local fallback's.
		v.Keys = h.local.buckets.len()
	}
	return v
}

func (a *Admin) serveTop(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: fmt.Errorf("method %s: use GET", r.Method)}
	}
	q := r.URL.Query()
	h, err := handlerFor(q)
	if err != nil {
		return err
	}
	n := 10
	if s := q.Get("n"); s != "" {
		if n, err = strconv.Atoi(s); err != nil || n < 1 || n > topEntries {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("n %q: want a whole number from 1 to %d", s, topEntries)}
		}
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(h.denials.top(time.Now(), n))
}

// Interface guard
var _ caddy.AdminRouter = (*Admin)(nil)
