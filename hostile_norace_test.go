//go:build !race

package ratelimit

// Without the race detector the floods are full size.
func init() { raceEnabled = false }
