package ratelimit

import (
	"errors"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// decision is one request's passage through the handler. It answers the
// placeholders, lazily, for as long as the request's replacer lives.
type decision struct {
	handler *Handler
	// later is the decision of the next rate_limit handler the request
	// went through, on a route that stacks several (placeholder).
	later   *decision
	start   time.Time
	tier    *Tier
	bucket  Bucket
	claims  requestClaims
	result  bucket.Result
	outcome outcome
	// refusedBy marks a request refused for other than its tokens.
	refusedBy refusal
	// binding is the limit the X- headers report, of several.
	binding  uint8
	slotFrom slotSource
	slotLeft int32
	// took is the store the tokens came from, for count_status.
	took store
	// cost is what this request takes: the tier's, or its placeholder's.
	cost int64
	// each holds each limit's and quota's result, for a tier of several
	// (parts).
	each *[maxLimits]bucket.Result
	// slotID is the in-flight slot the request holds (concurrency), in
	// the store slotFrom says, with slotLeft left after it.
	slotID uint64
	// value holds a short client value without another allocation.
	value [64]byte
	// The response's header values, rendered once into text.
	resp  headerValues
	retry [1]string
	text  [88]byte
}

// refusal is why a request was refused, when not for its tokens.
type refusal uint8

const (
	// refusedWaiting: max_waiting requests of the policy already wait.
	refusedWaiting refusal = iota + 1
	// refusedNoSlot: concurrency requests of the client are in flight.
	refusedNoSlot
)

// outcome is what the handler decided for a request.
type outcome uint8

const (
	outcomeAllowed outcome = iota
	outcomeDenied
	outcomeDryRun
	outcomeUnlimited
	outcomeError
	outcomeCount
)

// String is the outcome as the {http.rate_limit.decision} placeholder and
// the metrics' decision label show it.
func (o outcome) String() string {
	return [outcomeCount]string{"allowed", "denied", "dry_run", "unlimited", "error"}[o]
}

// parts are the request's results, each limit's then each quota's, where
// the store writes them: for a tier of one limit, the decision's result
// itself, so that the common case needs no array of its own.
func (d *decision) parts() []bucket.Result {
	switch n := d.tier.shape().Parts(); n {
	case 0:
		return nil
	case 1:
		return unsafe.Slice(&d.result, 1)
	default:
		if d.each == nil {
			d.each = new([maxLimits]bucket.Result)
		}
		return d.each[:n]
	}
}

// decide records the outcome and counts it.
func (d *decision) decide(o outcome) {
	d.outcome = o
	d.tier.counters[o].Inc()
}

// headerValues are the limit headers of one response, or of one request
// with upstream_headers. Each message owns its slices, because a later
// handler (a deferred `header` replace) may edit them in place; the strings
// themselves are immutable and may be shared. A nil entry is not sent.
type headerValues struct {
	limit, remaining, reset, policy, ietf [1]string
}

// setHeaders writes the limit headers into hdr: the response's or, with
// upstream_headers, the request's.
func (h *Handler) setHeaders(hdr http.Header, v *headerValues) {
	if h.xHeaders {
		hdr["X-Ratelimit-Limit"] = v.limit[:]
		hdr["X-Ratelimit-Remaining"] = v.remaining[:]
		hdr["X-Ratelimit-Reset"] = v.reset[:]
	}
	if h.ietfHeaders {
		hdr["Ratelimit-Policy"] = v.policy[:]
		hdr["Ratelimit"] = v.ietf[:]
	}
}

// render writes the header values for the decision's result once, into the
// decision itself, so that headers cost no allocation of their own.
func (h *Handler) render(d *decision) {
	buf := d.text[:0]
	var at [3]int // where the x values and Retry-After end
	if h.xHeaders {
		buf = strconv.AppendInt(buf, d.goingOn(int(d.binding), d.result).Remaining, 10)
		at[0] = len(buf)
		buf = strconv.AppendInt(buf, d.resetEpoch(), 10)
		at[1] = len(buf)
	}
	if !d.result.Allowed {
		buf = strconv.AppendInt(buf, d.retryAfterSeconds(), 10)
	}
	at[2] = len(buf)
	if h.ietfHeaders {
		buf = d.appendIETF(buf)
	}
	// The strings share the decision's memory, which nothing writes again,
	// and which the strings keep alive.
	text := unsafe.String(unsafe.SliceData(buf), len(buf))
	v := &d.resp
	if h.xHeaders {
		v.limit[0] = d.tier.limitTexts[d.binding]
		v.remaining[0] = text[:at[0]]
		v.reset[0] = text[at[0]:at[1]]
	}
	d.retry[0] = text[at[1]:at[2]]
	if h.ietfHeaders {
		v.policy[0] = d.tier.policyText
		if len(d.tier.quotas) > 0 {
			// A quota's window is its period's length, which changes.
			v.policy[0] = string(d.appendQuotaPolicy([]byte(d.tier.policyText), d.start.UnixMicro()+d.result.Wait))
		}
		v.ietf[0] = text[at[2]:]
	}
}

// limitHeaderNames are the headers setHeaders may write, in canonical form.
var limitHeaderNames = []string{"X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset", "Ratelimit-Policy", "Ratelimit"}

const placeholderPrefix = "http.rate_limit."

// decisionRef is the placeholder name under which the first rate_limit
// handler of a request answers its decision, for the later ones to find:
// a Caddyfile cannot name it.
const decisionRef = "\x00decision"

// placeholder answers the request's rate_limit placeholders: from the
// decision of the last rate_limit handler the request went through, when
// several are stacked on its route, which is the one that refused it if
// one did.
func (d *decision) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	if name == decisionRef {
		return d, true
	}
	for d.later != nil {
		d = d.later
	}
	if claim, ok := strings.CutPrefix(name, "claim."); ok {
		return strings.Join(d.claims.Claim(claim), ","), true
	}
	switch name {
	case "policy":
		return d.handler.Name, true
	case "decision":
		if d.tier == nil {
			return "", true
		}
		return d.outcome.String(), true
	}
	if d.tier == nil {
		return "", true
	}
	switch name {
	case "tier":
		return d.tier.Name, true
	case "key_id":
		return d.keyID(), true
	case "waited":
		// The wait of an allowed request is the one it waited.
		return (d.result.Wait + 500) / 1000, true
	}
	if d.tier.Unlimited || d.tier.Deny || d.outcome == outcomeError && d.result == (bucket.Result{}) {
		return "", true
	}
	switch name {
	case "limit":
		// The limit the X- headers report: with several, the binding one.
		if len(d.tier.limits) == 0 {
			// Only in-flight requests: the X- fields report the slots.
			return d.tier.Concurrency, true
		}
		if j := int(d.binding) - len(d.tier.limits); j >= 0 {
			return d.tier.quotas[j].N, true
		}
		return d.tier.limits[d.binding].Capacity, true
	case "remaining":
		return d.goingOn(int(d.binding), d.result).Remaining, true
	case "reset":
		return d.resetEpoch(), true
	case "retry_after":
		if d.result.Allowed {
			return 0, true
		}
		return d.retryAfterSeconds(), true
	}
	return nil, false
}

