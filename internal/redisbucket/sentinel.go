package redisbucket

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// masterWatch follows the address of the master that the Sentinels name:
// it subscribes to each Sentinel's +switch-master, and asks for the
// master's address whenever it (re)subscribes and when nothing has come
// for a while, so that a switch missed while a link was down is seen.
// go-redis's failover client follows the master too, but tells nobody;
// this tells the connection, which then closes its breaker, logs the
// switch and reports the master (Conn.Master).
type masterWatch struct {
	name      string
	sentinels []*redis.Options
	// switched hears each change of master after the first address.
	switched func(from, to string)
	log      *logRoute

	mu   sync.Mutex
	addr string
}

// masterRecheck is how long a watch waits on a quiet subscription before
// it asks for the master's address again.
const masterRecheck = 30 * time.Second

// start follows every Sentinel until ctx ends.
func (w *masterWatch) start(ctx context.Context) {
	for _, o := range w.sentinels {
		go w.follow(ctx, o)
	}
}

func (w *masterWatch) current() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.addr
}

// set records the master's address, and tells switched when it changed.
func (w *masterWatch) set(addr string) {
	w.mu.Lock()
	from := w.addr
	if addr == from {
		w.mu.Unlock()
		return
	}
	w.addr = addr
	w.mu.Unlock()
	if from == "" {
		w.log.logger().Info("redis store: Sentinel names the master", zap.String("master_name", w.name), zap.String("master", addr))
		return
	}
	w.switched(from, addr)
}

// follow listens to one Sentinel until ctx ends, subscribing again after
// the link fails: a second later, then twice as long after each attempt
// that fails too, up to masterRecheck, so that a Sentinel that is down
// costs a dial (and a sampled line) now and then, not every second.
func (w *masterWatch) follow(ctx context.Context, o *redis.Options) {
	c := redis.NewSentinelClient(o)
	defer c.Close()
	wait := time.Second
	for ctx.Err() == nil {
		if w.listen(ctx, c) {
			wait = time.Second
		} else {
			wait = min(2*wait, masterRecheck)
		}
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
}

// listen subscribes to one Sentinel's master switches and hears them
// until the link fails or ctx ends. It says whether it subscribed.
func (w *masterWatch) listen(ctx context.Context, c *redis.SentinelClient) bool {
	ps := c.Subscribe(ctx, "+switch-master")
	defer ps.Close()
	// Close interrupts a read that waits on the Sentinel.
	defer context.AfterFunc(ctx, func() { _ = ps.Close() })()
	if err := w.ask(ctx, c, func(ctx context.Context) error { _, err := ps.Receive(ctx); return err }); err != nil {
		return false
	}
	for ctx.Err() == nil {
		msg, err := ps.ReceiveTimeout(ctx, masterRecheck)
		var netErr net.Error
		switch {
		case errors.As(err, &netErr) && netErr.Timeout():
			_ = w.ask(ctx, c, nil)
			continue
		case err != nil:
			return true
		}
		if m, ok := msg.(*redis.Message); ok && m.Channel == "+switch-master" {
			// <master name> <old ip> <old port> <new ip> <new port>
			if f := strings.Fields(m.Payload); len(f) == 5 && f[0] == w.name {
				w.set(net.JoinHostPort(f[3], f[4]))
			}
		}
	}
	return true
}

// ask runs first, when given (the subscription's confirmation), then asks
// the Sentinel for the master's address, each within a bound, and
// records the address.
func (w *masterWatch) ask(ctx context.Context, c *redis.SentinelClient, first func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if first != nil {
		if err := first(ctx); err != nil {
			return err
		}
	}
	addr, err := c.GetMasterAddrByName(ctx, w.name).Result()
	if err != nil || len(addr) != 2 {
		return err
	}
	w.set(net.JoinHostPort(addr[0], addr[1]))
	return nil
}
