package ratelimit

import (
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// The argument helpers every Caddyfile block shares: each reads one
// subdirective's arguments, and names it and its value in any error.

// once fails when the current subdirective is one of single and was seen
// before in this block: the later value would silently win.
func once(d *caddyfile.Dispenser, seen map[string]bool, single ...string) error {
	sub := d.Val()
	for _, name := range single {
		if name == sub {
			if seen[sub] {
				return d.Errf("%s: given twice in one block; give it once", sub)
			}
			seen[sub] = true
		}
	}
	return nil
}

// oneArg reads exactly one argument into s.
func oneArg(d *caddyfile.Dispenser, s *string) error {
	name := d.Val()
	if !d.AllArgs(s) {
		return d.Errf("%s: want exactly one value", name)
	}
	return nil
}

// flag reads a subdirective that takes no argument.
func flag(d *caddyfile.Dispenser, b *bool) error {
	name := d.Val()
	if d.NextArg() {
		return d.Errf("%s takes no value; got %q", name, d.Val())
	}
	*b = true
	return nil
}

// intArg reads exactly one whole-number argument.
func intArg(d *caddyfile.Dispenser) (int64, error) {
	name := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return 0, d.Errf("%s: want exactly one number", name)
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, d.Errf("%s %q: want a whole number", name, s)
	}
	return n, nil
}

// intBetween reads a subdirective's one whole number, which must lie in
// [lo, hi], into v.
func intBetween(d *caddyfile.Dispenser, lo, hi int64, v *int) error {
	name := d.Val()
	n, err := intArg(d)
	if err != nil {
		return err
	}
	if n < lo || n > hi {
		return d.Errf("%s %d: want %d to %d", name, n, lo, hi)
	}
	*v = int(n)
	return nil
}

// durationArg reads exactly one duration argument.
func durationArg(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return d.Errf("%s: want exactly one duration", name)
	}
	v, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("%s %q: want a duration such as 30s", name, s)
	}
	if v < 0 {
		return d.Errf("%s %q: must not be negative", name, s)
	}
	*dur = caddy.Duration(v)
	return nil
}

// positiveDuration reads a subdirective's one duration, which must be
// above zero.
func positiveDuration(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	if err := durationArg(d, dur); err != nil {
		return err
	}
	if *dur == 0 {
		return d.Errf("%s %q: must be above 0", name, d.Val())
	}
	return nil
}
