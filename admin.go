package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
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

// policyView is GET /rate_limit/policies's view of one policy: what an
// operator checks first.
type policyView struct {
	Policy string     `json:"policy"`
	Keyers []string   `json:"keyers"`
	Tiers  []tierView `json:"tiers"`
	// Store is local or redis.
	Store string `json:"store"`
	// Keys is the live buckets (not full) this node's local store holds:
	// the policy's, or, beside Redis, its on_store_error local fallback's
	// in the running config.
	Keys int `json:"keys"`
	// Breaker is closed, open or half-open (Redis only).
	Breaker string `json:"breaker,omitempty"`
	// RedisMaster is the master in use, as host:port (Redis through
	// Sentinel only).
	RedisMaster string `json:"redis_master,omitempty"`
	// Leases is the buckets this node holds leased tokens of (Redis with
	// lease only).
	Leases int `json:"leases"`
	// StoreRTTSeconds is the round trip to the store this node measured:
	// a moving average of its calls that Redis answered (Redis only; 0
	// before the first).
	StoreRTTSeconds float64 `json:"store_rtt_seconds,omitempty"`
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
	var handlers []*Handler
	for _, hs := range runningHandlers() {
		handlers = append(handlers, hs[len(hs)-1])
	}
	slices.SortFunc(handlers, func(a, b *Handler) int { return strings.Compare(a.Name, b.Name) })
	views := make([]policyView, 0, len(handlers))
	for _, h := range handlers {
		views = append(views, viewOf(h))
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(views)
}

// viewOf describes h's policy as it runs now.
func viewOf(h *Handler) policyView {
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
			if t.hidden == 0 {
				for _, sh := range t.limitsWritten() {
					tv.Limits = append(tv.Limits, limitView(sh))
				}
			}
			if tv.CostPlaceholder = t.CostPlaceholder; tv.CostPlaceholder == "" {
				tv.Cost = t.cost
			}
			// Quotas alone never wait.
			if t.maxWait > 0 && t.hidden == 0 {
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
	if r, ok := h.store.(reporter); ok {
		rep := r.report()
		v.Keys, v.Breaker, v.Leases, v.RedisMaster = rep.keys, rep.breaker, rep.leases, rep.master
		v.StoreRTTSeconds = rep.rtt.Seconds()
	}
	if h.local != nil && h.local.buckets != nil {
		// Beside a shared store: the on_store_error local fallback's.
		v.Keys = h.local.report().keys
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
