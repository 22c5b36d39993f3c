package ratelimit

import (
	"cmp"
	"encoding/json"
	"fmt"
	"math/big"
	"math/bits"
	"strconv"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
)

// on_store_error local <share>: while the shared store fails, a node decides
// alone, and a fleet of n nodes cut off at once would let n limits through.
// The share scales what the node enforces alone (1/n keeps it to its part),
// worked out once at provision into a copy of each tier (Tier.fallback),
// which the request path swaps in when it falls back (Handler.fallBack).

// share is a fraction num/den in (0, 1], in lowest terms.
type share struct{ num, den int64 }

// wholeShare is the share when none is given: the node enforces the whole limit.
var wholeShare = share{1, 1}

// maxScaledUnits is the bound bucket.Limit.Validate puts on a limit's
// capacity times its refill interval.
const maxScaledUnits = 1 << 52

// maxShareDen bounds a share's denominator, so that a scaled rate stays
// exact (bucket.Rate): a decimal has at most six places.
const maxShareDen = 1000000

// parseShare reads a share: a fraction such as 1/6, or a decimal such as
// 0.25, above 0 and at most 1. The empty string is the whole limit.
func parseShare(s string) (share, error) {
	if s == "" {
		return wholeShare, nil
	}
	num, den, ok := splitShare(s)
	if !ok || num < 1 || den < 1 || num > den || den > maxShareDen {
		return share{}, fmt.Errorf("on_store_error local %q: the share must be a fraction such as 1/6 or a decimal above 0 and at most 1, such as 0.25", s)
	}
	g := new(big.Int).GCD(nil, nil, big.NewInt(num), big.NewInt(den)).Int64()
	return share{num / g, den / g}, nil
}

// splitShare reads s as num/den: "a/b", or a decimal of at most six
// places. Signs, exponents and spaces are not a share.
func splitShare(s string) (num, den int64, ok bool) {
	digits := func(x string) (int64, bool) {
		if x == "" || len(x) > 15 || strings.Trim(x, "0123456789") != "" {
			return 0, false
		}
		n, err := strconv.ParseInt(x, 10, 64)
		return n, err == nil
	}
	if a, b, isFraction := strings.Cut(s, "/"); isFraction {
		num, okA := digits(a)
		den, okB := digits(b)
		return num, den, okA && okB
	}
	whole, frac, _ := strings.Cut(s, ".")
	if len(frac) > 6 || whole != "" && strings.Trim(whole, "0123456789") != "" {
		return 0, 0, false
	}
	den = 1
	for range frac {
		den *= 10
	}
	num, ok = digits(whole + frac)
	return num, den, ok
}

// String writes the share as a fraction.
func (s share) String() string {
	return strconv.FormatInt(s.num, 10) + "/" + strconv.FormatInt(s.den, 10)
}

// whole reports whether the share is the whole limit.
func (s share) whole() bool { return s.num == s.den }

// count is n scaled by the share, rounded down, at least least.
func (s share) count(n, least int64) int64 {
	if s.den == 0 {
		return max(n, least) // no share worked out: the whole
	}
	hi, lo := bits.Mul64(uint64(n), uint64(s.num))
	q, _ := bits.Div64(hi, lo, uint64(s.den)) // hi < den: num <= den
	return max(int64(q), least)
}

// limit is l scaled by the share: its capacity rounded down, at least
// cost, the tier's largest (largestCost), and its rate exactly. The
// hidden limit of a plan of quotas alone (Instant) refills whole each
// microsecond at the scaled smallest quota.
func (s share) limit(l bucket.Limit, cost int64) (bucket.Limit, error) {
	l.Capacity = s.count(l.Capacity, cost)
	if l.Instant {
		l.Rate = bucket.Rate{Tokens: l.Capacity, Interval: 1}
		return l, nil
	}
	tokens := new(big.Int).Mul(big.NewInt(l.Rate.Tokens), big.NewInt(s.num))
	interval := new(big.Int).Mul(big.NewInt(l.Rate.Interval), big.NewInt(s.den))
	g := new(big.Int).GCD(nil, nil, tokens, interval)
	tokens.Quo(tokens, g)
	interval.Quo(interval, g)
	if !interval.IsInt64() {
		return l, fmt.Errorf("refill %s scaled by on_store_error local %s: too fine a rate to compute exactly", l.Rate, s)
	}
	l.Rate = bucket.Rate{Tokens: tokens.Int64(), Interval: interval.Int64()}
	if units := l.Capacity * l.Rate.Interval; l.Capacity <= maxScaledUnits/l.Rate.Interval {
		// A smaller capacity allows a shorter max_wait (bucket.Limit.Validate):
		// the node waits at most that long alone.
		l.MaxWait = min(l.MaxWait, min(units*1000, maxScaledUnits-units)/l.Rate.Tokens)
	}
	if err := l.Validate(cost); err != nil {
		return l, fmt.Errorf("scaled by on_store_error local %s: %w", s, err)
	}
	return l, nil
}

