package redisbucket

import (
	"errors"
	"sync/atomic"
)

// errBreakerOpen fails decisions while the breaker is open.
var errBreakerOpen = errors.New("redis store: circuit breaker open after repeated failures; not calling Redis until the cool-down ends")

// breaker is a circuit breaker over consecutive failures. Closed, it costs
// two atomic loads. Times are monotonic microseconds.
type breaker struct {
	threshold int64
	cooldown  int64

	failures  atomic.Int64
	openUntil atomic.Int64 // 0 when closed
	probing   atomic.Bool
	// changed, when set, hears the breaker open and close.
	changed func(open bool)
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
