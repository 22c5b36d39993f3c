package ratelimit

import (
	"errors"
	"net/http"
	"strconv"
	"strings"

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
