package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

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

// giveBackUncounted gives the request's tokens back unless status is one
// that counts.
func (h *Handler) giveBackUncounted(r *http.Request, d *decision, status int) {
	if status < len(h.counted) && h.counted[status] {
		return
	}
	h.giveBackTaken(r, d, "uncounted status "+strconv.Itoa(status))
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

// liveLimits are the limits a give-back of n tokens that a request of
// tier t took under h goes to, and how many tokens each takes back: t's
// own and n while they run (sameLimitsRun). After a reload that changed
// them, the running tier's, each taking back the n tokens as
// bucket.Limit.Converted counts them from the limit at its place in t,
// where its state was kept: no more than the time their refill took
// under that limit buys under the new one. A limit the reload added took
// nothing, and takes back nothing. The store gives every limit the same,
// so they all take the least: a reload never creates tokens. Nil when the
// tier no longer runs, or runs without limits (unlimited, deny).
func liveLimits(h *Handler, t *Tier, n int64) ([]bucket.Limit, int64) {
	if sameLimitsRun(h, t) {
		return t.limits, n
	}
	cur, _ := liveTier(h.Name, t.Name)
	if cur == nil || cur.Unlimited || cur.Deny || len(cur.limits) == 0 {
		return nil, 0
	}
	back := n
	for i, l := range cur.limits {
		if i >= len(t.limits) {
			return cur.limits, 0
		}
		back = min(back, l.Converted(n, t.limits[i]))
	}
	return cur.limits, back
}

// countedAt is when the request was counted, by the store's periods, for
// its quotas' give-back (bucket.CountedAt); 0 for a tier of no quota.
func (d *decision) countedAt() int64 {
	if len(d.tier.quotas) == 0 {
		return 0
	}
	return bucket.CountedAt(d.start.UnixMicro(), d.parts()[len(d.tier.limits):])
}

// sameLimitsRun reports whether the limits a request of tier t took under
// h still run: h runs (or runs outside a server, in tests), or the newest
// config of its policy has a tier of that name with the same limits, as
// after a reload that did not change them.
func sameLimitsRun(h *Handler, t *Tier) bool {
	hs := runningHandlers()[h.Name]
	if len(hs) == 0 || slices.Contains(hs, h) {
		return true
	}
	for _, x := range hs[len(hs)-1].Tiers {
		if x.Name == t.Name {
			return slices.Equal(x.limits, t.limits)
		}
	}
	return false
}
