package redisbucket

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redistest"
)

// A charge of up to 2^63-1 (an origin's cost_from_response figure) leaves
// each quota used up in the script as in the model: the script's doubles
// sum without wrapping, and the count it stores is N exactly.
// Regression test for issue 30 item 1.
func TestScriptChargeNear2To63KeepsTheQuotaUsedUp(t *testing.T) {
	srv := redistest.Start(t)
	s := newTestStore(t, testConfig{Addresses: []string{srv.URL()}, Timeout: 5 * time.Second})
	ls := []bucket.Limit{slowLimit(100)}
	qs := []bucket.Quota{{N: 5, Period: bucket.Day, Loc: time.UTC}, {N: 50, Period: bucket.Month, Loc: time.UTC}}
	out, qout := make([]bucket.Result, 1), make([]bucket.Result, 2)
	for i, n := range []int64{math.MaxInt64, math.MaxInt64 - 1, 1 << 62} {
		key := bucketFor(fmt.Sprint("charge-", i))
		if ok, err := s.TakeQuotas(bg, key, ls, qs, 1, out, qout); !ok || err != nil {
			t.Fatalf("the first take: %v %v %+v", ok, err, qout)
		}
		if err := s.ChargeQuotas(bg, key, ls, qs, n); err != nil {
			t.Fatal(err)
		}
		now := time.Now().UnixMicro()
		sh := &bucket.Shared{Levels: make([]bucket.State, 1), Quotas: []bucket.QuotaState{{Used: 1}, {Used: 1}}}
		for j, q := range qs {
			sh.Quotas[j].Start, _ = q.Bounds(now)
		}
		sh.ChargeQuotas(now, qs, n)
		stored, _ := srv.Do("GET", string(key)).(string)
		for j, q := range qs {
			if sh.Quotas[j].Used != q.N {
				t.Fatalf("the model, charged %d: %+v; want %d used", n, sh.Quotas[j], q.N)
			}
			if want := fmt.Sprintf("q%d:%d:%d:", q.Period, sh.Quotas[j].Start, q.N); !strings.Contains(stored, want) {
				t.Fatalf("charged %d: the key holds %q; want %q, the quota used up", n, stored, want)
			}
		}
		if ok, err := s.TakeQuotas(bg, key, ls, qs, 1, out, qout); ok || err != nil || qout[0].Remaining != 0 || qout[1].Remaining != 0 {
			t.Fatalf("after a charge of %d: allowed %v (%v), %+v; want refused, both quotas used up", n, ok, err, qout)
		}
	}
}
