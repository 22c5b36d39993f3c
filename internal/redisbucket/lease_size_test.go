package redisbucket

import (
	"strconv"
	"strings"
	"testing"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

func TestLeaseSizes(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		setting  string
		capacity int64
		want     int64
	}{
		{"", 100, 1}, {"1", 100, 1}, {"20", 100, 20}, {"500", 100, 50},
		{"10%", 200, 20}, {"10%", 5, 1}, {"100%", 7, 3}, {"2.5%", 1000, 25}, {"50%", 1, 1},
	} {
		z, err := ParseLeaseSize(tt.setting)
		if err != nil {
			t.Fatalf("%q: %v", tt.setting, err)
		}
		if got := z.Of(bucket.Limit{Capacity: tt.capacity}); got != tt.want {
			t.Errorf("lease %q of capacity %d: %d, want %d", tt.setting, tt.capacity, got, tt.want)
		}
	}
	for _, bad := range []string{"0", "-3", "0%", "101%", "ten", "%"} {
		if _, err := ParseLeaseSize(bad); err == nil || !strings.Contains(err.Error(), strconv.Quote(bad)) {
			t.Errorf("lease %q: error %v, want one naming the value", bad, err)
		}
	}
}
