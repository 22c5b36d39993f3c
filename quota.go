package ratelimit

import (
	"fmt"
	"strconv"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Calendar quotas (README: Sell API plans): a tier's quotas count its
// requests' tokens per day, week, month or year in the handler's time
// zone; a request must fit every limit and every quota, and takes from all
// or none.

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
