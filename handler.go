package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// One request's passage through the handler, in the order it runs:
// ServeHTTP names the client, chooses the tier and reads the cost, takes
// from the bucket (or, when the store fails, applies on_store_error), then
// answers: it waits for tokens due soon (max_wait), takes an in-flight
// slot (concurrency), sets the headers and refuses the request, or passes
// it on and settles its tokens after the response (count_status,
// cost_from_response) and frees its slot. The collaborators are reached
// through their types: keyers.go, tiers.go, stores.go, headers.go,
// placeholders.go, registry.go.

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

// decide records the outcome and counts it.
func (d *decision) decide(o outcome) {
	d.outcome = o
	d.tier.counters[o].Inc()
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

// ServeHTTP limits the request: it names the client, chooses the tier,
// reads the cost, takes from the bucket, and then passes the request on
// with the limit's headers, settling its tokens after the response, or
// rejects it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	d := h.newDecision(r)
	keyer, place := h.nameClient(r, d)
	if err := h.chooseTier(r, d, keyer, place); err != nil {
		return err
	}
	switch {
	case d.tier.Unlimited:
		d.decide(outcomeUnlimited)
		return next.ServeHTTP(w, r)
	case d.tier.Deny:
		return h.refuseDenyTier(d)
	case h.noKeyDeny && keyer == h.fallback:
		return h.refuseNoKey(w, r, next, d)
	}
	if err := d.readCost(r); err != nil {
		return err
	}
	// The request's one reading of the clocks: the moment of the decision
	// (d.start), at which the local store decides it (LocalStore.takeAt),
	// and the start of the store's time.
	d.start = time.Now()
	res, err := d.take(r.Context(), h.store, d.start)
	if h.storeTime != nil {
		h.storeTime.Observe(time.Since(d.start).Seconds())
	}
	if err != nil {
		return h.fallBack(w, r, next, d, err)
	}
	if h.owed != nil {
		h.owed.storeAnswered()
	}
	return h.answer(w, r, next, d, res)
}

// newDecision starts the decision on r, and answers r's rate_limit
// placeholders from it. Its moment (start) is read just before the take,
// or when a request is refused without one (no_key deny, a bad cost).
func (h *Handler) newDecision(r *http.Request) *decision {
	d := &decision{handler: h}
	d.claims = requestClaims{jwt: h.JWT, r: r}
	if h.UpstreamHeaders {
		// Later handlers trust these, so a client may not send its own.
		for _, name := range limitHeaderNames {
			delete(r.Header, name)
		}
	}
	d.provide(r)
	return d
}

// nameClient asks the keyers in order: the first that yields a value names
// the client, and is returned with its place among them; when none does,
// the client IP does, through h.fallback, whose place is after them.
func (h *Handler) nameClient(r *http.Request, d *decision) (Keyer, int) {
	value := d.value[:0]
	for i, k := range h.keyers {
		if v, ok := keyWith(k, r, value, &d.claims); ok && len(v) > 0 {
			d.bucket.Value = v
			return k, i
		}
	}
	d.bucket.Value = h.fallback.fallbackKey(r, value)
	return h.fallback, len(h.keyers)
}

// chooseTier picks the request's tier, for a client keyer named, at place
// among the handler's keyers (nameClient), and names its bucket.
func (h *Handler) chooseTier(r *http.Request, d *decision, keyer Keyer, place int) error {
	tier, err := h.tierFor(r, keyer.Kind(), &d.claims)
	if err != nil {
		return err
	}
	d.tier = tier
	d.bucket = Bucket{Policy: h.Name, Tier: tier.Name, Keyer: keyer.ID(), Value: d.bucket.Value, secret: h.keySecret}
	if place < len(tier.prefixes) {
		d.bucket.prefix = tier.prefixes[place]
	}
	return nil
}

// tierFor returns the first tier whose conditions hold.
func (h *Handler) tierFor(r *http.Request, keyerKind string, claims Claims) (*Tier, error) {
	for _, t := range h.Tiers {
		ok, err := t.applies(r, keyerKind, claims)
		if err != nil {
			return nil, caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("tier %q: %w", t.Name, err))
		}
		if ok {
			return t, nil
		}
	}
	// Unreachable: check guarantees a catch-all tier.
	return h.Tiers[len(h.Tiers)-1], nil
}

