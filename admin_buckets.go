package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
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

// bucketName names a bucket in the admin API's answers.
type bucketName struct {
	Policy string `json:"policy"`
	Tier   string `json:"tier"`
	Keyer  string `json:"keyer"`
	KeyID  string `json:"key_id"`
}

// bucketState is the admin API's view of a bucket.
type bucketState struct {
	bucketName
	// limitState is the binding limit, the one the X- headers report; its
	// RetryAfter is the tier's: when a request passes every limit and
	// quota, and a free in-flight slot.
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
	// Deleted and LayersReset, after a DELETE that reset every layer: the
	// bucket above is as it is since.
	Deleted     bool     `json:"deleted,omitempty"`
	LayersReset []string `json:"layers_reset,omitempty"`
}

// resetReport is DELETE's answer when the bucket could not be read after
// the reset: what was reset, and no bucket's fields.
type resetReport struct {
	bucketName
	// Deleted says that every layer was reset.
	Deleted bool `json:"deleted"`
	// LayersReset names the layers reset: deny_cache and redis, or local;
	// and local_fallback (on_store_error local).
	LayersReset []string `json:"layers_reset"`
	// LayersFailed gives, by layer, why it could not be reset.
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
	// RetryAfter is the seconds until a request of the tier's cost fits
	// the quota again: 0 when one fits now, else ResetAfter.
	RetryAfter int64 `json:"retry_after"`
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
	// RetryAfter is the seconds until a request of the tier's cost (1 for
	// a cost from a placeholder) passes the limit again, as a refusal's
	// Retry-After says: 0 when one passes now. Under a ban or a debt it
	// comes before ResetAfter by the refill of the capacity less the cost.
	RetryAfter int64 `json:"retry_after"`
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
	tier, err := tierNamed(h, q.Get("tier"))
	if err != nil {
		return caddy.APIError{HTTPStatus: http.StatusNotFound, Err: err}
	}
	keyerName := q.Get("keyer")
	if keyerName == "" {
		keyerName = "ip"
	}
	keyer := keyerNamed(h, keyerName)
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
	if n, ok := keyer.(normalizer); ok && n.normalizes() {
		// As the keyer maps what a client sends: an operator types the
		// name as users do.
		v, ok := normalizedValue(value)
		if !ok {
			return caddy.APIError{HTTPStatus: http.StatusBadRequest, Err: fmt.Errorf("value %q: the keyer's normalize rejects it, so it names no client", value)}
		}
		raw = []byte(v)
	}
	b := &Bucket{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), Value: raw, secret: h.keySecret}

	name := bucketName{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), KeyID: keyID(b)}
	state := bucketState{bucketName: name}
	w.Header().Set("Content-Type", "application/json")
	if r.Method == http.MethodDelete {
		report := resetReport{bucketName: name}
		report.LayersReset, report.LayersFailed = resetBucket(r.Context(), h, b)
		report.Deleted = len(report.LayersFailed) == 0
		if !report.Deleted {
			// Some layer kept the bucket; nothing to read it from.
			w.WriteHeader(http.StatusBadGateway)
			return json.NewEncoder(w).Encode(report)
		}
		if readBucket(r.Context(), h, b, tier, &state) != nil {
			// Reset, but not to be read back: say what was reset.
			return json.NewEncoder(w).Encode(report)
		}
		state.Deleted, state.LayersReset = true, report.LayersReset
		return json.NewEncoder(w).Encode(state)
	}
	if err := readBucket(r.Context(), h, b, tier, &state); err != nil {
		return caddy.APIError{HTTPStatus: http.StatusBadGateway, Err: fmt.Errorf("reading the bucket: the store %s failed: %v (a DELETE still resets this node's layers)", caddy.GetModuleName(h.store), err)}
	}
	return json.NewEncoder(w).Encode(state)
}

