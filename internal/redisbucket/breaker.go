package redisbucket

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
)

// errBreakerOpen fails decisions while the breaker is open. The error a
// refused call gets is a breakerOpenError, which is it and names the last
// failure.
var errBreakerOpen = errors.New("redis store: circuit breaker open after repeated failures; not calling Redis until the cool-down ends")

// breakerOpenError is errBreakerOpen with the failure that last counted,
// so that every line logged while the breaker is open says why (a refused
// connection, a certificate, a timeout), not only that it is open.
type breakerOpenError struct{ cause error }

func (e *breakerOpenError) Error() string {
	if e.cause == nil {
		return errBreakerOpen.Error()
	}
	return "redis store: circuit breaker open after repeated failures, the last: " +
		strings.TrimPrefix(e.cause.Error(), "redis store: ") + "; not calling Redis until the cool-down ends"
}

func (e *breakerOpenError) Unwrap() []error { return []error{errBreakerOpen, e.cause} }

// breaker is a circuit breaker over consecutive failures. Closed, it costs
// two atomic loads. Times are monotonic microseconds.
type breaker struct {
	threshold int64
	cooldown  int64

	failures  atomic.Int64
	openUntil atomic.Int64 // 0 when closed
	probing   atomic.Bool
	// refusal is the error of a call refused while open: it names the
	// last failure. Made once a failure, so that refusing allocates nothing.
	refusal atomic.Pointer[breakerOpenError]
	// changed, when set, hears the breaker open and close.
	changed func(open bool)
}

// failedWith notes why a call failed, before record counts it.
func (b *breaker) failedWith(err error) { b.refusal.Store(&breakerOpenError{cause: err}) }

// openError is the error of a call the breaker refused.
func (b *breaker) openError() error {
	if e := b.refusal.Load(); e != nil {
		return e
	}
	return errBreakerOpen
}

// cause is the last failure noted, or nil.
func (b *breaker) cause() error {
	if e := b.refusal.Load(); e != nil {
		return e.cause
	}
	return nil
}

// allow says whether a call may go to Redis now, and whether it is the
// probe. Once the cool-down is over, one call at a time probes; whoever
// gets probe must pass it to record, whatever becomes of the call.
func (b *breaker) allow(now int64) (ok, probe bool) {
	until := b.openUntil.Load()
	if until == 0 {
		return true, false
	}
	if now < until {
		return false, false
	}
	ok = b.probing.CompareAndSwap(false, true)
	return ok, ok
}

// callOutcome is how a call to Redis went, for the breaker.
type callOutcome uint8

const (
	callOK        callOutcome = iota
	callFailed                // Redis failed or did not answer in time
	callAbandoned             // the caller went away first: nothing learned
)

// record counts a call's outcome. Any outcome ends a probe: a failed one
// starts another cool-down, an abandoned one lets the next call probe.
func (b *breaker) record(probe bool, out callOutcome, now int64) {
	switch out {
	case callOK:
		if b.failures.Load() != 0 {
			b.failures.Store(0)
		}
		if until := b.openUntil.Load(); until != 0 && b.openUntil.CompareAndSwap(until, 0) {
			b.notify(false)
		}
	case callFailed:
		n := b.failures.Add(1)
		if probe {
			if b.openUntil.Swap(now+b.cooldown) == 0 {
				b.notify(true)
			}
		} else if n >= b.threshold && b.openUntil.CompareAndSwap(0, now+b.cooldown) {
			b.notify(true)
		}
	}
	if probe {
		b.probing.Store(false)
	}
}

// reset closes the breaker at once, whatever its state, without telling
// changed, and says whether it was open.
func (b *breaker) reset() bool {
	b.failures.Store(0)
	return b.openUntil.Swap(0) != 0
}

func (b *breaker) notify(open bool) {
	if b.changed != nil {
		b.changed(open)
	}
}

// state is the breaker as the admin API shows it: closed, open, or
// half-open once the cool-down is over and a probe may go.
func (b *breaker) state(now int64) string {
	switch until := b.openUntil.Load(); {
	case until == 0:
		return "closed"
	case now < until:
		return "open"
	default:
		return "half-open"
	}
}

// open reports whether the breaker is failing calls.
func (b *breaker) open() bool { return b.openUntil.Load() != 0 }

// doAside is Store.do for a call no request waits on: a lease call made in
// the background (a prefetch, a renewal) or a give-back. Its failure does
// not count toward the breaker: a burst of renewals queued past the
// timeout on a busy Redis would otherwise open it, and stop every key's
// leases for the cool-down, when requests' own calls are answered. A Redis
// that is down still opens it: the leases lapse, and requests' calls fail
// (TestBackgroundLeaseCallsThatTimeOutLeaveTheBreakerClosed). Its answer
// counts as any call's. It is not sent while the breaker is open, and
// never probes: a request's call does. parent is no request's context:
// it may only end the call sooner (Store.lease).
func (s *Store) doAside(parent context.Context, send func(context.Context, *clientSet) error) error {
	b := &s.conn.breaker
	if b.open() {
		return b.openError()
	}
	ctx, cancel := context.WithTimeout(parent, s.timeout)
	defer cancel()
	err := s.conn.send(ctx, send)
	if err == nil || isRedirect(err) {
		b.record(false, callOK, s.conn.now())
	}
	if err != nil {
		return s.wrap(err)
	}
	return nil
}
