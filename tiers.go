package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
)

// Tiers and their settings, checked once a load (check) and applied at
// provision: limits and a cost (docs/metering-and-quotas.md), calendar
// quotas in the handler's time zone, count_status and ban
// (docs/logins.md), max_wait (docs/max-wait.md) and concurrency
// (docs/concurrency.md).

// A Tier is one class of client with its own bucket shape. The handler
// tries its tiers in order; the first whose conditions all hold wins. A tier
// with no conditions is a catch-all, and the last tier must be one.
type Tier struct {
	// Name names the tier in bucket names, headers and placeholders.
	Name string `json:"name"`
	// Capacity is the bucket's size in tokens: the largest burst.
	Capacity int64 `json:"capacity,omitempty"`
	// Refill is the rate at which tokens come back, as <amount>/<duration>:
	// 100/s, 0.5/s, 1/10s, 30/m, 1000/h.
	Refill string `json:"refill,omitempty"`
	// Limits are more limits the tier's requests must fit, each a bucket of
	// its own: 100/s and 10,000/day, say. A request takes from all or
	// none. Capacity and Refill, when given, are the first limit.
	Limits []TierLimit `json:"limits,omitempty"`

	// Cost is how many tokens one request takes. Default 1.
	Cost int64 `json:"cost,omitempty"`
	// CostPlaceholder, instead of Cost, reads each request's cost from a
	// placeholder, such as {http.request.header.X-Batch}: a whole number
	// from 0 to the smallest capacity of the tier's limits. Any other value
	// is answered 400 and takes nothing.
	CostPlaceholder string `json:"cost_placeholder,omitempty"`
	// CostFromResponse names a response header, or trailer for streamed
	// answers, in which the origin reports the work a request did, such as
	// LLM tokens: after the response, that many tokens are taken as well.
	// The bucket may go into debt, and its client is refused until it has
	// refilled to the cost. A missing or malformed value takes nothing more.
	CostFromResponse string `json:"cost_from_response,omitempty"`

	// MatcherSetsRaw holds request matchers; the tier applies only to
	// requests that some set matches.
	MatcherSetsRaw caddyhttp.RawMatcherSets `json:"match,omitempty" caddy:"namespace=http.matchers"`
	// Keyer, when set, applies the tier only to clients named by a keyer of
	// this kind: ip, header, cookie, jwt, form, json or placeholder.
	Keyer string `json:"keyer,omitempty"`
	// Claims, when set, applies the tier only to requests whose verified JWT
	// has, for every claim named, one of the values listed.
	Claims map[string][]string `json:"claims,omitempty"`

	// Quotas are counts a request's tokens must also fit, each per
	// calendar period in the handler's time zone: "10000/month",
	// "500/day"; the period is day, week (from Monday), month or year.
	// A quota starts over at the period's boundary. A tier may have
	// quotas and no rate limit: then nothing limits its rate.
	Quotas []string `json:"quotas,omitempty"`

	// Concurrency, when set, is how many of one client's requests may be
	// in flight at once: from when rate_limit passes a request on until
	// the handlers after it return (a streamed or upgraded response holds
	// its slot until it ends). One more is refused with Status and
	// Retry-After: 1, and gives back the rate tokens it took. Beside the
	// tier's rate limits or quotas, or instead of them.
	Concurrency int64 `json:"concurrency,omitempty"`

	// MaxWait, when set, is the tier's own max_wait: how long its requests
	// may wait for their tokens. Default: the handler's.
	MaxWait caddy.Duration `json:"max_wait,omitempty"`

	// Unlimited makes the tier an allow-list: its clients are never limited
	// and the store is not touched.
	Unlimited bool `json:"unlimited,omitempty"`
	// Deny makes the tier a block-list: its clients are always rejected.
	Deny bool `json:"deny,omitempty"`

	matchers caddyhttp.MatcherSets
	limit    bucket.Limit
	// limits are all the tier's limits, limit first.
	limits []bucket.Limit
	// hidden is how many of limits, from the first, nothing shows: 1 for
	// a tier of quotas and no rate limit (quotaLimit), else 0.
	hidden int
	// limitTexts are the X-RateLimit-Limit of each limit, then of each
	// quota, by the binding one's place; of the slots, for a tier of
	// concurrency alone.
	limitTexts []string
	// costField is CostFromResponse in canonical form, as the response's
	// header map keys its fields and trailers.
	costField string
	// maxCost is the smallest capacity of the limits: the largest cost a
	// request can ever fit.
	maxCost int64
	// ban is the handler's ban (µs), which the tier's limit carries.
	ban int64
	// loc is the handler's time zone, and quotas the tier's quotas in it.
	loc    *time.Location
	quotas []bucket.Quota
	// maxWait is the tier's max_wait, or the handler's (µs).
	maxWait  int64
	waitTime prometheus.Observer
	inFlight prometheus.Gauge
	// concurrencyName is the in-flight limit's IETF item name, quoted.
	concurrencyName string
	cost            int64
	// Header values that do not change from request to request.
	policyText string
	quotedName string
	counters   *outcomeCounters
	// fallback is the tier as the on_store_error local fallback enforces
	// it, scaled by the share (fallback_share.go): the tier itself when
	// the share is whole. written is, on that scaled copy, the tier as
	// written, which the shared store enforces; nil on the tier itself.
	fallback *Tier
	written  *Tier
	// prefixes are the local store's hashes of the tier's bucket names
	// (Bucket.prefix) for each of the handler's keyers, in order, then
	// for its fallback IP keyer (Handler.keyerPrefixes).
	prefixes []uint64
}