// keyID is a fingerprint of the client's key, for logs: the first 8 bytes
// of the bucket's digest. It is stable across nodes, so that logs can be
// joined, and never shows the value itself.
func (d *decision) keyID() string { return keyID(&d.bucket) }

// resetEpoch is the Unix second at which the bucket is full again.
func (d *decision) resetEpoch() int64 {
	return secondsUp(d.start.UnixMicro() + d.result.Wait + d.goingOn(int(d.binding), d.result).ResetAfter)
}

// goingOn is result r of the tier's i-th limit (or, past the limits, its
// quota) as it stands when the request goes on, after it waited for its
// tokens (max_wait): the store answered at the decision, d.start, and the
// headers go out Wait later. Its reset counts from then; a quota whose
// period ended meanwhile speaks of the next period, which did not count
// the request (the one before did), so all of it is left.
func (d *decision) goingOn(i int, r bucket.Result) bucket.Result {
	if d.result.Wait == 0 {
		// Most requests: inlined, nothing to do.
		return r
	}
	return d.afterWait(i, r)
}

// afterWait is goingOn for a request that waited.
func (d *decision) afterWait(i int, r bucket.Result) bucket.Result {
	w := d.result.Wait
	if j := i - len(d.tier.limits); j >= 0 && r.ResetAfter <= w {
		q, at := d.tier.quotas[j], d.start.UnixMicro()+w
		_, end := q.Bounds(at)
		return bucket.Result{Allowed: r.Allowed, Remaining: q.N, ResetAfter: end - at}
	}
	r.ResetAfter = max(0, r.ResetAfter-w)
	return r
}

// retryAfterSeconds is Retry-After: whole seconds, at least 1.
func (d *decision) retryAfterSeconds() int64 {
	return max(1, secondsUp(d.result.RetryAfter))
}