// largestCost is the largest cost a tier's request may have: its cost, or
// with a cost placeholder its smallest capacity (readCost). A scaled
// limit or quota holds at least that much, so that every request the
// tier accepts still fits the fallback, and a refusal's Retry-After
// comes true.
func largestCost(placeholder string, cost, maxCost int64) int64 {
	if placeholder != "" {
		return max(cost, maxCost)
	}
	return cost
}

// scaledLimits checks that every limit of a tier's settings scales by the
// share, for check: a share that cannot fails adapt.
func (s share) scaledLimits(ts tierSettings, placeholder string) error {
	for _, l := range ts.limits {
		if _, err := s.limit(l, largestCost(placeholder, ts.cost, ts.maxCost)); err != nil {
			return err
		}
	}
	return nil
}

// scaled is the tier as the on_store_error local fallback enforces it: a
// copy whose limits, quotas and concurrency the share scales, with its
// headers' texts rendered for them (the limit the node enforces is the
// one its headers report); the tier itself for the whole share. A tier
// that limits nothing is itself.
func (t *Tier) scaled(s share) (*Tier, error) {
	if s.whole() || t.Unlimited || t.Deny {
		return t, nil
	}
	c := *t
	c.written = t
	least := largestCost(t.CostPlaceholder, t.cost, t.maxCost)
	c.limits = make([]bucket.Limit, len(t.limits))
	for i, l := range t.limits {
		sl, err := s.limit(l, least)
		if err != nil {
			return nil, fmt.Errorf("tier %q: %w", t.Name, err)
		}
		c.limits[i] = sl
	}
	if len(c.limits) > 0 {
		c.limit = c.limits[0]
	}
	c.quotas = make([]bucket.Quota, len(t.quotas))
	for i, q := range t.quotas {
		q.N = s.count(q.N, least)
		c.quotas[i] = q
	}
	if t.Concurrency > 0 {
		c.Concurrency = s.count(t.Concurrency, 1)
	}
	c.limitTexts = nil // the tier's own stay as they are
	c.renderTexts()
	return &c, nil
}

// checkFallback checks on_store_error's share and reconcile, for check:
// both go with local beside a shared store only, and return the share.
func (h *Handler) checkFallback(onStoreError string) (share, error) {
	if h.OnStoreErrorShare == "" && !h.OnStoreErrorReconcile {
		return wholeShare, nil
	}
	what := "reconcile"
	if h.OnStoreErrorShare != "" {
		what = "a share (" + h.OnStoreErrorShare + ")"
	}
	if onStoreError != "local" {
		return share{}, fmt.Errorf("on_store_error %s: %s goes with local only: %s decides no bucket of this node's", onStoreError, what, onStoreError)
	}
	if storeModule(h.StoreRaw) == "local" {
		return share{}, fmt.Errorf("on_store_error local: %s needs a shared store, such as store redis: the local store is this node's own and never falls back", what)
	}
	return parseShare(h.OnStoreErrorShare)
}

// storeModule is the name of the store a handler's JSON loads: local
// when it names none.
func storeModule(raw json.RawMessage) string {
	var named struct {
		Store string `json:"store"`
	}
	if raw == nil || json.Unmarshal(raw, &named) != nil || named.Store == "" {
		return "local"
	}
	return named.Store
}

// scaleForFallback gives each tier its copy for the fallback
// (Tier.fallback), once the tiers are provisioned whole.
func (h *Handler) scaleForFallback() error {
	if h.local == nil {
		return nil
	}
	for _, t := range h.Tiers {
		f, err := t.scaled(h.share)
		if err != nil {
			return err
		}
		t.fallback = f
	}
	return nil
}

// provisionFallback, with reconcile, starts counting what the fallback
// admits.
func (h *Handler) provisionFallback(ctx caddy.Context) error {
	if h.OnStoreErrorReconcile {
		h.owed = newReconciler(h, cmp.Or(h.owedMax, h.local.maxKeys()))
		if err := registerReconcileMetrics(ctx.GetMetricsRegistry()); err != nil {
			return fmt.Errorf("registering metrics: %v", err)
		}
		// Caddy cleans up a config's modules in no set order: the store
		// drains first, should it go before the handler (Handler.Cleanup).
		beforeStoreUnloads(h.store, h.owed.drain)
	}
	return nil
}