// TierLimit is one limit of a tier: a bucket's capacity and refill.
type TierLimit struct {
	// Capacity is the bucket's size in tokens.
	Capacity int64 `json:"capacity"`
	// Refill is the rate at which tokens come back, such as 100/s or 10000/24h.
	Refill string `json:"refill"`
}

// tierContext is what a tier's check reads of its handler: the ban and
// the tier's max_wait (µs), and the time zone its quotas count in.
type tierContext struct {
	ban, maxWait int64
	loc          *time.Location
}

// tierSettings is what a tier's settings imply, worked out by check and
// applied once, at provision.
type tierSettings struct {
	tierContext
	cost, maxCost int64
	limits        []bucket.Limit
	quotas        []bucket.Quota
	hidden        int
	costField     string
}

// check checks the tier in its handler's context c, and works out what
// its settings imply, changing none. It needs no Caddy context, so the
// Caddyfile adapter runs it too, and a mistake fails `caddy adapt`.
func (t *Tier) check(c tierContext) (tierSettings, error) {
	ts := tierSettings{tierContext: c}
	if t.Name == "" {
		return ts, fmt.Errorf("a tier needs a name")
	}
	if err := checkTierName(t.Name); err != nil {
		return ts, err
	}
	for _, set := range t.MatcherSetsRaw {
		if len(set) == 0 {
			return ts, fmt.Errorf("tier %q: match: an empty matcher set would match every request; give a matcher, or drop the set", t.Name)
		}
	}
	if t.Unlimited && t.Deny {
		return ts, fmt.Errorf("tier %q: unlimited and deny exclude each other", t.Name)
	}
	if t.Unlimited || t.Deny {
		if t.Capacity != 0 || t.Refill != "" || t.Cost != 0 || len(t.Limits) > 0 || t.Concurrency != 0 || len(t.Quotas) > 0 {
			return ts, fmt.Errorf("tier %q: an unlimited or deny tier takes no capacity, refill, cost, quota or concurrency", t.Name)
		}
		return ts, nil
	}
	only, err := t.checkConcurrency()
	if err != nil {
		return ts, err
	}
	if only {
		// In-flight requests only: no bucket, no cost.
		return ts, t.checkKeyer()
	}
	ts.cost = cmp.Or(t.Cost, 1)
	if t.CostPlaceholder != "" {
		if t.Cost != 0 {
			return ts, fmt.Errorf("tier %q: give cost as a number or a placeholder, not both", t.Name)
		}
		if !strings.Contains(t.CostPlaceholder, "{") {
			return ts, fmt.Errorf("tier %q: cost %q: want a whole number, or a placeholder such as {http.request.header.X-Batch}", t.Name, t.CostPlaceholder)
		}
	}
	if err := t.checkLimits(&ts); err != nil {
		return ts, err
	}
	if err := t.checkQuotas(&ts); err != nil {
		return ts, err
	}
	if len(ts.limits) == 0 {
		if err := t.quotaLimit(&ts); err != nil {
			return ts, err
		}
	}
	ts.costField = http.CanonicalHeaderKey(t.CostFromResponse)
	return ts, t.checkKeyer()
}

