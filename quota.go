package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Calendar quotas (README: Sell API plans): a tier's quotas count its
// requests' tokens per day, week, month or year in the handler's time
// zone; a request must fit every limit and every quota, and takes from all
// or none.

// QuotaStore is a store that keeps calendar quotas beside a bucket's
// limits, in the same step.
type QuotaStore interface {
	// TakeQuotas applies a request to every limit and every quota of the
	// bucket, all or none: each limit's result goes into out, each
	// quota's into qout.
	TakeQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, error)
	// GiveBackQuotas returns ln tokens to every limit, and the n tokens
	// a request took at the moment at (Unix microseconds) to every quota
	// while the period it was counted in lasts. ln is at most n: after a
	// reload that changed the limits, what they may take back.
	GiveBackQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, ln int64, qs []bucket.Quota, n, at int64) error
	// PeekQuotas reports every limit and quota of the bucket as it
	// stands, changing nothing and starting no ban.
	PeekQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, out, qout []bucket.Result) error
	// ChargeQuotas takes n more tokens from every limit and quota, after
	// the fact.
	ChargeQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, n int64) error
}

// validateTimezone reads the handler's time zone, and hands it to the
// tiers, whose quotas count in it.
func (h *Handler) validateTimezone() error {
	loc := time.UTC
	if h.Timezone != "" {
		var err error
		// "Local" is the machine's own zone, which nodes may not share.
		if loc, err = time.LoadLocation(h.Timezone); err != nil || h.Timezone == "Local" {
			return fmt.Errorf("timezone %q: not a time zone of the IANA database, such as Europe/Berlin or America/New_York", h.Timezone)
		}
	}
	for _, t := range h.Tiers {
		t.loc = loc
	}
	return nil
}

// validateQuotas reads the tier's quotas, each at least the tier's cost.
func (t *Tier) validateQuotas() error {
	t.quotas = t.quotas[:0]
	if len(t.Quotas) > bucket.MaxQuotas || len(t.Quotas)+len(t.limits) > maxLimits {
		return fmt.Errorf("tier %q: %d quotas beside %d limits: at most %d quotas, and %d limits and quotas in all", t.Name, len(t.Quotas), len(t.limits), bucket.MaxQuotas, maxLimits)
	}
	var seen [bucket.Year + 1]bool
	for _, s := range t.Quotas {
		q, err := bucket.ParseQuota(s, t.loc)
		if err != nil {
			return fmt.Errorf("tier %q: %w", t.Name, err)
		}
		if seen[q.Period] {
			return fmt.Errorf("tier %q: quota %s: a second quota per %s; give one a period", t.Name, s, q.Period)
		}
		seen[q.Period] = true
		if q.N < t.cost || t.CostPlaceholder != "" && q.N < t.maxCost {
			return fmt.Errorf("tier %q: quota %s: smaller than a request's cost, which it could never admit", t.Name, s)
		}
		t.quotas = append(t.quotas, q)
	}
	return nil
}

// takeQuotas applies the request to the tier's limits and quotas in one
// step of store. The result is the binding one's: of the limits and
// quotas, the one with the least remaining or, refused, the one that makes
// the client wait longest.
func (d *decision) takeQuotas(ctx context.Context, store Store) (bucket.Result, error) {
	qstore, ok := store.(QuotaStore)
	if !ok {
		return bucket.Result{}, fmt.Errorf("the store %T keeps no quotas", store)
	}
	ls, qs := d.tier.limits, d.tier.quotas
	// The quotas' results follow the limits' (validation keeps them
	// within maxLimits in all).
	d.limits = new([maxLimits]bucket.Result)
	all := d.limits[:len(ls)+len(qs)]
	out, qout := all[:len(ls)], all[len(ls):]
	allowed, err := qstore.TakeQuotas(ctx, &d.bucket, ls, qs, d.cost, out, qout)
	if err != nil {
		return bucket.Result{}, err
	}
	// A hidden limit (quotaLimit) never binds.
	j := d.tier.hidden + bindingLimit(all[d.tier.hidden:], allowed)
	d.binding = uint8(j)
	res := all[j]
	res.Allowed = allowed
	for _, r := range out {
		res.Wait = max(res.Wait, r.Wait)
	}
	return res, nil
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
	for i, q := range d.tier.quotas {
		buf = appendSeparator(buf, start)
		j := len(d.tier.limits) + i
		buf = appendIETFItem(buf, strconv.Quote(d.tier.Name+"-"+q.Period.String()), d.goingOn(j, d.limits[j]))
	}
	return buf
}

