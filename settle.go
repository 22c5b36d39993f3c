package ratelimit

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"

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
// that counts. A request of cost 0 took none: asking the store to give back
// nothing would cost a call, and would write to a banned or indebted bucket.
func (h *Handler) giveBackUncounted(r *http.Request, d *decision, status int) {
	if d.cost == 0 || status < len(h.counted) && h.counted[status] {
		return
	}
	// A reload since the take: give back as the running config counts, so
	// that a changed refill creates no tokens, or not at all.
	l, n := d.tier.limit, d.cost
	if cur, ok := liveLimit(h.Name, d.tier.Name, l, h); !ok {
		return
	} else if cur != l {
		l, n = cur, cur.Converted(n, l)
	}
	if n == 0 {
		return
	}
	// The client may be gone; the give-back still belongs to its bucket.
	if err := d.took.GiveBack(context.WithoutCancel(r.Context()), &d.bucket, l, n); err != nil {
		h.storeLog.Warn("rate limit store: giving back the tokens of an uncounted response failed", zap.String("policy", h.Name), zap.Int("status", status), zap.Error(err))
	}
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
	// config's tokens.
	l := d.tier.limit
	if cur, ok := liveLimit(h.Name, d.tier.Name, l, h); ok {
		l = cur
	}
	if err := d.took.Charge(context.WithoutCancel(r.Context()), &d.bucket, l, n); err != nil {
		h.storeLog.Warn("rate limit store: charging the response's cost failed", zap.String("policy", h.Name), zap.Error(err))
	}
}
