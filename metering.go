package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"

	"github.com/caddyserver/caddy/v2"
)

// Metering APIs (README: Metering an API): several limits per tier, a cost
// per request from a placeholder, and a cost the origin reports after the
// fact.

// errBadCost is the error behind the 400 for a cost placeholder whose value
// is not a cost. The value is the client's, so it is not repeated.
var errBadCost = errors.New("the request's cost is not a whole number from 0 to the smallest capacity of its tier")

// readCost reads the request's cost from the tier's cost placeholder. A
// cost above the smallest limit could never be allowed, so it is refused
// at once rather than answered with a Retry-After that never comes true.
func (d *decision) readCost(r *http.Request) error {
	if d.cost = d.tier.cost; d.tier.CostPlaceholder == "" {
		return nil
	}
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
// its RetryAfter is the wait until all allow, and its Wait the longest.
func (d *decision) takeAll(ctx context.Context, store Store) (bucket.Result, error) {
	ls := d.tier.limits
	d.limits = new([maxLimits]bucket.Result)
	out := d.limits[:len(ls)]
	allowed, err := store.TakeAll(ctx, &d.bucket, ls, d.cost, out)
	if err != nil {
		return bucket.Result{}, err
	}
	d.binding = uint8(bindingLimit(out, allowed))
	res := out[d.binding]
	res.Allowed = allowed
	// With max_wait, the request waits for the slowest of its limits.
	for _, r := range out {
		res.Wait = max(res.Wait, r.Wait)
	}
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