// apply sets the tier up as its settings imply, once, at provision.
func (t *Tier) apply(ts tierSettings) {
	t.ban, t.maxWait, t.loc = ts.ban, ts.maxWait, ts.loc
	t.cost, t.maxCost, t.hidden, t.costField = ts.cost, ts.maxCost, ts.hidden, ts.costField
	t.limits, t.quotas, t.limit = ts.limits, ts.quotas, bucket.Limit{}
	if len(t.limits) > 0 {
		t.limit = t.limits[0]
	}
}

// checkConcurrency checks a tier's concurrency: a tier may have it
// beside its limits or quotas or instead of them, and then takes no cost.
func (t *Tier) checkConcurrency() (only bool, err error) {
	if t.Concurrency < 0 || t.Concurrency > math.MaxInt32 {
		return false, fmt.Errorf("tier %q: concurrency %d: must be from 1 to %d", t.Name, t.Concurrency, math.MaxInt32)
	}
	if t.Concurrency == 0 || t.limitCount() > 0 || len(t.Quotas) > 0 {
		return false, nil
	}
	if t.Cost != 0 || t.CostPlaceholder != "" || t.CostFromResponse != "" {
		return false, fmt.Errorf("tier %q: a tier with concurrency and no rate limit takes no cost; give it a rate limit or a quota to count", t.Name)
	}
	return true, nil
}

// checkKeyer checks the tier's keyer condition.
func (t *Tier) checkKeyer() error {
	switch t.Keyer {
	case "", "ip", "header", "cookie", "jwt", "form", "json", "placeholder":
	default:
		return fmt.Errorf("tier %q: keyer %q: want ip, header, cookie, jwt, form, json or placeholder", t.Name, t.Keyer)
	}
	return nil
}

// limitsWritten are the tier's limits as configured: Capacity and Refill
// first, when given, then Limits.
func (t *Tier) limitsWritten() []TierLimit {
	if t.Capacity != 0 || t.Refill != "" || len(t.Limits) == 0 {
		return append([]TierLimit{{Capacity: t.Capacity, Refill: t.Refill}}, t.Limits...)
	}
	return t.Limits
}

// limitCount is how many limits the tier has, as written.
func (t *Tier) limitCount() int {
	n := len(t.Limits)
	if t.Capacity != 0 || t.Refill != "" {
		n++
	}
	return n
}

// maxLimits bounds a tier's limits.
const maxLimits = 8

// checkLimits works out the tier's limits into ts: Capacity and Refill
// first, when given, then Limits. Each must hold the cost.
func (t *Tier) checkLimits(ts *tierSettings) error {
	if t.limitCount() == 0 {
		if len(t.Quotas) > 0 {
			// A plan of quotas alone: quotaLimit, once they are read.
			return nil
		}
		return fmt.Errorf("tier %q has no rate limit: give one such as `limit 100 10/s`, a quota or concurrency", t.Name)
	}
	shapes := t.limitsWritten()
	if len(shapes) > maxLimits {
		return fmt.Errorf("tier %q: %d limits: at most %d", t.Name, len(shapes), maxLimits)
	}
	for _, sh := range shapes {
		if sh.Capacity < 1 {
			return fmt.Errorf("tier %q: capacity %d: must be at least 1", t.Name, sh.Capacity)
		}
		if sh.Refill == "" {
			return fmt.Errorf("tier %q: a refill rate is required, such as 10/s", t.Name)
		}
		rate, err := bucket.ParseRate(sh.Refill)
		if err != nil {
			return fmt.Errorf("tier %q: %w", t.Name, err)
		}
		l := bucket.Limit{Capacity: sh.Capacity, Rate: rate, Ban: ts.ban, MaxWait: ts.maxWait}
		if err := l.Validate(ts.cost); err != nil {
			return fmt.Errorf("tier %q: %w", t.Name, err)
		}
		ts.limits = append(ts.limits, l)
	}
	ts.maxCost = ts.limits[0].Capacity
	for _, l := range ts.limits[1:] {
		ts.maxCost = min(ts.maxCost, l.Capacity)
	}
	return nil
}

