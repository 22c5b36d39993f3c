package redisbucket

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"go.uber.org/zap"
)

// A request found by its bucket's id (takeByID) is decided as the same
// request found by its key: two nodes, each on its own copy of the model
// store and on one clock, one asking by id first and the other by key,
// play the same random traces (requests of cost 1 to 3 on six keys, clock
// steps past lease_ttl, resets, a table small enough to evict, keys whose
// ids share a hint's slot, credit or none, a ban setting, a quota whose
// period ends, a second limit) and answer alike at every request, holding the
// same tokens after it. The id way must decide most requests, or the test
// shows nothing; and a node that spends by id from a dropped entry (the
// mutation) must answer apart.
func TestALeasedRequestFoundByIDIsDecidedAsByKey(t *testing.T) {
	byID := 0
	for seed := range uint64(20) {
		n, err := playByIDAndByKey(seed, false)
		if err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		byID += n
	}
	if byID < 1000 {
		t.Errorf("%d requests decided by id over the traces; want most of them", byID)
	}
	caught := false
	for seed := range uint64(20) {
		if _, err := playByIDAndByKey(seed, true); err != nil {
			caught = true
			break
		}
	}
	if !caught {
		t.Error("a node that spends by id from a dropped entry answered as by key: the test cannot fail")
	}
}

// playByIDAndByKey plays one trace on the two nodes and reports how many
// requests the id way decided, or the first difference. staleHints is the
// mutation: an entry dropped from its shard is still found by id.
func playByIDAndByKey(seed uint64, staleHints bool) (int, error) {
	rng := rand.New(rand.NewPCG(seed, 34))
	clock := new(fakeClock)
	clock.micros.Store(1_000_000)
	l := bucket.Limit{Capacity: 40, Rate: bucket.Rate{Tokens: 1, Interval: 20_000}}
	tr := bucket.Tier{Limits: []bucket.Limit{l}}
	switch seed % 4 {
	case 1:
		tr.Limits[0].Ban = 300_000
	case 2:
		// A day's quota, crossed by a trace started near its end.
		tr.Quotas = []bucket.Quota{{N: 150, Period: bucket.Day, Loc: time.UTC}}
		_, end := tr.Quotas[0].Bounds(0)
		clock.micros.Store(end - 20_000_000)
	case 3:
		tr.Limits = append(tr.Limits, bucket.Limit{Capacity: 60, Rate: bucket.Rate{Tokens: 1, Interval: 30_000}})
	}
	tables := [2]*leaseTable{}
	for i := range tables {
		// 64 entries: one a shard, so that keys of one shard evict each
		// other.
		tables[i] = newLeaseTable(newSharedModel(clock.now), clock.now, LeaseSize{tokens: 8}, time.Second, 100*time.Millisecond, 64, zap.NewNop())
		tables[i].jitter = rand.New(rand.NewPCG(seed, 1)).Int64N
		// A new key's first requests on credit, in a third of the traces.
		tables[i].credit = int64(seed%3) * 2
	}
	// One seed, so that the same keys share a shard, and evict each other,
	// in both.
	tables[1].seed = tables[0].seed
	defer tables[0].close()
	defer tables[1].close()
	keys := make([][]byte, 6)
	ids := make([]uint64, len(keys))
	for k := range keys {
		keys[k] = []byte("rl:{p}:t:" + strconv.Itoa(k))
		// Keys 0 and 1, 2 and 3, 4 and 5 share a hint's slot.
		ids[k] = 1 + uint64(k/2) + uint64(k%2)*hintSlots
	}
	decided := 0
	for step := range 400 {
		k := rng.IntN(len(keys))
		switch op := rng.IntN(100); {
		case op < 75:
			cost := 1 + rng.Int64N(3)
			var res [2]bucket.Result
			var outs [2][]bucket.Result
			var errs [2]error
			for i, tb := range tables {
				out := make([]bucket.Result, tr.Parts())
				outs[i] = out
				if i == 0 {
					if staleHints {
						reviveHint(tb, ids[k])
					}
					r, ok := tb.takeByID(ids[k], tr, cost, out)
					if ok {
						decided++
						res[i] = r
						tableSync(tb)
						continue
					}
					res[i], errs[i] = tb.takeNamed(context.Background(), keys[k], ids[k], tr, cost, out)
				} else {
					res[i], errs[i] = tb.take(context.Background(), keys[k], tr, cost, out)
				}
				tableSync(tb)
			}
			if res[0] != res[1] || !slices.Equal(outs[0], outs[1]) || (errs[0] == nil) != (errs[1] == nil) {
				return decided, fmt.Errorf("step %d, key %d, cost %d: by id %+v %+v (%v), by key %+v %+v (%v)", step, k, cost, res[0], outs[0], errs[0], res[1], outs[1], errs[1])
			}
			if a, b := tables[0].heldNow(keys[k]), tables[1].heldNow(keys[k]); a != b {
				return decided, fmt.Errorf("step %d, key %d: %d tokens held by id, %d by key", step, k, a, b)
			}
		case op < 97:
			clock.advance(time.Duration(rng.IntN(400)) * time.Millisecond)
		default:
			for _, tb := range tables {
				tb.reset(keys[k])
			}
		}
	}
	return decided, nil
}

// reviveHint is the mutation of playByIDAndByKey: the entry id's hint
// points to counts as never dropped.
func reviveHint(tb *leaseTable, id uint64) {
	if e := tb.hints[id%hintSlots].Load(); e != nil && e.id == id {
		e.shard.mu.Lock()
		e.gone = false
		e.shard.mu.Unlock()
	}
}
