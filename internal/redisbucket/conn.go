package redisbucket

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Conn is a connection to Redis that every config with the same settings
// shares, and that outlives reloads: the client, its circuit breaker, its
// deny cache and its batcher.
type Conn struct {
	// cur is the client in use, and its batcher: one address that turns
	// out to be a Cluster node is followed by a Cluster client (follow).
	cur          atomic.Pointer[clientSet]
	breaker      breaker
	denied       *denyCache
	batch        bool
	timeout      time.Duration
	denyCapacity int
	// log is where the connection's lines go: the newest config's log.
	log  logRoute
	stop context.CancelFunc

	// asCluster makes the Cluster client that one address is followed
	// by; nil once it has been, and for the other kinds of connection.
	followMu  sync.Mutex
	asCluster func() (redis.UniversalClient, error)
	address   string
	closed    bool // under followMu
	// master follows the master that Sentinel names (Sentinel only).
	master *masterWatch

	// now is the breaker's and the deny cache's clock, monotonic
	// microseconds; tests replace it.
	now func() int64
	// debts are the keys whose credit charge left them in debt, for the
	// lease tables of the configs loaded after (lease_credit.go).
	debts *debtBook
	// handshakes counts the handshakes of the connection's clients.
	handshakes *handshakes
}

// clientSet is a client and the batcher that sends through it (nil
// unless Batch).
type clientSet struct {
	client     redis.UniversalClient
	batcher    *redisBatcher
	handshakes *handshakes
}

func (c *Conn) newSet(client redis.UniversalClient) *clientSet {
	set := &clientSet{client: client, handshakes: c.handshakes}
	if c.batch {
		set.batcher = newRedisBatcher(client, c.handshakes, batchLoops, maxBatch)
	}
	return set
}

func (set *clientSet) close() error {
	if set.batcher != nil {
		set.batcher.close()
	}
	return set.client.Close()
}

// client is the client in use.
func (c *Conn) client() redis.UniversalClient { return c.cur.Load().client }

// batcher is the batcher in use, nil unless Batch.
func (c *Conn) batcher() *redisBatcher { return c.cur.Load().batcher }

// Connect makes the connection's client. It connects and loads the script
// in the background, so that the first decisions do not pay for it within
// their timeout; a Redis that is down is no error here: decisions say so.
// With one address, it asks that node first whether it is a Cluster's,
// and follows the Cluster if so.
//
// The connection's lines go to logger while no Store of it names its own
// (StoreOptions.Logger), and go-redis's too (the connection made last
// names it).
func (p *Plan) Connect(logger *zap.Logger) *Conn {
	o := p.o
	life, stop := context.WithCancel(context.Background())
	c := &Conn{
		denied:       newDenyCache(o.DenyCacheSize),
		batch:        o.Batch,
		timeout:      o.Timeout,
		denyCapacity: o.DenyCacheSize,
		stop:         stop,
		asCluster:    p.asCluster,
		now:          monotonicMicros,
		debts:        newDebtBook(o.DenyCacheSize),
		handshakes:   p.handshakes,
	}
	logger = sampled(logger)
	c.log.fallBackTo(logger)
	goRedisRoute.fallBackTo(logger)
	routeGoRedisLog()
	if len(o.Addresses) > 0 {
		c.address = redactURL(o.Addresses[0])
	}
	c.breaker = breaker{threshold: int64(o.BreakerFailures), cooldown: o.BreakerCooldown.Microseconds(), changed: func(open bool) {
		logger := c.log.logger()
		if open {
			logger.Warn("redis store unreachable: circuit breaker open, on_store_error decides",
				zap.String("cause", causeText(c.breaker.cause())), zap.Int("failures", o.BreakerFailures), zap.Duration("cooldown", o.BreakerCooldown))
		} else {
			logger.Warn("redis store answering again: circuit breaker closed")
		}
	}}
	c.cur.Store(c.newSet(p.newClient()))
	if o.Sentinel != nil {
		c.master = &masterWatch{name: o.Sentinel.Master, sentinels: p.sentinels, switched: c.masterSwitched, log: &c.log}
		c.master.start(life)
	}
	// The script is read here, not in the goroutine, which may run after
	// the caller has gone on (a test that swaps bucketScript).
	script := bucketScript
	go func() {
		ctx, cancel := context.WithTimeout(life, 10*time.Second)
		defer cancel()
		if p.asCluster != nil {
			c.detectCluster(ctx)
		}
		_ = script.Load(ctx, c.client()).Err()
	}()
	return c
}

