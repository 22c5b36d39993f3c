package ratelimit

import (
	"net/http"
	"strconv"
	"unsafe"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// The limit headers: X-RateLimit-Limit, -Remaining and -Reset,
// RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers),
// and a refusal's Retry-After, rendered once a request into its decision.

// headerValues are the limit headers of one response, or of one request
// with upstream_headers. Each message owns its slices, because a later
// handler (a deferred `header` replace) may edit them in place; the strings
// themselves are immutable and may be shared. A nil entry is not sent.
type headerValues struct {
	limit, remaining, reset, policy, ietf [1]string
}

// limitHeaderNames are the headers setHeaders may write, in canonical form.
var limitHeaderNames = []string{"X-Ratelimit-Limit", "X-Ratelimit-Remaining", "X-Ratelimit-Reset", "Ratelimit-Policy", "Ratelimit"}

// setHeaders writes the limit headers into hdr: the response's or, with
// upstream_headers, the request's.
func (d *decision) setHeaders(hdr http.Header, v *headerValues) {
	h := d.handler
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
func (d *decision) render() {
	h := d.handler
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

// appendQuotaPolicy appends the quotas' RateLimit-Policy items to the
// tier's others in buf: the count and the seconds in the period that
// holds now.
func (d *decision) appendQuotaPolicy(buf []byte, now int64) []byte {
	for _, q := range d.tier.quotas {
		start, end := q.Bounds(now)
		buf = appendSeparator(buf, 0)
		buf = strconv.AppendQuote(buf, d.tier.Name+"-"+q.Period.String())
		buf = append(buf, ";q="...)
		buf = strconv.AppendInt(buf, q.N, 10)
		buf = append(buf, ";w="...)
		buf = strconv.AppendInt(buf, bucket.CeilDiv(end-start, 1e6), 10)
	}
	return buf
}

// appendQuotaItems appends the quotas' RateLimit items to the list that
// starts at start of buf: left, and the seconds to the boundary.
func (d *decision) appendQuotaItems(buf []byte, start int) []byte {
	parts := d.parts()
	for i, q := range d.tier.quotas {
		buf = appendSeparator(buf, start)
		j := len(d.tier.limits) + i
		buf = appendIETFItem(buf, strconv.Quote(d.tier.Name+"-"+q.Period.String()), d.goingOn(j, parts[j]))
	}
	return buf
}

// appendConcurrencyItem appends the RateLimit item of the tier's in-flight
// limit, in the list that starts at start of buf: the slots left, when the
// request asked for a slot; it says nothing of the slots of a request
// refused before it asked.
func (d *decision) appendConcurrencyItem(buf []byte, start int) []byte {
	if d.slotFrom == noSlot && d.refusedBy != refusedNoSlot {
		return buf
	}
	buf = appendSeparator(buf, start)
	buf = append(buf, d.tier.concurrencyName...)
	buf = append(buf, ";r="...)
	return strconv.AppendInt(buf, int64(d.slotLeft), 10)
}
