package ratelimit

import (
	"context"
	"errors"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Metering APIs (README: Metering an API): several limits per tier, a cost
// per request from a placeholder, and a cost the origin reports after the
// fact.

// chargeFromResponse takes, after the response, the work the origin
// reported in the tier's cost_from_response header, or trailer for a
// streamed answer. A missing or malformed value takes nothing more.
func (h *Handler) chargeFromResponse(hdr http.Header, r *http.Request, d *decision) {
	field := d.tier.costField
	v := hdr.Get(field)
	if v == "" {
		// A trailer the origin did not announce is kept under this prefix,
		// where Get cannot canonicalize the name: it must be canonical here.
		v = hdr.Get(http.TrailerPrefix + field)
	}
	n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || n < 0 {
		h.storeLog.Warn("cost_from_response: the response reported no whole number of tokens; nothing more taken",
			zap.String("policy", h.Name), zap.String("tier", d.tier.Name), zap.String("field", field), zap.Bool("present", v != ""))
		return
	}
	if n == 0 {
		return
	}
	// A reload since the take: the origin's figure is in the running
	// config's tokens.
	l := d.tier.limit
	if cur, ok := liveLimit(h.Name, d.tier.Name, l, h); ok {
		l = cur
	}
	if err := d.took.Charge(context.WithoutCancel(r.Context()), &d.bucket, l, n); err != nil {
		h.storeLog.Warn("rate limit store: charging the response's cost failed", zap.String("policy", h.Name), zap.Error(err))
	}
}

// errBadCost is the error behind the 400 for a cost placeholder whose value
// is not a cost. The value is the client's, so it is not repeated.
var errBadCost = errors.New("the request's cost is not a whole number from 0 to the smallest capacity of its tier")

// readCost reads the request's cost from the tier's cost placeholder. A
// cost above the smallest limit could never be allowed, so it is refused
// at once rather than answered with a Retry-After that never comes true.
func (d *decision) readCost(r *http.Request) error {
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if repl == nil {
		repl = caddy.NewReplacer()
	}
	n, err := strconv.ParseInt(strings.TrimSpace(repl.ReplaceAll(d.tier.CostPlaceholder, "")), 10, 64)
	if err != nil || n < 0 || n > d.tier.maxCost {
		d.decide(outcomeDenied)
		return rejection(http.StatusBadRequest, errBadCost)
	}
	d.cost = n
	return nil
}

// takeAll applies the request to every limit of its tier, in one step of
// store. The result is the binding limit's, the one the X- headers report;
// its RetryAfter is the wait until all allow.
func (d *decision) takeAll(ctx context.Context, store Store) (bucket.Result, error) {
	ls := d.tier.limits
	d.limits = new([maxLimits]bucket.Result)
	out := d.limits[:len(ls)]
	allowed, err := store.TakeAll(ctx, &d.bucket, ls, d.cost, out)
	if err != nil {
		return bucket.Result{}, err
	}
	d.binding = bindingLimit(out, allowed)
	res := out[d.binding]
	res.Allowed = allowed
	return res, nil
}

// bindingLimit is the limit whose result the X- headers report: the one
// with the least remaining or, when denied, the one that makes the client
// wait longest; the first of equals.
func bindingLimit(out []bucket.Result, allowed bool) int {
	j := 0
	for i, r := range out {
		if allowed && r.Remaining < out[j].Remaining || !allowed && r.RetryAfter > out[j].RetryAfter {
			j = i
		}
	}
	return j
}