// errDenyTier is the error behind a deny tier's 403.
var errDenyTier = errors.New("client is on a deny tier")

// refuseDenyTier answers a client on a deny tier: 403.
func (h *Handler) refuseDenyTier(d *decision) error {
	d.decide(outcomeDenied)
	h.logDecision(d, "client on a deny tier", "")
	return rejection(http.StatusForbidden, errDenyTier)
}

// errNoKey is the error behind no_key deny's 400.
var errNoKey = errors.New("no keyer named the client")

// refuseNoKey applies no_key deny: 400, and the body reaches nobody. The
// decision is counted and logged as a denial on the request's tier, with
// the client IP's key id, so that logs show who sends unkeyable requests.
func (h *Handler) refuseNoKey(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision) error {
	d.start = time.Now() // the placeholders' reset counts from it
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
		d.start = time.Now() // the placeholders' reset counts from it
		d.decide(outcomeDenied)
		return rejection(http.StatusBadRequest, errBadCost)
	}
	d.cost = n
	return nil
}

// take applies the request to its bucket in s: every limit and quota of
// its tier in one step. A cost of 0 takes nothing, and is allowed unless
// the bucket is banned or in debt. The result is the binding one's
// (bucket.Binding): of the limits and quotas, the one with the least
// remaining or, refused, the one that makes the client wait longest; its
// Wait is the longest of the limits'. A local store decides at the moment
// at, when it is set, if its table reads the process's clocks: the
// handler read them already (LocalStore.takeAt).
func (d *decision) take(ctx context.Context, s store, at time.Time) (bucket.Result, error) {
	d.took = s
	out := d.parts()
	if len(out) == 0 {
		// Only in-flight requests: the slot decides.
		return bucket.Result{Allowed: true}, nil
	}
	var allowed bool
	var err error
	if ls, ok := s.(*LocalStore); ok && !at.IsZero() {
		allowed = ls.takeAt(&d.bucket, d.tier.shape(), d.cost, out, at)
	} else {
		allowed, err = s.take(ctx, &d.bucket, d.tier.shape(), d.cost, out)
	}
	if err != nil {
		// Nothing was decided, whatever the store wrote.
		d.result = bucket.Result{}
		return bucket.Result{}, err
	}
	// A hidden limit (quotaLimit) never binds.
	hidden := d.tier.hidden
	d.binding = uint8(hidden + bucket.Binding(out[hidden:], allowed))
	res := out[d.binding]
	res.Allowed = allowed
	for _, r := range out[:len(d.tier.limits)] {
		res.Wait = max(res.Wait, r.Wait)
	}
	return res, nil
}

// fallBack applies on_store_error to a store that failed to decide the
// request: it lets the request through undecided (allow), refuses it with
// 503 (deny), or decides it with this node's own buckets (local).
func (h *Handler) fallBack(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, err error) error {
	if r.Context().Err() != nil {
		// The client went away while the store decided: no store failed.
		return h.clientGone(w, d, outcomeError)
	}
	switch h.onStoreError(err, "rate limit store failed", h.DryRun) {
	case goOnUndecided:
		d.decide(outcomeError)
		return next.ServeHTTP(w, r)
	case refuseUndecided:
		return h.storeDown(w, r, d)
	}
	// On the tier as the fallback enforces it (its share), at its own
	// moment: the failed call may have taken its timeout.
	d.tier = d.tier.fallback
	res, _ := d.take(r.Context(), h.local, time.Time{})
	if h.owed != nil && res.Allowed {
		h.owed.add(&d.bucket, d.tier, d.cost)
	}
	return h.answer(w, r, next, d, res)
}

// storeFallback is what on_store_error makes of a store's failure.
type storeFallback uint8

const (
	// useLocal decides with this node's own buckets (local).
	useLocal storeFallback = iota
	// goOnUndecided lets the request through (allow; deny in a dry run,
	// which never refuses).
	goOnUndecided
	// refuseUndecided answers 503 (deny).
	refuseUndecided
)