// TakeQuotas implements QuotaStore: the quotas' counts live beside the
// limits' states, under the same shard lock, each until its period ends.
func (s *LocalStore) TakeQuotas(_ context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, error) {
	var all [bucket.MaxLimits + bucket.MaxQuotas]bucket.Result
	allowed := s.buckets.Take(localID(b), bucket.Tier{Limits: ls, Quotas: qs}, cost, all[:])
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):len(ls)+len(qs)])
	return allowed, nil
}

// PeekQuotas implements QuotaStore: each state read, none changed.
func (s *LocalStore) PeekQuotas(_ context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, out, qout []bucket.Result) error {
	var all [bucket.MaxLimits + bucket.MaxQuotas]bucket.Result
	s.buckets.Peek(localID(b), bucket.Tier{Limits: ls, Quotas: qs}, all[:])
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):len(ls)+len(qs)])
	return nil
}

// GiveBackQuotas implements QuotaStore.
func (s *LocalStore) GiveBackQuotas(_ context.Context, b *Bucket, ls []bucket.Limit, ln int64, qs []bucket.Quota, n, at int64) error {
	s.buckets.GiveBack(localID(b), bucket.Tier{Limits: ls, Quotas: qs}, ln, n, at)
	return nil
}

// ChargeQuotas implements QuotaStore.
func (s *LocalStore) ChargeQuotas(_ context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, n int64) error {
	s.buckets.Charge(localID(b), bucket.Tier{Limits: ls, Quotas: qs}, n)
	return nil
}

// TakeQuotas implements QuotaStore: the engine writes the limits' results
// then the quotas', which go apart into out and qout.
func (s *RedisStore) TakeQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, cost int64, out, qout []bucket.Result) (bool, error) {
	var buf [192]byte
	var all [bucket.MaxLimits + bucket.MaxQuotas]bucket.Result
	allowed, err := s.engine.Take(ctx, s.key(buf[:0], b), bucket.Tier{Limits: ls, Quotas: qs}, cost, all[:])
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):len(ls)+len(qs)])
	return allowed, err
}

// GiveBackQuotas implements QuotaStore.
func (s *RedisStore) GiveBackQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, ln int64, qs []bucket.Quota, n, at int64) error {
	var buf [192]byte
	return s.engine.GiveBack(ctx, s.key(buf[:0], b), bucket.Tier{Limits: ls, Quotas: qs}, ln, n, at)
}

// PeekQuotas implements QuotaStore, as TakeQuotas does.
func (s *RedisStore) PeekQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, out, qout []bucket.Result) error {
	var buf [192]byte
	var all [bucket.MaxLimits + bucket.MaxQuotas]bucket.Result
	err := s.engine.Peek(ctx, s.key(buf[:0], b), bucket.Tier{Limits: ls, Quotas: qs}, all[:])
	copy(out, all[:len(ls)])
	copy(qout, all[len(ls):len(ls)+len(qs)])
	return err
}

// ChargeQuotas implements QuotaStore.
func (s *RedisStore) ChargeQuotas(ctx context.Context, b *Bucket, ls []bucket.Limit, qs []bucket.Quota, n int64) error {
	var buf [192]byte
	return s.engine.Charge(ctx, s.key(buf[:0], b), bucket.Tier{Limits: ls, Quotas: qs}, n)
}

// Interface guards
var (
	_ QuotaStore = (*LocalStore)(nil)
	_ QuotaStore = (*RedisStore)(nil)
)
