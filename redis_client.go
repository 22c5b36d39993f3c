package ratelimit

import (
	"cmp"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// RedisSentinel names the master that Sentinel watches and the Sentinels.
type RedisSentinel struct {
	// Master is the master's name in the Sentinels' configuration.
	Master string `json:"master,omitempty"`
	// Addresses are the Sentinels, as host:port.
	Addresses []string `json:"addresses,omitempty"`
}

// RedisTLS sets up TLS to Redis.
type RedisTLS struct {
	// CA is a PEM file of the certificate authorities that may sign the
	// server's certificate. Default: the system's roots.
	CA string `json:"ca,omitempty"`
	// Cert and Key are PEM files of a client certificate and its key, for
	// servers that verify clients.
	Cert string `json:"cert,omitempty"`
	Key  string `json:"key,omitempty"`
	// InsecureSkipVerify accepts any server certificate. For tests only.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
}

const (
	defaultRedisAddress    = "redis://127.0.0.1:6379"
	defaultRedisPrefix     = "rl:"
	defaultRedisTimeout    = 100 * time.Millisecond
	defaultBreakerFailures = 5
	defaultBreakerCooldown = 2 * time.Second
	defaultDenyCacheSize   = 100000
	defaultLeaseTTL        = time.Second
)

// redisPool holds the clients, by connection settings, across reloads.
var redisPool = caddy.NewUsagePool()

// redisSettings is a RedisStore's configuration, checked and expanded,
// ready to build a client.
type redisSettings struct {
	key          string // the pool key: every setting that shapes the client
	newClient    func() redis.UniversalClient
	failures     int
	cooldown     time.Duration
	denyCapacity int
	batch        bool
	lease        leaseSize
	leaseTTL     time.Duration
}

// settings applies the defaults, expands placeholders, checks every value
// and reads the TLS files.
func (s *RedisStore) settings() (*redisSettings, error) {
	if err := s.validate(); err != nil {
		return nil, err
	}
	s.applyDefaults()
	cfg := &redisSettings{
		failures:     cmp.Or(s.BreakerFailures, defaultBreakerFailures),
		cooldown:     cmp.Or(time.Duration(s.BreakerCooldown), defaultBreakerCooldown),
		denyCapacity: cmp.Or(s.DenyCacheSize, defaultDenyCacheSize),
		batch:        s.Batch == nil || *s.Batch,
		leaseTTL:     cmp.Or(time.Duration(s.LeaseTTL), defaultLeaseTTL),
	}
	var err error
	if cfg.lease, err = parseLeaseSize(s.Lease); err != nil {
		return nil, err
	}
	repl := caddy.NewReplacer()
	c := &clientParams{expand: func(v string) string { return repl.ReplaceKnown(v, "") }}
	if c.tls, c.id.TLS, err = s.tlsConfig(c.expand); err != nil {
		return nil, err
	}
	c.username, c.password = c.expand(s.Username), c.expand(s.Password)
	// Everything that shapes the client goes into the pool key. The
	// password only as a hash, so that it sits in no map in clear.
	c.id.Username, c.id.Password, c.id.DB, c.id.PoolSize, c.id.Timeout = c.username, hashString(c.password), s.DB, s.PoolSize, s.timeout
	c.id.Breaker, c.id.DenyCache, c.id.Batch = fmt.Sprint(cfg.failures, cfg.cooldown), cfg.denyCapacity, cfg.batch

	if s.Sentinel != nil {
		cfg.newClient, err = s.sentinelClient(c)
	} else {
		cfg.newClient, err = s.nodeClient(c)
	}
	if err != nil {
		return nil, err
	}
	key, _ := json.Marshal(c.id)
	cfg.key = "redis/" + string(key)
	return cfg, nil
}

// applyDefaults fills the prefix and the timeout.
func (s *RedisStore) applyDefaults() {
	s.prefix = cmp.Or(s.Prefix, defaultRedisPrefix)
	s.timeout = cmp.Or(time.Duration(s.Timeout), defaultRedisTimeout)
}

// clientParams are the expanded settings shared by every kind of client,
// and the pool key that they and the addresses make.
type clientParams struct {
	expand             func(string) string
	username, password string
	tls                *tls.Config
	id                 struct {
		Nodes     []string
		Master    string
		Sentinels []string
		Username  string
		Password  string
		DB        int
		TLS       string
		PoolSize  int
		Breaker   string
		DenyCache int
		Batch     bool
		Timeout   time.Duration // it bounds the dials
	}
}

// oneTry is the retry policy of every client: one try per decision. A
// retry would spend the timeout, and a script whose answer was lost may
// have run, so must not run twice.
const (
	oneTryMaxRetries    = -1
	oneTryDialerRetries = 1
)

// sentinelClient makes a client of the master that Sentinel names.
func (s *RedisStore) sentinelClient(c *clientParams) (func() redis.UniversalClient, error) {
	master := c.expand(s.Sentinel.Master)
	var sentinels []string
	for _, raw := range s.Sentinel.Addresses {
		addr := c.expand(raw)
		if err := checkHostPort(addr); err != nil {
			return nil, fmt.Errorf("store redis: sentinel address %q: %v", raw, err)
		}
		sentinels = append(sentinels, addr)
	}
	c.id.Master, c.id.Sentinels = master, sentinels
	opts := &redis.FailoverOptions{
		MasterName:    master,
		SentinelAddrs: sentinels,
		Username:      c.username,
		Password:      c.password,
		// Sentinels that need a password mostly share the data nodes'.
		SentinelUsername:      c.username,
		SentinelPassword:      c.password,
		DB:                    s.DB,
		TLSConfig:             c.tls,
		PoolSize:              s.PoolSize,
		DialTimeout:           s.timeout,
		MaxRetries:            oneTryMaxRetries,
		DialerRetries:         oneTryDialerRetries,
		ContextTimeoutEnabled: true,
		// The Sentinels' connections and the master's, TLS included.
		Dialer: redisDialer(c.tls, s.timeout),
	}
	return func() redis.UniversalClient { return redis.NewFailoverClient(opts) }, nil
}

// nodeClient makes a client of one node, or of a Cluster when several
// addresses are given.
func (s *RedisStore) nodeClient(c *clientParams) (func() redis.UniversalClient, error) {
	addresses := s.Addresses
	if len(addresses) == 0 {
		addresses = []string{defaultRedisAddress}
	}
	var nodes []*redis.Options
	for _, raw := range addresses {
		o, err := parseRedisAddress(c.expand(raw))
		if err != nil {
			return nil, fmt.Errorf("store redis: address %q: %v", redactURL(raw), err)
		}
		nodes = append(nodes, o)
		c.id.Nodes = append(c.id.Nodes, o.Network+"|"+o.Addr+"|"+o.Username+"|"+hashString(o.Password)+"|"+strconv.Itoa(o.DB)+"|"+strconv.FormatBool(o.TLSConfig != nil))
	}
	first := nodes[0]
	first.Username = cmp.Or(c.username, first.Username)
	first.Password = cmp.Or(c.password, first.Password)
	first.DB = cmp.Or(s.DB, first.DB)
	if c.tls != nil {
		first.TLSConfig = c.tls.Clone()
		if first.TLSConfig.ServerName == "" && first.Network != "unix" {
			first.TLSConfig.ServerName, _, _ = net.SplitHostPort(first.Addr)
		}
	}
	if len(nodes) > 1 {
		return s.clusterClient(c, addresses, nodes)
	}
	first.PoolSize = s.PoolSize
	first.MaxRetries = oneTryMaxRetries
	first.DialerRetries = oneTryDialerRetries
	first.ContextTimeoutEnabled = true
	first.DialTimeout = s.timeout
	first.Dialer = redisDialer(first.TLSConfig, s.timeout)
	return func() redis.UniversalClient { return redis.NewClient(first) }, nil
}

// clusterClient makes a Cluster client from its seed nodes, which must
// agree on what a Cluster cannot vary.
func (s *RedisStore) clusterClient(c *clientParams, addresses []string, nodes []*redis.Options) (func() redis.UniversalClient, error) {
	first := nodes[0]
	for i, o := range nodes {
		raw := addresses[i]
		switch {
		case o.Network == "unix":
			return nil, fmt.Errorf("store redis: address %q: a Cluster needs TCP addresses, not a unix socket", redactURL(raw))
		case (o.TLSConfig != nil) != (first.TLSConfig != nil) && c.tls == nil:
			return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses mix redis:// and rediss://", redactURL(raw))
		case o.DB != 0 || s.DB != 0:
			return nil, fmt.Errorf("store redis: address %q: a Cluster has only database 0", redactURL(raw))
		case i > 0 && c.username == "" && o.Username != first.Username:
			return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses give different usernames", redactURL(raw))
		case i > 0 && c.password == "" && o.Password != first.Password:
			return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses give different passwords", redactURL(raw))
		}
	}
	opts := &redis.ClusterOptions{
		Username:              first.Username,
		Password:              first.Password,
		TLSConfig:             first.TLSConfig,
		PoolSize:              s.PoolSize,
		MaxRetries:            oneTryMaxRetries,
		DialerRetries:         oneTryDialerRetries,
		ContextTimeoutEnabled: true,
		DialTimeout:           s.timeout,
	}
	for _, o := range nodes {
		opts.Addrs = append(opts.Addrs, o.Addr)
	}
	if opts.TLSConfig != nil {
		// Cluster nodes are many hosts: verify each by its own name.
		opts.TLSConfig.ServerName = ""
	}
	opts.Dialer = redisDialer(opts.TLSConfig, s.timeout)
	return func() redis.UniversalClient { return redis.NewClusterClient(opts) }, nil
}

// validate checks what needs no expansion, for adapt and provision.
func (s *RedisStore) validate() error {
	switch {
	case s.Sentinel != nil && len(s.Addresses) > 0:
		return errors.New("store redis: give address or sentinel, not both")
	case s.Sentinel != nil && s.Sentinel.Master == "":
		return errors.New("store redis: sentinel: the master's name is missing")
	case s.Sentinel != nil && len(s.Sentinel.Addresses) == 0:
		return fmt.Errorf("store redis: sentinel %q: no sentinel address", s.Sentinel.Master)
	case s.DB < 0:
		return fmt.Errorf("store redis: db %d: must be 0 or more", s.DB)
	case s.Timeout < 0:
		return fmt.Errorf("store redis: timeout %s: must be above 0", time.Duration(s.Timeout))
	case s.PoolSize < 0:
		return fmt.Errorf("store redis: pool_size %d: must be at least 1", s.PoolSize)
	case s.BreakerFailures < 0:
		return fmt.Errorf("store redis: breaker_failures %d: must be at least 1", s.BreakerFailures)
	case s.BreakerCooldown < 0:
		return fmt.Errorf("store redis: breaker_cooldown %s: must be above 0", time.Duration(s.BreakerCooldown))
	case s.LeaseTTL < 0:
		return fmt.Errorf("store redis: lease_ttl %s: must be above 0", time.Duration(s.LeaseTTL))
	case s.DenyCacheSize < 0:
		return fmt.Errorf("store redis: deny_cache_size %d: must be at least 1", s.DenyCacheSize)
	}
	if t := s.TLS; t != nil && (t.Cert == "") != (t.Key == "") {
		return errors.New("store redis: tls: give cert and key together")
	}
	return nil
}

// tlsConfig reads the tls block's files. The id it returns names their
// contents, so that renewed certificates make a new client.
func (s *RedisStore) tlsConfig(expand func(string) string) (*tls.Config, string, error) {
	t := s.TLS
	if t == nil {
		return nil, "", nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: t.InsecureSkipVerify}
	h := sha256.New()
	fmt.Fprint(h, t.InsecureSkipVerify)
	if t.CA != "" {
		pem, err := os.ReadFile(expand(t.CA))
		if err != nil {
			return nil, "", fmt.Errorf("store redis: tls ca %q: %v", t.CA, err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, "", fmt.Errorf("store redis: tls ca %q: no PEM certificate in it", t.CA)
		}
		h.Write(pem)
	}
	if t.Cert != "" {
		certPEM, err := os.ReadFile(expand(t.Cert))
		if err != nil {
			return nil, "", fmt.Errorf("store redis: tls cert %q: %v", t.Cert, err)
		}
		keyPEM, err := os.ReadFile(expand(t.Key))
		if err != nil {
			return nil, "", fmt.Errorf("store redis: tls key %q: %v", t.Key, err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, "", fmt.Errorf("store redis: tls cert %q and key %q: %v", t.Cert, t.Key, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
		h.Write(certPEM)
		h.Write(keyPEM)
	}
	return cfg, hex.EncodeToString(h.Sum(nil)), nil
}

// parseRedisAddress reads a redis://, rediss:// or unix:// URL, or a plain
// host:port.
func parseRedisAddress(addr string) (*redis.Options, error) {
	if !strings.Contains(addr, "://") {
		if err := checkHostPort(addr); err != nil {
			return nil, err
		}
		return &redis.Options{Network: "tcp", Addr: addr}, nil
	}
	o, err := redis.ParseURL(addr)
	if err != nil {
		// go-redis quotes the URL, with its password, in some errors.
		msg := err.Error()
		if strings.Contains(msg, "://") {
			msg = "not a redis://, rediss:// or unix:// URL"
		}
		return nil, errors.New(strings.TrimPrefix(msg, "redis: "))
	}
	return o, nil
}

// redisDialer dials within timeout and the caller's deadline, TLS handshake
// included, which go-redis's own TLS dialer does not. go-redis dials apart
// from the request that needs the connection, so without the timeout a
// Redis or Sentinel that accepts and then hangs would hold each dial, and
// a dial slot, for 5 s after the decision gave up.
func redisDialer(cfg *tls.Config, timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	nd := &net.Dialer{Timeout: timeout, KeepAlive: 30 * time.Second}
	if cfg == nil {
		return nd.DialContext
	}
	td := &tls.Dialer{NetDialer: nd, Config: cfg}
	return td.DialContext
}

func checkHostPort(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil || host == "" {
		return errors.New("want a URL such as redis://host:6379, or host:port")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("port %q: want 1 to 65535", port)
	}
	return nil
}

// redactURL hides the password of a URL, for error messages.
func redactURL(s string) string {
	scheme, rest, ok := strings.Cut(s, "://")
	if !ok {
		return s
	}
	at := strings.LastIndex(rest, "@")
	if at < 0 {
		return s
	}
	user, _, hasPass := strings.Cut(rest[:at], ":")
	if !hasPass {
		return s
	}
	return scheme + "://" + user + ":xxxxx" + rest[at:]
}

func hashString(s string) string {
	if s == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// redisConn is what the pool shares between configs: the client, its
// breaker and its deny cache.
type redisConn struct {
	client  redis.UniversalClient
	breaker breaker
	denied  *denyCache
	batcher *redisBatcher // nil unless Batch
	stop    context.CancelFunc
	// now is the breaker's and the deny cache's clock: monotonicMicros,
	// which tests replace.
	now func() int64
}

func newRedisConn(cfg *redisSettings, logger *zap.Logger) *redisConn {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	// A flapping Redis turns the breaker often; a few lines a second say so.
	logger = logger.WithOptions(zap.WrapCore(func(c zapcore.Core) zapcore.Core {
		return zapcore.NewSamplerWithOptions(c, time.Second, 2, 0)
	}))
	c := &redisConn{
		client: cfg.newClient(),
		breaker: breaker{threshold: int64(cfg.failures), cooldown: cfg.cooldown.Microseconds(), changed: func(open bool) {
			if open {
				logger.Error("redis store unreachable: circuit breaker open, on_store_error decides", zap.Int("failures", cfg.failures), zap.Duration("cooldown", cfg.cooldown))
			} else {
				logger.Warn("redis store answering again: circuit breaker closed")
			}
		}},
		denied: newDenyCache(cfg.denyCapacity),
		stop:   cancel,
		now:    monotonicMicros,
	}
	if cfg.batch {
		c.batcher = newRedisBatcher(c.client, batchLoops, maxBatch)
	}
	// Connect and load the script in the background, so that the first
	// decisions do not pay for it within their timeout. A Redis that is
	// down is no error here: decisions will say so.
	go func() {
		defer cancel()
		_ = bucketScript.Load(ctx, c.client).Err()
	}()
	return c
}

// Destruct closes the client once no config uses it.
func (c *redisConn) Destruct() error {
	c.stop()
	if c.batcher != nil {
		c.batcher.close()
	}
	return c.client.Close()
}
