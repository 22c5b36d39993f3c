package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// Protecting logins (README: count_status and ban): count_status keeps the
// tokens of the responses that count, such as 401, and gives the others
// back; ban holds a denied client off for a while (the bucket math is in
// bucket.go).

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

// validateLogin checks count_status and ban, and hands the ban to the
// tiers' limits.
func (h *Handler) validateLogin() error {
	if h.CountStatus != nil {
		if len(h.CountStatus) == 0 {
			return errors.New("count_status: give one or more status codes or classes, such as 401 or 4xx")
		}
		set, err := parseStatusSet(h.CountStatus)
		if err != nil {
			return err
		}
		h.counted = set
	}
	if h.Ban < 0 {
		return fmt.Errorf("ban %s: must be above 0", time.Duration(h.Ban))
	}
	for _, t := range h.Tiers {
		t.ban = time.Duration(h.Ban).Microseconds()
		if t.limitCount() > 1 && (h.CountStatus != nil || h.Ban != 0) {
			return fmt.Errorf("tier %q: count_status and ban work with one limit per tier; this tier has several", t.Name)
		}
	}
	return nil
}

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