// UseLogger makes logger take the connection's lines, and go-redis's, until
// a newer one does or release is called; then the newest left takes them
// again, or Connect's. Each config that uses a shared connection hands it
// its logger, since an older config's log is closed once it unloads.
func (c *Conn) UseLogger(logger *zap.Logger) (release func()) {
	logger = sampled(logger)
	own, goRedis := c.log.use(logger), goRedisRoute.use(logger)
	return func() {
		own()
		goRedis()
	}
}

// Close closes the client.
func (c *Conn) Close() error {
	c.stop()
	c.followMu.Lock()
	defer c.followMu.Unlock()
	c.closed = true
	return c.cur.Load().close()
}

// causeText is a failure as the breaker's lines name it.
func causeText(err error) string {
	if err == nil {
		return ""
	}
	return strings.TrimPrefix(err.Error(), "redis store: ")
}

// detectCluster asks the one node given whether Cluster mode is on, and
// follows the Cluster if it is. A node that does not answer says nothing:
// a MOVED reply later does (follow).
func (c *Conn) detectCluster(ctx context.Context) {
	info, err := c.client().Info(ctx, "cluster").Result()
	if err == nil && strings.Contains(info, "cluster_enabled:1") {
		c.follow("INFO cluster says cluster_enabled:1")
	}
}

// isRedirect says whether err is a Cluster's MOVED or ASK reply, which
// only a Cluster client follows.
func isRedirect(err error) bool {
	if err == nil {
		return false
	}
	_, moved := redis.IsMovedError(err)
	_, ask := redis.IsAskError(err)
	return moved || ask
}

// send sends a call on the client in use. A MOVED or ASK reply on a
// connection of one address makes it follow the Cluster that the node
// belongs to, and send the call again, now where its keys live: the node
// ran nothing. Every call to Redis goes through it or, a script call,
// through followed (Store.callBy), so that whichever first hears the
// redirect, the connection follows.
func (c *Conn) send(ctx context.Context, call func(context.Context, *clientSet) error) error {
	err := call(ctx, c.cur.Load())
	if c.followed(err) {
		err = call(ctx, c.cur.Load())
	}
	return err
}

// followed says whether err, a call's, made the connection follow a
// Cluster (send), so that the call goes again.
func (c *Conn) followed(err error) bool {
	return isRedirect(err) && c.follow("a MOVED or ASK reply")
}

// follow makes a one-address connection follow the Cluster its node
// belongs to: a Cluster client seeded with that address replaces the node
// client, which a node of a Cluster answers MOVED for most keys. It says
// whether the connection follows a Cluster now.
func (c *Conn) follow(seen string) bool {
	c.followMu.Lock()
	defer c.followMu.Unlock()
	if c.asCluster == nil || c.closed {
		_, isCluster := c.client().(*redis.ClusterClient)
		return isCluster
	}
	newCluster := c.asCluster
	c.asCluster = nil
	client, err := newCluster()
	if err != nil {
		c.log.logger().Error("redis store: this is a Redis Cluster, and the address given cannot seed a Cluster client: list two or more of the Cluster's nodes",
			zap.String("address", c.address), zap.String("seen", seen), zap.Error(err))
		return false
	}
	old := c.cur.Swap(c.newSet(client))
	c.log.logger().Warn("redis store: the address is a node of a Redis Cluster; following the Cluster from it. List two or more of its nodes, so that the Cluster is found while this one is down",
		zap.String("address", c.address), zap.String("seen", seen))
	// Calls under way on the node client end within the timeout.
	time.AfterFunc(4*c.timeout+time.Second, func() { _ = old.close() })
	script := bucketScript
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = script.Load(ctx, client).Err()
	}()
	return true
}

// masterSwitched hears the Sentinels name a new master. The breaker may be
// open because the old master failed; the client dials the new one from
// now on, so the breaker closes at once rather than hold calls for the
// rest of its cool-down.
func (c *Conn) masterSwitched(from, to string) {
	wasOpen := c.breaker.reset()
	c.log.logger().Warn("redis store: Sentinel names a new master; the client follows it",
		zap.String("master", to), zap.String("previous", from), zap.Bool("breaker_closed", wasOpen))
}

// Master is the address of the master that Sentinel names, as this node
// last heard it; "" without Sentinel, or before it has answered.
func (c *Conn) Master() string {
	if c.master == nil {
		return ""
	}
	return c.master.current()
}

// processStart anchors the monotonic clock; one is added so that time 0
// is before every reading.
var processStart = time.Now()

func monotonicMicros() int64 { return time.Since(processStart).Microseconds() + 1 }
