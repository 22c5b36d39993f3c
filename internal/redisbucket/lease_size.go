package redisbucket

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// LeaseSize is the lease setting: a number of tokens, or a share of each
// tier's capacity.
type LeaseSize struct {
	tokens  int64
	percent float64
}

// ParseLeaseSize reads `<n>` or `<p>%`. The empty setting is 1: strict.
func ParseLeaseSize(s string) (LeaseSize, error) {
	if s == "" {
		return LeaseSize{tokens: 1}, nil
	}
	if p, ok := strings.CutSuffix(s, "%"); ok {
		f, err := strconv.ParseFloat(p, 64)
		if err != nil || !(f > 0 && f <= 100) {
			return LeaseSize{}, fmt.Errorf("redis store: lease %q: want a share above 0%% and at most 100%%, such as 10%%", s)
		}
		return LeaseSize{percent: f}, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 {
		return LeaseSize{}, fmt.Errorf("redis store: lease %q: want a whole number of tokens, at least 1, or a share such as 10%%", s)
	}
	return LeaseSize{tokens: n}, nil
}

// Of is the lease size for a bucket of limit l: at least 1, and at most
// half the capacity, since the tokens out on lease never pass that.
func (z LeaseSize) Of(l bucket.Limit) int64 {
	n := z.tokens
	if z.percent > 0 {
		n = int64(float64(l.Capacity) * z.percent / 100)
	}
	return max(1, min(n, l.Capacity/2))
}

// ofTier is the lease size for a tier: the least of its limits', since a
// lease takes from them all at once.
func (z LeaseSize) ofTier(tr bucket.Tier) int64 {
	n := z.Of(tr.Limits[0])
	for _, l := range tr.Limits[1:] {
		n = min(n, z.Of(l))
	}
	return n
}

// Capped says, for a share above half, that leases are held to half of
// each capacity, as Of holds them: the setting asks for more than it gets.
func (z LeaseSize) Capped() (string, bool) {
	if z.percent <= 50 {
		return "", false
	}
	return fmt.Sprintf("redis store: lease %g%% capped at 50%% of each tier's capacity: the tokens out on lease never pass half of it", z.percent), true
}

// CappedAt says, for a lease given in tokens, whether a bucket of limit l
// holds it to half its capacity, as Of does.
func (z LeaseSize) CappedAt(l bucket.Limit) bool {
	return z.percent == 0 && z.tokens > 1 && z.tokens > max(1, l.Capacity/2)
}

// Strict reports whether leases never exceed one token, so that every
// decision asks Redis, as without leases.
func (z LeaseSize) Strict() bool { return z.percent == 0 && z.tokens <= 1 }