// onStoreError counts and logs a store's failure, msg saying what failed,
// and says what on_store_error makes of it.
func (h *Handler) onStoreError(err error, msg string, dryRun bool) storeFallback {
	h.storeErrors.Inc()
	h.storeLog.Warn(msg, zap.String("policy", h.Name), zap.String("on_store_error", h.OnStoreError), zap.Error(err))
	switch h.OnStoreError {
	case "allow":
		return goOnUndecided
	case "deny":
		if dryRun {
			return goOnUndecided
		}
		return refuseUndecided
	}
	return useLocal
}

// storeDown refuses a request that the store could not decide, with
// on_store_error deny: 503 with Retry-After: 1. Nothing was decided, so
// its placeholders are empty, whatever the rate limit allowed before; the
// store's failure is the handler's own sampled warn line (onStoreError).
func (h *Handler) storeDown(w http.ResponseWriter, r *http.Request, d *decision) error {
	d.result = bucket.Result{}
	d.decide(outcomeError)
	w.Header()["Retry-After"] = []string{"1"}
	return refuse(w, r, http.StatusServiceUnavailable, errStoreUnavailable)
}

// errStoreUnavailable is the error of a request refused because its store
// failed ({http.error.message}, which a handle_errors page may show the
// client): what failed, and where, is in the line onStoreError logs.
var errStoreUnavailable = errors.New("rate limit store unavailable")

// clientGone answers a request whose client went away before it was
// answered: as reverse_proxy does, the access log gets 499 (client closed
// request).
func (h *Handler) clientGone(w http.ResponseWriter, d *decision, o outcome) error {
	d.decide(o)
	w.WriteHeader(499)
	return nil
}

// answer goes on from the store's answer: an allowed request waits for
// tokens due soon (await) and takes an in-flight slot (acquireSlot), and
// then respond answers it.
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
			return h.storeDown(w, r, d)
		}
		if len(d.tier.limits) == 0 && d.slotFrom != noSlot {
			// Only in-flight requests: the X- fields report the slots.
			res.Remaining = int64(d.slotLeft)
		}
	}
	return h.respond(w, r, next, d, res)
}

// Waiting (max_wait): a request whose tokens are due within max_wait took
// them at once; it waits until they are due, then goes on. The store
// decided it, in the same step as any take; the handler only waits, on a
// timer, holding no lock, no store shard and no connection.

// defaultMaxWaiting bounds the requests of one policy that wait at once on
// a node, when max_waiting does not say.
const defaultMaxWaiting = 10000

// waiters counts each policy's waiting requests on this node: handlers of
// one policy (its routes, and the configs of a reload) share the bound.
var waiters sync.Map // policy name -> *atomic.Int64

func waitersFor(policy string) *atomic.Int64 {
	n, _ := waiters.LoadOrStore(policy, new(atomic.Int64))
	return n.(*atomic.Int64)
}

// errTooManyWaiting is the error behind the refusal of a request that
// would wait while max_waiting requests of its policy already do.
var errTooManyWaiting = errors.New("too many requests of this policy are waiting (max_waiting)")

// await holds an allowed request until its tokens are due. A request that
// would be one waiter too many is refused at once, and one whose client
// goes away gives its tokens back: either way, the tokens it took go back.
// It returns the result to answer with, or the client's error, for
// clientGone.
func (h *Handler) await(r *http.Request, d *decision, res bucket.Result) (bucket.Result, error) {
	if h.DryRun {
		// A dry run changes no request's timing.
		res.Wait = 0
		return res, nil
	}
	d.result = res // what giveBackTaken gives back from
	if !h.enterWaiting() {
		h.giveBackTaken(r, d, "max_waiting")
		d.refusedBy = refusedWaiting
		return bucket.Result{Remaining: res.Remaining, RetryAfter: res.Wait, ResetAfter: res.ResetAfter}, nil
	}
	defer h.waiting.Add(-1)
	timer := time.NewTimer(time.Duration(res.Wait) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		d.tier.waitTime.Observe(float64(res.Wait) / 1e6)
		// The results still speak from the decision, which a give-back
		// names its quota period by; the headers from when the request
		// goes on (decision.goingOn).
		return res, nil
	case <-r.Context().Done():
		h.giveBackTaken(r, d, "client gone")
		h.logDecision(d, "client went away while waiting; tokens given back", "")
		return res, r.Context().Err()
	}
}