// readBucket fills state with the bucket's limits and quotas, read where
// requests take from them, without changing them: a peek (a take of cost
// 0 could start a ban, with max_wait, on a bucket in debt). A tier of
// several limits keeps them apart from a tier of one (in Redis, under
// another key), so it is read as such.
func readBucket(ctx context.Context, h *Handler, b *Bucket, tier *Tier, state *bucketState) error {
	if err := readLimits(ctx, h, b, tier, state); err != nil {
		return err
	}
	if tier.Concurrency > 0 {
		n, err := h.store.inFlight(ctx, b)
		if err != nil {
			return err
		}
		state.InFlight, state.Concurrency = &n, tier.Concurrency
		if n >= tier.Concurrency {
			// No free slot: a request is refused with Retry-After 1
			// (Handler.acquireSlot).
			state.RetryAfter = max(state.RetryAfter, 1)
		}
	}
	return nil
}

// readLimits fills state with the tier's limits and quotas, as this node
// sees them: with leases, remaining counts the tokens it holds (the
// store's peek), and while they cover a request of the tier's cost, it
// passes at once, since this node spends them without asking Redis
// (leaseHolder). The top level's RetryAfter is the tier's: the longest of
// them all.
func readLimits(ctx context.Context, h *Handler, b *Bucket, tier *Tier, state *bucketState) error {
	shapes := tier.limitsWritten()
	now := time.Now().UnixMicro()
	if len(tier.limits) == 0 {
		return nil
	}
	out := make([]bucket.Result, tier.shape().Parts())
	if err := h.store.peek(ctx, b, tier.shape(), out); err != nil {
		return err
	}
	if len(tier.limits) == 1 && len(tier.quotas) == 0 {
		res := out[0]
		res.RetryAfter = untilPassesHere(tier.limit, res, tier.cost, heldCovers(h, b, tier))
		state.limitState = newLimitState(shapes[0], res, now)
		return nil
	}
	var retry int64
	covered := heldCovers(h, b, tier)
	for i, l := range tier.limits {
		out[i].RetryAfter = untilPassesHere(l, out[i], tier.cost, covered)
	}
	for j, res := range out[len(tier.limits):] {
		if res.Remaining < tier.cost {
			out[len(tier.limits)+j].RetryAfter = res.ResetAfter
		}
	}
	for i, res := range out[tier.hidden:len(tier.limits)] {
		state.Limits = append(state.Limits, newLimitState(shapes[i], res, now))
		retry = max(retry, res.RetryAfter)
	}
	for j, res := range out[len(tier.limits):] {
		q := tier.quotas[j]
		state.Quotas = append(state.Quotas, quotaView{Quota: q.String(), Used: q.N - res.Remaining, Left: res.Remaining, ResetAfter: secondsUp(res.ResetAfter), Reset: secondsUp(now + res.ResetAfter), RetryAfter: secondsUp(res.RetryAfter)})
		retry = max(retry, res.RetryAfter)
	}
	if tier.hidden == 0 {
		// The top-level fields show a limit: the binding one, or the
		// first when a quota binds.
		j := peekedBinding(out)
		if j >= len(tier.limits) {
			j = 0
		}
		state.limitState = state.Limits[j]
	}
	// Quotas alone show no limit, as concurrency alone, but when a
	// request passes.
	state.RetryAfter = secondsUp(retry)
	return nil
}

// untilPassesHere is untilPasses on this node: 0 while the tokens it
// holds of the bucket on lease cover the cost (covered).
func untilPassesHere(l bucket.Limit, res bucket.Result, cost int64, covered bool) int64 {
	if covered {
		return 0
	}
	return untilPasses(l, res, cost)
}

// heldCovers says whether the tokens this node holds of the bucket on
// lease cover a request of the tier's cost: it passes every limit and
// quota at once, whatever the shared bucket holds.
func heldCovers(h *Handler, b *Bucket, tier *Tier) bool {
	lh, ok := h.store.(leaseHolder)
	return ok && lh.held(b) >= tier.cost
}

