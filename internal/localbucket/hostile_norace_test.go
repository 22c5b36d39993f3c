//go:build !race

package localbucket

// Without the race detector the flood is full size: 5M distinct keys.
func init() { floodKeys = 5_000_000 }