// checkQuotas works out the tier's quotas into ts, each at least the
// tier's cost.
func (t *Tier) checkQuotas(ts *tierSettings) error {
	if len(t.Quotas) > bucket.MaxQuotas || len(t.Quotas)+len(ts.limits) > maxLimits {
		return fmt.Errorf("tier %q: %d quotas beside %d limits: at most %d quotas, and %d limits and quotas in all", t.Name, len(t.Quotas), len(ts.limits), bucket.MaxQuotas, maxLimits)
	}
	var seen [bucket.Year + 1]bool
	for _, s := range t.Quotas {
		q, err := bucket.ParseQuota(s, ts.loc)
		if err != nil {
			return fmt.Errorf("tier %q: %w", t.Name, err)
		}
		if seen[q.Period] {
			return fmt.Errorf("tier %q: quota %s: a second quota per %s; give one a period", t.Name, s, q.Period)
		}
		seen[q.Period] = true
		if q.N < ts.cost || t.CostPlaceholder != "" && q.N < ts.maxCost {
			return fmt.Errorf("tier %q: quota %s: smaller than a request's cost, which it could never admit", t.Name, s)
		}
		ts.quotas = append(ts.quotas, q)
	}
	return nil
}

// quotaLimit gives a tier of quotas and no rate limit the one limit every
// store's step needs: a bucket of the smallest quota's n that refills
// whole every microsecond. It never refuses what the quotas admit (within
// a microsecond, they admit no more than it holds), and, hidden, no
// header, placeholder or admin view shows it.
func (t *Tier) quotaLimit(ts *tierSettings) error {
	n := ts.quotas[0].N
	for _, q := range ts.quotas[1:] {
		n = min(n, q.N)
	}
	// No ban and no max_wait: a quota's refusal starts neither.
	l := bucket.Limit{Capacity: n, Rate: bucket.Rate{Tokens: n, Interval: 1}, Instant: true}
	if err := l.Validate(ts.cost); err != nil {
		return fmt.Errorf("tier %q: %w", t.Name, err)
	}
	ts.limits = append(ts.limits, l)
	ts.maxCost, ts.hidden = n, 1
	return nil
}

// checkTierName accepts names that the IETF headers can carry as a
// structured-field string (RFC 8941): printable ASCII, spaces included.
func checkTierName(name string) error {
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x20 || c > 0x7e {
			return fmt.Errorf("tier %q: the name may hold only printable ASCII characters, for the RateLimit-Policy header; byte %d is 0x%02x", name, i, c)
		}
	}
	return nil
}

// checkTimezone reads the time zone in which the tiers' quotas count.
func checkTimezone(tz string) (*time.Location, error) {
	if tz == "" {
		return time.UTC, nil
	}
	// "Local" is the machine's own zone, which nodes may not share.
	loc, err := time.LoadLocation(tz)
	if err != nil || tz == "Local" {
		return nil, fmt.Errorf("timezone %q: not a time zone of the IANA database, such as Europe/Berlin or America/New_York", tz)
	}
	return loc, nil
}

// statusSet is a set of response statuses, 100 to 599.
type statusSet [600]bool

// parseStatusSet reads codes ("401") and classes ("4xx").
func parseStatusSet(list []string) (*statusSet, error) {
	set := new(statusSet)
	for _, s := range list {
		if len(s) == 3 && s[0] >= '1' && s[0] <= '5' && (s[1:] == "xx" || s[1:] == "XX") {
			lo := int(s[0]-'0') * 100
			for c := lo; c < lo+100; c++ {
				set[c] = true
			}
			continue
		}
		code, err := strconv.Atoi(s)
		if err != nil || code < 100 || code > 599 {
			return nil, fmt.Errorf("count_status %q: want a status code from 100 to 599, such as 401, or a class such as 4xx", s)
		}
		set[code] = true
	}
	return set, nil
}

// checkLogin checks count_status and ban: the set of statuses that count
// (nil: every one), and the ban in µs.
func checkLogin(countStatus []string, ban caddy.Duration) (*statusSet, int64, error) {
	var counted *statusSet
	if countStatus != nil {
		if len(countStatus) == 0 {
			return nil, 0, errors.New("count_status: give one or more status codes or classes, such as 401 or 4xx")
		}
		set, err := parseStatusSet(countStatus)
		if err != nil {
			return nil, 0, err
		}
		counted = set
	}
	if ban < 0 {
		return nil, 0, fmt.Errorf("ban %s: must be above 0", time.Duration(ban))
	}
	return counted, time.Duration(ban).Microseconds(), nil
}

