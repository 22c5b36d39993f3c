package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
)

// The admin API's buckets: GET /rate_limit/buckets reads one client's
// bucket in a tier, its limits, quotas and requests in flight; DELETE
// resets it in every layer.

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

// readBucket fills state with the bucket's limits and quotas, read where
// requests take from them, without changing them: a peek (a take of cost
// 0 could start a ban, with max_wait, on a bucket in debt). A tier of
// several limits keeps them apart from a tier of one (in Redis, under
// another key), so it is read as such.
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
	if len(tier.limits) == 1 && len(tier.quotas) == 0 {
		res, err := h.store.Peek(ctx, b, tier.limit)
		if err != nil {
			return err
		}
		state.limitState = newLimitState(shapes[0], res, now)
		return nil
	}
	out := make([]bucket.Result, len(tier.limits)+len(tier.quotas))
	if err := h.peekAll(ctx, b, tier, out); err != nil {
		return err
	}
	for i, res := range out[tier.hidden:len(tier.limits)] {
		state.Limits = append(state.Limits, newLimitState(shapes[i], res, now))
	}
	for j, res := range out[len(tier.limits):] {
		q := tier.quotas[j]
		state.Quotas = append(state.Quotas, quotaView{Quota: q.String(), Used: q.N - res.Remaining, Left: res.Remaining, ResetAfter: secondsUp(res.ResetAfter), Reset: secondsUp(now + res.ResetAfter)})
	}
	if tier.hidden > 0 {
		// Quotas alone: no limit to show, as for concurrency alone.
		return nil
	}
	// The top-level fields show a limit: the binding one, or the first
	// when a quota binds.
	j := peekedBinding(out)
	if j >= len(tier.limits) {
		j = 0
	}
	state.limitState = state.Limits[j]
	return nil
}

// peekedBinding is the binding one of peeked results: the least remaining
// and, of equals, the one full last. A peek says no Retry-After, by which
// bindingLimit picks among the limits that refuse a take; the latest
// reset is the one a client refused by all waits for (a ban on an hour's
// limit outlasts the one on a minute's).
func peekedBinding(out []bucket.Result) int {
	j := 0
	for i, r := range out {
		if r.Remaining < out[j].Remaining || r.Remaining == out[j].Remaining && r.ResetAfter > out[j].ResetAfter {
			j = i
		}
	}
	return j
}

// peekAll reads every limit and quota of a tier into out, the quotas'
// after the limits'.
func (h *Handler) peekAll(ctx context.Context, b *Bucket, tier *Tier, out []bucket.Result) error {
	qs, ok := h.store.(QuotaStore)
	if !ok {
		if len(tier.quotas) > 0 {
			return fmt.Errorf("the store keeps no quotas")
		}
		// A store of another module: read by a take of cost 0.
		_, err := h.store.TakeAll(ctx, b, tier.limits, 0, out)
		return err
	}
	n := len(tier.limits)
	return qs.PeekQuotas(ctx, b, tier.limits, tier.quotas, out[:n], out[n:])
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