// untilPasses is the microseconds until a request of cost tokens passes
// limit l, from its peek res, as a refusal's Retry-After says: 0 when one
// passes now. The level rises by the refill until the bucket is full,
// ResetAfter from now, so it holds the cost as much sooner as the rest of
// the capacity takes to refill (bucket's untilLevel): under a ban or a
// debt, well before the bucket is full. With max_wait, a request passes
// once its tokens are due within it, but not while a ban holds the bucket
// empty (bucket's retryBanned); a bucket with a ban setting and waiters
// queued past empty reads as banned.
func untilPasses(l bucket.Limit, res bucket.Result, cost int64) int64 {
	until := res.ResetAfter - (l.Units()-cost*l.Rate.Interval)/l.Rate.Tokens
	if l.MaxWait > 0 {
		waited := until - l.MaxWait
		if l.Ban > 0 {
			waited = max(waited, res.ResetAfter-l.Units()/l.Rate.Tokens)
		}
		until = waited
	}
	return max(0, until)
}

// peekedBinding is the binding one of peeked results, as bucket.Binding
// picks it: of those a request would wait for, the one it waits for
// longest; else the least remaining and, of equals, the one full last (a
// ban on an hour's limit outlasts the one on a minute's).
func peekedBinding(out []bucket.Result) int {
	j := 0
	for i, r := range out {
		o := out[j]
		if r.RetryAfter > o.RetryAfter || r.RetryAfter == o.RetryAfter && (r.Remaining < o.Remaining || r.Remaining == o.Remaining && r.ResetAfter > o.ResetAfter) {
			j = i
		}
	}
	return j
}

func newLimitState(shape TierLimit, res bucket.Result, now int64) limitState {
	return limitState{
		Capacity:   shape.Capacity,
		Refill:     shape.Refill,
		Remaining:  res.Remaining,
		ResetAfter: secondsUp(res.ResetAfter),
		Reset:      secondsUp(now + res.ResetAfter),
		RetryAfter: secondsUp(res.RetryAfter),
	}
}

// resetBucket resets the bucket in every layer this node holds, whether or
// not the others could be reached, and says which it reset and which it
// could not. With Redis down, the local fallback still refills, so the
// client gets through on this node while on_store_error local applies.
func resetBucket(ctx context.Context, h *Handler, b *Bucket) (reset []string, failed map[string]string) {
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
	if lr, ok := h.store.(layeredResetter); ok {
		layers, errs := lr.resetLayers(ctx, b)
		for i, layer := range layers {
			note(layer, errs[i])
		}
	} else {
		note(caddy.GetModuleName(h.store), h.store.reset(ctx, b))
	}
	if h.local != nil {
		note("local_fallback", h.local.reset(ctx, b))
	}
	// Reset forgives what the fallback admitted, too: in every handler of
	// the policy (a site on two ports has a copy in each server), each of
	// which counts what it admitted.
	if h.owed != nil {
		h.owed.forget(b)
	}
	if err := resetCopies(ctx, h, b); err != nil {
		note("copies", err)
	}
	return reset, failed
}

// hereForgetter is a store shared by the copies of a policy whose copies
// each keep some of a bucket on this node (a lease, a denial), which
// forgetHere drops without calling the shared store again.
type hereForgetter interface {
	forgetHere(b *Bucket)
}

// resetCopies resets the bucket in the other running copies of h's
// policy (a site on two ports has one in each server): what each keeps of
// its own, a lease or a lease call's hold-off, a fallback table, what its
// fallback admitted, which would otherwise go on refusing or charging the
// client there. The shared bucket, which h's store reset, is not called
// again: the copies share its connection, and a second call while it is
// down would count one more failure toward its breaker.
func resetCopies(ctx context.Context, h *Handler, b *Bucket) error {
	var errs []error
	for _, x := range runningHandlers()[h.Name] {
		if x == h {
			continue
		}
		own := *b
		own.secret = x.keySecret
		if x.owed != nil {
			x.owed.forget(&own)
		}
		switch f, ok := x.store.(hereForgetter); {
		case x.store == h.store:
		case ok:
			f.forgetHere(&own)
		default:
			errs = append(errs, x.store.reset(ctx, &own))
		}
		if x.local != nil && x.local != h.local {
			errs = append(errs, x.local.reset(ctx, &own))
		}
	}
	return errors.Join(errs...)
}

// tierNamed finds a tier that has buckets; "" names the catch-all.
func tierNamed(h *Handler, name string) (*Tier, error) {
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
func keyerNamed(h *Handler, name string) Keyer {
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