// enterWaiting counts one more waiter, unless max_waiting already wait:
// the count never passes the bound, not even for a moment.
func (h *Handler) enterWaiting() bool {
	for {
		n := h.waiting.Load()
		if n >= int64(h.maxWaiting) {
			return false
		}
		if h.waiting.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// In-flight slots (concurrency): a tier lets at most n of one client's
// requests be in flight, from when rate_limit passes the request on until
// the handlers after it return. A request takes its rate tokens first,
// then a slot; refused a slot, it gives its tokens back, so that it takes
// all or nothing. The slot is freed on every path, panics included
// (serveAndSettle).

// slotSource is where a request's slot is held, to free it there.
type slotSource uint8

const (
	noSlot slotSource = iota
	// slotInStore: the policy's store.
	slotInStore
	// slotInLocal: this node's count, while the store failed
	// (on_store_error local).
	slotInLocal
	// slotInRunningStore and slotInRunningLocal: the same two, in their
	// order, of the running config, for a request of a config that a
	// reload unloaded (liveSlots); runningSlotOwners says which config.
	slotInRunningStore
	slotInRunningLocal
)

// runningSlotOwners holds, for a request whose slot is in a running
// config's store (slotInRunning...), that config's handler, by decision:
// kept off the decision, whose size sits at an allocation class's edge,
// for a case that only a reload makes.
var runningSlotOwners sync.Map // *decision -> *Handler

// errNoSlot is the error behind the refusal of a request whose client has
// n requests in flight already.
var errNoSlot = errors.New("too many requests of this client in flight (concurrency)")

// acquireSlot takes a slot for an allowed request of a tier with
// concurrency. Refused, the request gives back the rate tokens it took and
// is answered with Retry-After: 1. A store that fails is answered as
// on_store_error says; with local, this node counts alone.
func (h *Handler) acquireSlot(r *http.Request, d *decision, res bucket.Result) (bucket.Result, error) {
	n := d.tier.asWritten().Concurrency
	d.result = res // what giveBackTaken gives back from
	from, owner := slotInStore, h
	slot, inUse, ok, err := h.store.acquire(r.Context(), &d.bucket, n)
	if errors.Is(err, errSlotsUnloaded) {
		// Each config tried is left out of the next look, should a second
		// reload close the one found too.
		for tried := []*Handler{h}; errors.Is(err, errSlotsUnloaded); tried = append(tried, owner) {
			if owner, n = liveSlots(h.Name, d.tier.Name, tried); owner == nil {
				// No running config of the policy counts this tier's
				// requests in flight (the reload took its concurrency
				// away, or the policy stopped): nothing limits the request.
				return res, nil
			}
			slot, inUse, ok, err = owner.store.acquire(r.Context(), &d.bucket, n)
		}
	}
	if err != nil && r.Context().Err() != nil {
		// The client went away: no store failed.
		h.giveBackTaken(r, d, "client gone")
		return res, errClientGone
	}
	if err != nil {
		// As the config that holds the slot says: its fallback is where
		// releaseSlot frees it.
		switch owner.onStoreError(err, "rate limit store failed to count requests in flight", h.DryRun) {
		case goOnUndecided:
			// Without a slot.
			return res, nil
		case refuseUndecided:
			h.giveBackTaken(r, d, "store failed")
			return res, err
		}
		from = slotInLocal
		n = owner.share.count(n, 1) // the fallback's share of it
		if owner == h && len(d.tier.limits) == 0 {
			// Only in-flight requests: the headers report the fallback's.
			d.tier = d.tier.fallback
		}
		slot, inUse, ok, _ = owner.local.acquire(r.Context(), &d.bucket, n)
	}
	if !ok {
		d.refusedBy = refusedNoSlot
		// Wait: it may have waited for its tokens first (goingOn).
		refused := bucket.Result{Remaining: res.Remaining, RetryAfter: 1e6, ResetAfter: res.ResetAfter, Wait: res.Wait}
		if h.DryRun {
			// Let through, as a dry run does, with the tokens it took.
			return refused, nil
		}
		h.giveBackTaken(r, d, "concurrency")
		d.untake()
		refused.Remaining = d.result.Remaining
		return refused, nil
	}
	if owner != h {
		runningSlotOwners.Store(d, owner)
		from += slotInRunningStore - slotInStore
	}
	d.slotFrom, d.slotID, d.slotLeft = from, slot, int32(n-inUse)
	d.tier.inFlight.Inc()
	return res, nil
}

// errSlotsUnloaded is a slot store's refusal of a new slot once its config
// has unloaded: a request of that config still running (a reload caught
// it waiting, with max_wait) takes its slot in the running config's store.
var errSlotsUnloaded = redisbucket.ErrSlotsClosed

// errClientGone ends a request whose client went away before it got a
// slot.
var errClientGone = errors.New("the client went away")

// untake shows the decision's results as they stand once the request's
// tokens went back: each limit holds the cost more, up to its capacity.
func (d *decision) untake() {
	left := d.result.Remaining // the binding one's: for one limit, parts[0]
	parts := d.parts()
	for i, l := range d.tier.limits {
		parts[i].Remaining = min(parts[i].Remaining+d.cost, l.Capacity)
	}
	if int(d.binding) < len(d.tier.limits) {
		d.result.Remaining = min(left+d.cost, d.tier.limits[d.binding].Capacity)
	} else if j := int(d.binding) - len(d.tier.limits); j < len(d.tier.quotas) {
		d.result.Remaining = min(left+d.cost, d.tier.quotas[j].N)
	}
}

// respond sets the headers for the request's result, and passes it on, to
// be settled after the response, or refuses it.
func (h *Handler) respond(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, res bucket.Result) error {
	d.result = res
	d.render()
	d.setHeaders(w.Header(), &d.resp)
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
			h.notes.note(d)
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
		d.setHeaders(r.Header, &upstream)
	}
	if !res.Allowed || h.counted == nil && d.tier.CostFromResponse == "" && d.slotFrom == noSlot {
		return next.ServeHTTP(w, r)
	}
	return h.serveAndSettle(w, r, next, d)
}

// errLimited is the error behind a rejection, for Caddy's error handling.
var errLimited = errors.New("rate limit exceeded")

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

const rejectionTrace = "ratelimit.rejection (handler.go)"

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

// After the response: what the response says settles the request's tokens.
// count_status gives them back when the status does not count, and
// cost_from_response charges the work the origin reported. Both run after
// the handlers that follow have returned, even when one of them panicked.

// serveAndSettle passes the request on, then settles its tokens with what
// the response said: count_status gives them back when the status does not
// count, and cost_from_response charges what the origin reported. Both run
// in a defer, so that a later handler's panic does not skip them:
// reverse_proxy panics with http.ErrAbortHandler when the client hangs up
// mid-stream, after the origin has done the work. The panic goes on.
func (h *Handler) serveAndSettle(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision) (err error) {
	var rec *statusRecorder
	if h.counted != nil {
		rec = &statusRecorder{ResponseWriterWrapper: &caddyhttp.ResponseWriterWrapper{ResponseWriter: w}}
	}
	returned := false
	defer func() {
		h.releaseSlot(d)
		if rec != nil {
			h.giveBackUncounted(r, d, finalStatus(rec.status, err, !returned))
		}
		if d.tier.CostFromResponse != "" {
			h.chargeFromResponse(w.Header(), r, d)
		}
	}()
	if rec != nil {
		err = next.ServeHTTP(rec, r)
	} else {
		err = next.ServeHTTP(w, r)
	}
	returned = true
	return err
}

// finalStatus is the status the client gets: the one written, or an error's
// status code, 500 when it has none; a handler that panicked before writing
// one fails the request as an error does.
func finalStatus(written int, err error, panicked bool) int {
	switch {
	case written != 0:
		return written
	case err != nil:
		var he caddyhttp.HandlerError
		if errors.As(err, &he) && he.StatusCode != 0 {
			return he.StatusCode
		}
		return http.StatusInternalServerError
	case panicked:
		return http.StatusInternalServerError
	}
	return http.StatusOK
}

// statusRecorder notes the final status a response is sent with.
type statusRecorder struct {
	*caddyhttp.ResponseWriterWrapper
	status int
}

func (rec *statusRecorder) WriteHeader(code int) {
	if rec.status == 0 && code >= 200 {
		rec.status = code
	}
	rec.ResponseWriterWrapper.WriteHeader(code)
}

func (rec *statusRecorder) Write(b []byte) (int, error) {
	if rec.status == 0 {
		rec.status = http.StatusOK
	}
	return rec.ResponseWriterWrapper.Write(b)
}

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
	if h.owed != nil && d.took == store(h.local) {
		h.owed.add(&d.bucket, d.tier, n)
	}
	// A reload since the take: the origin's figure is in the running
	// config's tokens. A tier of several limits is charged only while
	// they run: after a reload that changed them, the figure is in
	// tokens of limits that no longer run.
	tr := d.tier.shape()
	if len(tr.Limits) > 1 {
		if !sameLimitsRun(h, d.tier) {
			return
		}
	} else if cur, ok := liveLimit(h.Name, d.tier.Name, h); ok {
		tr.Limits = cur
	}
	err = d.took.charge(context.WithoutCancel(r.Context()), &d.bucket, tr, n)
	if err != nil {
		h.storeLog.Warn("rate limit store: charging the response's cost failed", zap.String("policy", h.Name), zap.Error(err))
	}
}