func secondsUp(micros int64) int64 { return bucket.CeilDiv(micros, 1e6) }

// errLimited is the error behind a rejection, for Caddy's error handling.
var errLimited = errors.New("rate limit exceeded")

// errDenyTier is the error behind a deny tier's 403.
var errDenyTier = errors.New("client is on a deny tier")

// errNoKey is the error behind no_key deny's 400.
var errNoKey = errors.New("no keyer named the client")

// rejection is the error for a request this handler refuses: the
// caddyhttp.HandlerError that caddyhttp.Error makes, so that handle_errors
// and the {http.error.*} placeholders see what they expect. Its ID and
// trace are filled in here, because caddyhttp.Error finds and formats its
// caller's file and line with runtime.Caller on every call: under a flood
// of denials that was the handler's largest cost (bench/README.md). The
// place is always this one, so the trace is a constant.
func rejection(status int, err error) error {
	return caddyhttp.Error(status, caddyhttp.HandlerError{StatusCode: status, Err: err, ID: errorID(), Trace: rejectionTrace})
}

const rejectionTrace = "ratelimit.rejection (decision.go)"

// storeUnavailable answers 503 with Retry-After: 1 for a store that could
// not decide; the store failure is the handler's own sampled warn line
// (storeFailed).
func storeUnavailable(w http.ResponseWriter, r *http.Request, err error) error {
	w.Header()["Retry-After"] = []string{"1"}
	return refuse(w, r, http.StatusServiceUnavailable, err)
}

// refuse answers a refusal of status. Caddy logs a handler's 5xx error at
// error level, once a request, unsampled and with the request's headers
// (an API key among them), unless handle_errors routes take it, when it
// logs it at debug. A flood of refusals (a dead store, or denials with
// `status 503`) would fill the log with clients' keys, so a 5xx goes to
// handle_errors only where the server has some, to shape it as any other
// error; elsewhere it is written here, empty, as Caddy would write it. A
// 4xx goes through Caddy's error path, which logs it at debug.
func refuse(w http.ResponseWriter, r *http.Request, status int, err error) error {
	if status < 500 || errorRoutes(r) {
		return rejection(status, err)
	}
	w.WriteHeader(status)
	return nil
}

// errorRoutes says whether r's server has handle_errors routes to take an
// error of r's: not when r is in them already, where an error would be the
// error routes' own failure, which Caddy logs at error level.
func errorRoutes(r *http.Request) bool {
	srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil || srv.Errors == nil || len(srv.Errors.Routes) == 0 {
		return false
	}
	_, handling := r.Context().Value(caddyhttp.ErrorCtxKey).(error)
	return !handling
}

// errorID is a random error ID in caddyhttp's own form, 9 characters from
// its 32-letter alphabet, from one random number.
func errorID() string {
	const alphabet = "abcdefghijkmnpqrstuvwxyz23456789"
	var id [9]byte
	n := rand.Uint64()
	for i := range id {
		id[i] = alphabet[n&31]
		n >>= 5
	}
	return string(id[:])
}

// appendIETF appends the RateLimit field: one item per limit shown, per
// quota, and for the in-flight limit.
func (d *decision) appendIETF(buf []byte) []byte {
	start := len(buf)
	parts := d.parts()
	for i := d.tier.hidden; i < len(d.tier.limits); i++ {
		buf = appendSeparator(buf, start)
		buf = appendIETFItem(buf, d.tier.itemName(i), d.goingOn(i, parts[i]))
	}
	buf = d.appendQuotaItems(buf, start)
	if d.tier.Concurrency > 0 {
		buf = d.appendConcurrencyItem(buf, start)
	}
	return buf
}

// appendSeparator appends the ", " before an item of the list that starts
// at start of buf, unless it is the first.
func appendSeparator(buf []byte, start int) []byte {
	if len(buf) > start {
		buf = append(buf, ", "...)
	}
	return buf
}

func appendIETFItem(buf []byte, name string, r bucket.Result) []byte {
	buf = append(buf, name...)
	buf = append(buf, ";r="...)
	buf = strconv.AppendInt(buf, r.Remaining, 10)
	buf = append(buf, ";t="...)
	return strconv.AppendInt(buf, secondsUp(r.ResetAfter), 10)
}

