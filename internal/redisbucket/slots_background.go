package redisbucket

import (
	"context"
	"slices"
	"time"

	"github.com/redis/go-redis/v9"
)

// The slots' background work (slots.go): the loop that frees ended
// slots, pipelined, and keeps the frees it could not be sure of; the loop
// that renews the slots this node holds; and retire, when the store
// unloads.

// freeLoop sends the frees, as many as are waiting in one pipeline.
func (t *slotTable) freeLoop() {
	defer t.done.Done()
	batch := make([]slotFree, 0, maxFreeBatch)
	for {
		select {
		case f := <-t.frees:
			t.send(drain(t.frees, append(batch[:0], f), maxFreeBatch))
		case <-t.stop:
			return
		}
	}
}

// send frees slots in one pipeline of ZREMs (Store.do). Frees that do
// not reach Redis are sent again (keep).
func (t *slotTable) send(batch []slotFree) {
	err := t.s.do(context.Background(), func(ctx context.Context, set *clientSet) error {
		_, err := set.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, f := range batch {
				p.ZRem(ctx, f.key, t.member(f.id))
			}
			return nil
		})
		return err
	})
	t.mu.Lock()
	for _, f := range batch {
		if ids := t.unsent[f.key]; len(ids) > 0 {
			if ids = slices.DeleteFunc(ids, func(id uint64) bool { return id == f.id }); len(ids) == 0 {
				delete(t.unsent, f.key)
			} else {
				t.unsent[f.key] = ids
			}
		}
	}
	t.mu.Unlock()
	if err != nil {
		t.keep(batch)
	}
}

// keep keeps frees to send again, and asks for the retry. Each is kept
// until its slot has surely expired in Redis: slot_ttl after its last
// renewal, which was before now, by clocks that may drift by the timeout.
func (t *slotTable) keep(batch []slotFree) {
	t.mu.Lock()
	t.keepLocked(batch)
	t.mu.Unlock()
	select {
	case t.retry <- struct{}{}:
	default:
	}
}

// keepLocked is keep, under t.mu, without asking for the retry.
func (t *slotTable) keepLocked(batch []slotFree) {
	if t.doubtTaken {
		return // closed: the close sent them once
	}
	until := t.s.conn.now() + (t.ttl + t.s.timeout).Microseconds()
	for _, f := range batch {
		if f.until == 0 {
			f.until = until
		}
		t.doubt = append(t.doubt, f)
	}
	if over := len(t.doubt) - maxDoubt; over > 0 {
		t.doubt = append(t.doubt[:0], t.doubt[over:]...)
	}
}

// takeDoubt takes the doubtful frees whose slots may still be in Redis.
func (t *slotTable) takeDoubt() []slotFree {
	now := t.s.conn.now()
	t.mu.Lock()
	defer t.mu.Unlock()
	doubt := t.doubt
	t.doubt = nil
	live := doubt[:0]
	for _, f := range doubt {
		if f.until == 0 || now < f.until {
			live = append(live, f)
		}
	}
	return live
}

// resend sends the doubtful frees again.
func (t *slotTable) resend() {
	for doubt := t.takeDoubt(); len(doubt) > 0; {
		n := min(len(doubt), maxFreeBatch)
		t.send(doubt[:n])
		doubt = doubt[n:]
	}
}

// renewLoop renews the slots held, three times a TTL, so that a request
// that runs longer than slot_ttl keeps its slot while this node lives;
// and sends the frees that did not reach Redis again, freeRetry after.
func (t *slotTable) renewLoop() {
	defer t.done.Done()
	tick := time.NewTicker(t.ttl / 3)
	defer tick.Stop()
	var retry <-chan time.Time
	for {
		select {
		case <-tick.C:
			t.renew()
		case <-t.retry:
			if retry == nil {
				retry = time.After(freeRetry)
			}
		case <-retry:
			retry = nil
			t.resend()
		case <-t.stop:
			return
		}
	}
}

// renew pipelines one renew call per set this node holds slots in, and
// the doubtful frees after them: one round trip, so that a renewal lands
// within the timeout of its tick (MinSlotTTL counts on it). It goes
// whatever the breaker says, since a slot renewed late may expire under
// its request; it follows a Cluster on MOVED (Conn.send). The frees go
// again if it fails.
func (t *slotTable) renew() {
	byKey := map[string][]any{}
	t.mu.Lock()
	for id, k := range t.held {
		byKey[k] = append(byKey[k], t.member(id))
	}
	t.mu.Unlock()
	doubt := t.takeDoubt()
	if len(byKey) == 0 && len(doubt) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), t.s.timeout)
	defer cancel()
	err := t.s.conn.send(ctx, func(ctx context.Context, set *clientSet) error {
		send := func() ([]redis.Cmder, error) {
			return set.client.Pipelined(ctx, func(p redis.Pipeliner) error {
				for k, ids := range byKey {
					args := append([]any{"renew", t.s.clockOffset, t.ttl.Microseconds()}, ids...)
					slotsScript.EvalSha(ctx, p, []string{k}, args...)
				}
				for _, f := range doubt {
					p.ZRem(ctx, f.key, t.member(f.id))
				}
				return nil
			})
		}
		cmds, err := send()
		if slices.ContainsFunc(cmds, func(c redis.Cmder) bool { return redis.HasErrorPrefix(c.Err(), "NOSCRIPT") }) &&
			slotsScript.Load(ctx, set.client).Err() == nil {
			// Redis lost the script (a restart, a failover): load it, once.
			_, err = send()
		}
		return err
	})
	if err != nil && len(doubt) > 0 {
		t.keep(doubt)
	}
}

// retire stops the loops once no slot is held: at once, or when the last
// is freed.
func (t *slotTable) retire() {
	t.mu.Lock()
	t.retiring = true
	idle := len(t.held) == 0 && !t.stopped
	if idle {
		t.stopped = true
	}
	t.mu.Unlock()
	if idle {
		t.stopLoops()
	}
}

// stopLoops stops the loops and sends the frees still queued, and the
// doubtful ones that no renewal will send now.
func (t *slotTable) stopLoops() {
	t.stopOnce.Do(func() {
		close(t.stop)
		t.done.Wait()
		t.resend()
		t.mu.Lock()
		t.doubtTaken = true
		t.mu.Unlock()
		for batch := drain(t.frees, nil, maxFreeBatch); len(batch) > 0; batch = drain(t.frees, batch[:0], maxFreeBatch) {
			t.send(batch)
		}
		close(t.idle)
	})
}

// SlotsIdle is closed once the store holds no slot and takes no more:
// after Close, when the last request that held one has ended. Until then
// the store renews and frees slots on its connection, which must stay
// open.
func (s *Store) SlotsIdle() <-chan struct{} {
	s.slotsMu.Lock()
	t := s.slots
	s.slotsMu.Unlock()
	if t == nil {
		done := make(chan struct{})
		close(done)
		return done
	}
	return t.idle
}
