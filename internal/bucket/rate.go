package bucket

import (
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
	"time"
)

// Rate is a refill rate: Tokens tokens every Interval microseconds, reduced
// to lowest terms.
type Rate struct {
	Tokens   int64
	Interval int64
}

// ParseRate parses a refill rate written as <amount>/<duration>: "100/s",
// "0.5/s", "1/10s", "30/m", "1000/h", "5/1m30s". The amount may have up to
// six decimal places; the duration is a whole number of microseconds.
func ParseRate(s string) (Rate, error) {
	amount, per, ok := strings.Cut(s, "/")
	if !ok {
		return Rate{}, fmt.Errorf("refill %q: want <amount>/<duration>, such as 100/s or 1/10s", s)
	}
	num, den, err := parseDecimal(amount)
	if err != nil || num <= 0 {
		return Rate{}, fmt.Errorf("refill %q: amount %q is not a positive number", s, amount)
	}
	if per != "" && (per[0] < '0' || per[0] > '9') && per[0] != '.' {
		per = "1" + per
	}
	if strings.HasSuffix(per, "d") {
		days, err := strconv.ParseInt(strings.TrimSuffix(per, "d"), 10, 64)
		if err != nil || days <= 0 || days > 365 {
			return Rate{}, fmt.Errorf("refill %q: duration %q is not a whole number of days", s, per)
		}
		per = strconv.FormatInt(days*24, 10) + "h"
	}
	d, err := time.ParseDuration(per)
	if err != nil || d <= 0 {
		return Rate{}, fmt.Errorf("refill %q: duration %q is not a positive duration such as s, 10s, m or h", s, per)
	}
	if d%time.Microsecond != 0 {
		return Rate{}, fmt.Errorf("refill %q: duration %q is finer than a microsecond", s, per)
	}
	interval := new(big.Int).Mul(big.NewInt(d.Microseconds()), big.NewInt(den))
	tokens := big.NewInt(num)
	g := new(big.Int).GCD(nil, nil, tokens, interval)
	tokens.Quo(tokens, g)
	interval.Quo(interval, g)
	if !interval.IsInt64() || interval.Int64() > maxUnits || tokens.Int64() > math.MaxInt32 {
		return Rate{}, fmt.Errorf("refill %q: too fine a rate to compute exactly", s)
	}
	return Rate{Tokens: tokens.Int64(), Interval: interval.Int64()}, nil
}

// parseDecimal reads a non-negative decimal with at most six fractional
// digits as num/den.
func parseDecimal(s string) (num, den int64, err error) {
	whole, frac, _ := strings.Cut(s, ".")
	if whole == "" && frac == "" || len(frac) > 6 || strings.ContainsAny(s, "+-eE_") {
		return 0, 0, strconv.ErrSyntax
	}
	den = 1
	for range frac {
		den *= 10
	}
	n, err := strconv.ParseInt(whole+frac, 10, 64)
	if err != nil || n > math.MaxInt64/1000000 {
		return 0, 0, strconv.ErrSyntax
	}
	return n, den, nil
}

// String writes the rate back in the refill syntax.
func (r Rate) String() string {
	return strconv.FormatInt(r.Tokens, 10) + "/" + (time.Duration(r.Interval) * time.Microsecond).String()
}

// PerSecond is the rate as a float, for display only.
func (r Rate) PerSecond() float64 {
	return float64(r.Tokens) * 1e6 / float64(r.Interval)
}