// newDecision starts the decision on r, and answers r's rate_limit
// placeholders from it.
func (h *Handler) newDecision(r *http.Request) *decision {
	d := &decision{handler: h, start: time.Now()}
	d.claims = requestClaims{jwt: h.JWT, r: r}
	if h.UpstreamHeaders {
		// Later handlers trust these, so a client may not send its own.
		for _, name := range limitHeaderNames {
			delete(r.Header, name)
		}
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		// Only the first handler of the request answers the placeholders,
		// since Caddy asks its providers in order: it answers from this
		// decision, the latest.
		if v, ok := repl.Get(placeholderPrefix + decisionRef); ok {
			first := v.(*decision)
			for first.later != nil {
				first = first.later
			}
			first.later = d
		} else {
			repl.Map(d.placeholder)
		}
	}
	return d
}

// refuseDenyTier answers a client on a deny tier: 403.
func (h *Handler) refuseDenyTier(d *decision) error {
	d.decide(outcomeDenied)
	h.logDecision(d, "client on a deny tier", "")
	return rejection(http.StatusForbidden, errDenyTier)
}

// refuseNoKey applies no_key deny: 400, and the body reaches nobody. The
// decision is counted and logged as a denial on the request's tier, with
// the client IP's key id, so that logs show who sends unkeyable requests.
func (h *Handler) refuseNoKey(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision) error {
	o, msg := outcomeDenied, "no keyer named the client"
	if h.DryRun {
		o, msg = outcomeDryRun, "no keyer named the client (dry run: let through)"
	}
	d.decide(o)
	h.logDecision(d, msg, "")
	if h.DryRun {
		return next.ServeHTTP(w, r)
	}
	return rejection(http.StatusBadRequest, errNoKey)
}

// answer sets the headers for the store's answer, and passes the request
// on, to be settled after the response, or rejects it.
func (h *Handler) answer(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, res bucket.Result) error {
	if res.Allowed && res.Wait > 0 {
		var err error
		if res, err = h.await(r, d, res); err != nil {
			return h.clientGone(w, d, outcomeAllowed)
		}
	}
	if res.Allowed && d.tier.Concurrency > 0 {
		var err error
		if res, err = h.acquireSlot(r, d, res); errors.Is(err, errClientGone) {
			return h.clientGone(w, d, outcomeAllowed)
		} else if err != nil {
			return h.storeDown(w, r, d, err)
		}
		if len(d.tier.limits) == 0 && d.slotFrom != noSlot {
			// Only in-flight requests: the X- fields report the slots.
			res.Remaining = int64(d.slotLeft)
		}
	}
	d.result = res
	h.render(d)
	h.setHeaders(w.Header(), &d.resp)
	if res.Allowed {
		d.decide(outcomeAllowed)
	} else {
		if !h.DryRun {
			w.Header()["Retry-After"] = d.retry[:]
		}
		o, msg := outcomeDenied, "rate limited"
		switch d.refusedBy {
		case refusedNoSlot:
			msg = "rate limited: concurrency requests of the client already in flight"
		case refusedWaiting:
			msg = "rate limited: max_waiting requests of the policy already wait"
		}
		if h.DryRun {
			o, msg = outcomeDryRun, "rate limited (dry run: let through)"
		}
		d.decide(o)
		if res.Banned {
			bansTotal.WithLabelValues(h.Name, d.tier.Name).Inc()
		}
		if !h.DryRun {
			h.noteDenial(d)
		}
		h.logDecision(d, msg, d.retry[0])
		if !h.DryRun {
			err := errLimited
			switch d.refusedBy {
			case refusedNoSlot:
				err = errNoSlot
			case refusedWaiting:
				err = errTooManyWaiting
			}
			return refuse(w, r, h.Status, err)
		}
	}
	if h.UpstreamHeaders {
		// The request gets its own slices: nothing edits one message's
		// values through the other's.
		upstream := d.resp
		h.setHeaders(r.Header, &upstream)
	}
	if !res.Allowed || h.counted == nil && d.tier.CostFromResponse == "" && d.slotFrom == noSlot {
		return next.ServeHTTP(w, r)
	}
	return h.serveAndSettle(w, r, next, d)
}

// logDecision writes the decision's debug line: msg, the policy, the tier,
// the client's key id and, for a refusal, its Retry-After.
func (h *Handler) logDecision(d *decision, msg, retryAfter string) {
	ce := h.logger.Check(zapcore.DebugLevel, msg)
	if ce == nil {
		return
	}
	if retryAfter == "" {
		ce.Write(zap.String("policy", h.Name), zap.String("tier", d.tier.Name), zap.String("key_id", d.keyID()))
		return
	}
	ce.Write(zap.String("policy", h.Name), zap.String("tier", d.tier.Name), zap.String("key_id", d.keyID()), zap.String("retry_after", retryAfter))
}