// giveBackUncounted gives the request's tokens back unless status is one
// that counts.
func (h *Handler) giveBackUncounted(r *http.Request, d *decision, status int) {
	if status < len(h.counted) && h.counted[status] {
		return
	}
	h.giveBackTaken(r, d, "uncounted status "+strconv.Itoa(status))
}

// giveBackTaken gives back the tokens a request took, to every limit of
// its tier, as the running config counts them (liveLimits: after a reload
// that changed them, converted, so that no tokens are created), and to
// every quota, which counts what was admitted whatever the reload did to
// the limits. A request of cost 0 took none: asking the store to give
// back nothing would cost a call. The client may be gone; the give-back
// still belongs to its bucket.
func (h *Handler) giveBackTaken(r *http.Request, d *decision, why string) {
	if d.cost == 0 {
		return
	}
	if h.owed != nil && d.took == store(h.local) {
		h.owed.sub(&d.bucket, d.cost)
	}
	ls, n := liveLimits(h, d.tier, d.cost)
	if ls == nil {
		return
	}
	tr := bucket.Tier{Limits: ls, Quotas: d.tier.quotas}
	if n <= 0 && len(tr.Quotas) == 0 {
		// The limits take nothing back, and no quota counted the request.
		return
	}
	err := d.took.giveBack(context.WithoutCancel(r.Context()), &d.bucket, tr, n, d.cost, d.countedAt())
	if err != nil {
		h.storeLog.Warn("rate limit store: giving back a request's tokens failed", zap.String("policy", h.Name), zap.String("why", why), zap.Error(err))
	}
}

// countedAt is when the request was counted, by the store's periods, for
// its quotas' give-back (bucket.CountedAt); 0 for a tier of no quota.
func (d *decision) countedAt() int64 {
	if len(d.tier.quotas) == 0 {
		return 0
	}
	return bucket.CountedAt(d.start.UnixMicro(), d.parts()[len(d.tier.limits):])
}

// releaseSlot frees the request's slot, if it holds one.
func (h *Handler) releaseSlot(d *decision) {
	owner, from := h, d.slotFrom
	if from >= slotInRunningStore {
		o, _ := runningSlotOwners.LoadAndDelete(d)
		owner, from = o.(*Handler), from-(slotInRunningStore-slotInStore)
	}
	switch from {
	case noSlot:
		return
	case slotInLocal:
		owner.local.release(&d.bucket, d.slotID)
	default:
		owner.store.release(&d.bucket, d.slotID)
	}
	d.tier.inFlight.Dec()
	d.slotFrom = noSlot
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
