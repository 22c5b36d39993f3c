//go:build !race

package ratelimit

// Without the race detector the floods are full size: 5M distinct keys for
// the local store.
func init() {
	floodKeys = 5_000_000
	raceEnabled = false
}
