//go:build !race

package ratelimit

// Without the race detector the flood is the full 5M distinct keys.
func init() { floodKeys = 5_000_000 }