// checkWait checks max_wait, the handler's and each tier's, and
// max_waiting.
func checkWait(maxWait caddy.Duration, maxWaiting int, tiers []*Tier) error {
	if maxWait < 0 || maxWait > 0 && maxWait < caddy.Duration(time.Microsecond) {
		return fmt.Errorf("max_wait %s: must be at least 1µs", time.Duration(maxWait))
	}
	if maxWaiting < 0 {
		return fmt.Errorf("max_waiting %d: must be at least 1", maxWaiting)
	}
	for _, t := range tiers {
		if t.MaxWait < 0 || t.MaxWait > 0 && t.MaxWait < caddy.Duration(time.Microsecond) {
			return fmt.Errorf("tier %q: max_wait %s: must be at least 1µs", t.Name, time.Duration(t.MaxWait))
		}
	}
	return nil
}

// provision loads the tier's matchers and renders the header values that
// do not change from request to request; apply has set it up.
func (t *Tier) provision(ctx caddy.Context) error {
	if t.MatcherSetsRaw != nil {
		mods, err := ctx.LoadModule(t, "MatcherSetsRaw")
		if err != nil {
			return fmt.Errorf("tier %q: loading matchers: %v", t.Name, err)
		}
		if err := t.matchers.FromInterface(mods); err != nil {
			return fmt.Errorf("tier %q: %v", t.Name, err)
		}
	}
	t.quotedName = strconv.Quote(t.Name)
	t.fallback = t
	t.renderTexts()
	return nil
}

// renderTexts renders the header values of the tier's limits, quotas and
// concurrency, which do not change from request to request.
func (t *Tier) renderTexts() {
	if !t.Unlimited && !t.Deny {
		var items []string
		t.limitTexts = t.limitTexts[:0]
		for i, l := range t.limits {
			text := strconv.FormatInt(l.Capacity, 10)
			t.limitTexts = append(t.limitTexts, text)
			if i < t.hidden {
				continue
			}
			window := bucket.CeilDiv(l.Units(), l.Rate.Tokens*1e6)
			items = append(items, t.itemName(i)+";q="+text+";w="+strconv.FormatInt(window, 10))
		}
		for _, q := range t.quotas {
			t.limitTexts = append(t.limitTexts, strconv.FormatInt(q.N, 10))
		}
		if t.Concurrency > 0 {
			t.concurrencyName = strconv.Quote(t.Name + "-concurrency")
			items = append(items, t.concurrencyName+";q="+strconv.FormatInt(t.Concurrency, 10)+`;qu="concurrent-requests"`)
			if len(t.limits) == 0 {
				// Only in-flight requests: the X- fields report them.
				t.limitTexts = append(t.limitTexts, strconv.FormatInt(t.Concurrency, 10))
			}
		}
		t.policyText = strings.Join(items, ", ")
	}
}

// asWritten is the tier as written: the one the shared store enforces,
// also when t is the fallback's scaled copy of it.
func (t *Tier) asWritten() *Tier {
	if t.written != nil {
		return t.written
	}
	return t
}

// shape is the tier's shape as every store call takes it: its limits,
// then its quotas, in the slices provisioned once.
func (t *Tier) shape() bucket.Tier { return bucket.Tier{Limits: t.limits, Quotas: t.quotas} }

// itemName is limit i's name in the IETF headers: "<tier>", then
// "<tier>-2", "<tier>-3"...
func (t *Tier) itemName(i int) string {
	if i == 0 {
		return t.quotedName
	}
	return strconv.Quote(t.Name + "-" + strconv.Itoa(i+1))
}

// catchAll reports whether the tier has no conditions.
func (t *Tier) catchAll() bool {
	return len(t.MatcherSetsRaw) == 0 && t.Keyer == "" && len(t.Claims) == 0
}

// applies reports whether the tier's conditions all hold for a client named
// by a keyer of kind keyerKind, with verified claims (none without a JWT).
// The claims are read only when the tier has a claim condition.
func (t *Tier) applies(r *http.Request, keyerKind string, claims Claims) (bool, error) {
	if t.Keyer != "" && t.Keyer != keyerKind {
		return false, nil
	}
	if len(t.Claims) > 0 && !claimsHoldAll(claims, t.Claims) {
		return false, nil
	}
	if len(t.matchers) > 0 {
		return t.matchers.AnyMatchWithError(r)
	}
	return true, nil
}
