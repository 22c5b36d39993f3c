package ratelimit

import (
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
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

func init() {
	caddy.RegisterModule(RedisStore{})
}

// RedisStore keeps buckets in Redis, so that a fleet of Caddy nodes enforces
// one limit per client. Each decision is one atomic Lua script on one key,
// timed by the Redis server's clock, so nodes with skewed clocks agree and a
// Cluster can spread the keys over its masters.
//
// A denial is remembered on this node until the client may retry, so a
// flood from one client costs Redis nothing. When Redis fails or does not
// answer within Timeout, Take returns an error and the handler applies
// on_store_error; after BreakerFailures failures in a row the store stops
// calling Redis for BreakerCooldown, then lets one request probe it.
//
// The client, its circuit breaker and its deny cache are shared by every
// loaded config with the same connection settings, and survive reloads.
type RedisStore struct {
	// Addresses are the Redis nodes: redis://, rediss:// (TLS) or unix://
	// URLs, or plain host:port. One address is a single node; several are
	// the seed nodes of a Redis Cluster. A URL may carry the username,
	// password and database (redis://user:pass@host:6379/0). Placeholders
	// such as {env.REDIS_URL} are expanded. Default redis://127.0.0.1:6379.
	Addresses []string `json:"addresses,omitempty"`

	// Sentinel finds the master through Redis Sentinel instead of
	// Addresses, and follows it across failovers.
	Sentinel *RedisSentinel `json:"sentinel,omitempty"`

	// Username for Redis ACLs (AUTH username password). It overrides a
	// username given in an address URL. Placeholders are expanded.
	Username string `json:"username,omitempty"`

	// Password for AUTH. It overrides a password given in an address URL.
	// Placeholders are expanded, so that it can stay out of the config:
	// {env.REDIS_PASSWORD}.
	Password string `json:"password,omitempty"`

	// DB is the database number, for a single node or Sentinel; a Cluster
	// has only database 0. It overrides a database given in an address URL.
	// Default 0.
	DB int `json:"db,omitempty"`

	// TLS turns TLS on, for every address, and sets it up. rediss:// URLs
	// turn TLS on without it, verifying the server with the system's roots.
	TLS *RedisTLS `json:"tls,omitempty"`

	// Prefix starts every key this store writes, so that a Redis can be
	// shared with other uses. Default "rl:".
	Prefix string `json:"prefix,omitempty"`

	// Timeout bounds each decision, including the wait for a connection.
	// A decision that takes longer fails, and on_store_error applies. It
	// bounds each dial too, TLS handshake included, to Redis and to the
	// Sentinels. Default 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// PoolSize is the most connections kept per Redis node. Default 10 per
	// CPU, as go-redis does.
	PoolSize int `json:"pool_size,omitempty"`

	// BreakerFailures is how many failed decisions in a row open the
	// circuit breaker. Default 5.
	BreakerFailures int `json:"breaker_failures,omitempty"`

	// BreakerCooldown is how long the open breaker fails decisions at once,
	// without calling Redis, before it lets one through to probe. Default 2s.
	BreakerCooldown caddy.Duration `json:"breaker_cooldown,omitempty"`

	// DenyCacheSize bounds how many denied buckets this node remembers.
	// When it is full, expired entries go first, then any. Default 100000.
	DenyCacheSize int `json:"deny_cache_size,omitempty"`

	// Batch sends concurrent decisions to Redis together, as one pipeline
	// of EVALSHA, instead of one command each: still one round trip per
	// decision, within the same timeout, but far fewer writes and reads
	// for Redis and for Caddy under load (bench/README.md has the figures).
	// false sends each decision on its own. Default true.
	Batch *bool `json:"batch,omitempty"`

	conn    *redisConn
	poolKey string
	prefix  string
	timeout time.Duration

	// clockOffset is added to the Redis server's TIME. Only tests set it,
	// to replay traces faster than real time; it is always 0 otherwise.
	clockOffset int64
}

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

// CaddyModule returns the Caddy module information.
func (RedisStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.redis",
		New: func() caddy.Module { return new(RedisStore) },
	}
}

const (
	defaultRedisAddress    = "redis://127.0.0.1:6379"
	defaultRedisPrefix     = "rl:"
	defaultRedisTimeout    = 100 * time.Millisecond
	defaultBreakerFailures = 5
	defaultBreakerCooldown = 2 * time.Second
	defaultDenyCacheSize   = 100000
)

// redisPool holds the clients, by connection settings, across reloads.
var redisPool = caddy.NewUsagePool()

// Provision checks the settings and takes, or makes, the client for them.
// It never talks to Redis, so that a config loads while Redis is down.
func (s *RedisStore) Provision(ctx caddy.Context) error {
	cfg, err := s.settings()
	if err != nil {
		return err
	}
	val, _, err := redisPool.LoadOrNew(cfg.key, func() (caddy.Destructor, error) {
		return newRedisConn(cfg, ctx.Logger()), nil
	})
	if err != nil {
		return err
	}
	s.conn = val.(*redisConn)
	s.poolKey = cfg.key
	return nil
}

// Cleanup releases this config's hold on the client; the last config to
// let go closes it.
func (s *RedisStore) Cleanup() error {
	if s.poolKey == "" {
		return nil
	}
	_, err := redisPool.Delete(s.poolKey)
	s.poolKey = ""
	return err
}

// redisSettings is a RedisStore's configuration, checked and expanded,
// ready to build a client.
type redisSettings struct {
	key          string // the pool key: every setting that shapes the client
	newClient    func() redis.UniversalClient
	failures     int
	cooldown     time.Duration
	denyCapacity int
	batch        bool
}

// settings applies the defaults, expands placeholders, checks every value
// and reads the TLS files.
func (s *RedisStore) settings() (*redisSettings, error) {
	if err := s.checkFields(); err != nil {
		return nil, err
	}
	repl := caddy.NewReplacer()
	expand := func(v string) string { return repl.ReplaceKnown(v, "") }

	s.prefix = s.Prefix
	if s.prefix == "" {
		s.prefix = defaultRedisPrefix
	}
	s.timeout = time.Duration(s.Timeout)
	if s.timeout == 0 {
		s.timeout = defaultRedisTimeout
	}
	cfg := &redisSettings{
		failures:     s.BreakerFailures,
		cooldown:     time.Duration(s.BreakerCooldown),
		denyCapacity: s.DenyCacheSize,
		batch:        s.Batch == nil || *s.Batch,
	}
	if cfg.failures == 0 {
		cfg.failures = defaultBreakerFailures
	}
	if cfg.cooldown == 0 {
		cfg.cooldown = defaultBreakerCooldown
	}
	if cfg.denyCapacity == 0 {
		cfg.denyCapacity = defaultDenyCacheSize
	}

	tlsConfig, tlsID, err := s.tlsConfig(expand)
	if err != nil {
		return nil, err
	}
	username, password := expand(s.Username), expand(s.Password)

	// Everything that shapes the client goes into the pool key. The
	// password only as a hash, so that it sits in no map in clear.
	id := struct {
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
	}{Username: username, DB: s.DB, TLS: tlsID, PoolSize: s.PoolSize, Timeout: s.timeout,
		Breaker: fmt.Sprint(cfg.failures, cfg.cooldown), DenyCache: cfg.denyCapacity, Batch: cfg.batch}

	if s.Sentinel != nil {
		master := expand(s.Sentinel.Master)
		var sentinels []string
		for _, raw := range s.Sentinel.Addresses {
			addr := expand(raw)
			if err := checkHostPort(addr); err != nil {
				return nil, fmt.Errorf("store redis: sentinel address %q: %v", raw, err)
			}
			sentinels = append(sentinels, addr)
		}
		id.Master, id.Sentinels = master, sentinels
		opts := &redis.FailoverOptions{
			MasterName:    master,
			SentinelAddrs: sentinels,
			Username:      username,
			Password:      password,
			DB:            s.DB,
			TLSConfig:     tlsConfig,
			PoolSize:      s.PoolSize,
			DialTimeout:   s.timeout,
			// The Sentinels' connections and the master's, TLS included.
			Dialer: redisDialer(tlsConfig, s.timeout),
		}
		// Sentinels that need a password mostly share the data nodes'.
		opts.SentinelUsername, opts.SentinelPassword = username, password
		// One try per decision: a retry would spend the timeout, and a
		// script whose answer was lost may have run, so must not run twice.
		opts.MaxRetries = -1
		opts.DialerRetries = 1
		opts.ContextTimeoutEnabled = true
		cfg.newClient = func() redis.UniversalClient { return redis.NewFailoverClient(opts) }
	} else {
		addresses := s.Addresses
		if len(addresses) == 0 {
			addresses = []string{defaultRedisAddress}
		}
		var nodes []*redis.Options
		for _, raw := range addresses {
			o, err := parseRedisAddress(expand(raw))
			if err != nil {
				return nil, fmt.Errorf("store redis: address %q: %v", redactURL(raw), err)
			}
			nodes = append(nodes, o)
			id.Nodes = append(id.Nodes, o.Network+"|"+o.Addr+"|"+o.Username+"|"+hashString(o.Password)+"|"+strconv.Itoa(o.DB)+"|"+strconv.FormatBool(o.TLSConfig != nil))
		}
		first := nodes[0]
		if username != "" {
			first.Username = username
		}
		if password != "" {
			first.Password = password
		}
		if s.DB != 0 {
			first.DB = s.DB
		}
		if tlsConfig != nil {
			first.TLSConfig = tlsConfig.Clone()
			if first.TLSConfig.ServerName == "" && first.Network != "unix" {
				first.TLSConfig.ServerName, _, _ = net.SplitHostPort(first.Addr)
			}
		}
		if len(nodes) == 1 {
			first.PoolSize = s.PoolSize
			first.MaxRetries = -1
			first.DialerRetries = 1
			first.ContextTimeoutEnabled = true
			first.DialTimeout = s.timeout
			first.Dialer = redisDialer(first.TLSConfig, s.timeout)
			cfg.newClient = func() redis.UniversalClient { return redis.NewClient(first) }
		} else {
			opts := &redis.ClusterOptions{
				Username:              first.Username,
				Password:              first.Password,
				TLSConfig:             first.TLSConfig,
				PoolSize:              s.PoolSize,
				MaxRetries:            -1,
				DialerRetries:         1,
				ContextTimeoutEnabled: true,
				DialTimeout:           s.timeout,
			}
			for i, o := range nodes {
				raw := addresses[i]
				switch {
				case o.Network == "unix":
					return nil, fmt.Errorf("store redis: address %q: a Cluster needs TCP addresses, not a unix socket", redactURL(raw))
				case (o.TLSConfig != nil) != (nodes[0].TLSConfig != nil) && tlsConfig == nil:
					return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses mix redis:// and rediss://", redactURL(raw))
				case o.DB != 0 || s.DB != 0:
					return nil, fmt.Errorf("store redis: address %q: a Cluster has only database 0", redactURL(raw))
				case i > 0 && username == "" && o.Username != nodes[0].Username:
					return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses give different usernames", redactURL(raw))
				case i > 0 && password == "" && o.Password != nodes[0].Password:
					return nil, fmt.Errorf("store redis: address %q: the Cluster's addresses give different passwords", redactURL(raw))
				}
				opts.Addrs = append(opts.Addrs, o.Addr)
			}
			if opts.TLSConfig != nil {
				// Cluster nodes are many hosts: verify each by its own name.
				opts.TLSConfig.ServerName = ""
			}
			opts.Dialer = redisDialer(opts.TLSConfig, s.timeout)
			cfg.newClient = func() redis.UniversalClient { return redis.NewClusterClient(opts) }
		}
	}
	id.Password = hashString(password)
	key, _ := json.Marshal(id)
	cfg.key = "redis/" + string(key)
	return cfg, nil
}

// checkFields checks what needs no expansion, for adapt and provision.
func (s *RedisStore) checkFields() error {
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

// takeScript applies one request to one bucket, atomically, with the math
// of bucket.go's Take and Peek, in Lua's doubles: every figure stays below
// 2^53, so they are exact, and idiv corrects the rounding of a quotient.
//
// KEYS[1] is the bucket, stored as "<fullAt> <slack>" (microseconds of the
// server's TIME) and expiring when the bucket is full again, when it is the
// same as no bucket. A denial writes nothing.
//
// ARGV: capacity, rate tokens, rate interval (µs), cost (0 peeks), and
// optionally microseconds to add to TIME, which only tests pass.
//
// It returns {allowed (0|1), remaining, retry after, reset after, now}.
//
// It reads TIME and then writes, which Redis before 5 refuses unless the
// script replicates its effects rather than itself: replicate_commands
// asks for that on 3.2 and 4, and does nothing from 5 on (7 only keeps it
// for old scripts). Older Redis refuses the write; the error says why.
const takeScript = `
if redis.replicate_commands then redis.replicate_commands() end
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
  return q
end
local function ceildiv(a, b) return idiv(a + b - 1, b) end

local capacity = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local interval = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[5] or '0')
local units = capacity * interval

local full_at, slack = 0, 0
local v = redis.call('GET', KEYS[1])
if v then
  local a, b = string.match(v, '^(%d+) (%d+)$')
  if not a then
    return redis.error_reply('rate_limit: key ' .. KEYS[1] .. ' does not hold a bucket')
  end
  full_at, slack = tonumber(a), tonumber(b)
end

local deficit = 0
if now < full_at then
  deficit = (full_at - now) * tokens - slack
  if deficit > units or deficit < 0 then deficit = units end
end
local level = units - deficit

if cost == 0 then
  local allowed = 0
  if level >= interval then allowed = 1 end
  return {allowed, idiv(level, interval), 0, ceildiv(deficit, tokens), now}
end
local need = cost * interval
if level < need then
  return {0, idiv(level, interval), ceildiv(need - level, tokens), ceildiv(deficit, tokens), now}
end
deficit = deficit + need
local refill = ceildiv(deficit, tokens)
local ok = redis.pcall('SET', KEYS[1], string.format('%d %d', now + refill, refill * tokens - deficit),
  'PX', ceildiv(refill, 1000) + 1)
if type(ok) == 'table' and ok.err then
  return redis.error_reply('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. ok.err)
end
return {1, idiv(level - need, interval), 0, refill, now}
`

// bucketScript runs takeScript by EVALSHA, and by EVAL when Redis answers
// NOSCRIPT (a restart, a failover, SCRIPT FLUSH), which loads it again.
var bucketScript = redis.NewScript(takeScript)

// errBreakerOpen fails decisions while the breaker is open.
var errBreakerOpen = errors.New("redis store: circuit breaker open after repeated failures; not calling Redis until the cool-down ends")

// key is the bucket's Redis key: the prefix, then the policy and the tier,
// each after its length in bytes, then a hash of the keyer and the value,
// so that client values never reach Redis:
//
//	rl:<len>:<policy>:<len>:<tier>:<32 hex digits>
//
// The lengths keep names apart that hold ":" (policy "a:b" with tier "c"
// and policy "a" with tier "b:c"). It is one key per bucket, with no hash
// tag of its own, so a Cluster spreads the buckets over its masters.
func (s *RedisStore) key(b *Bucket) string {
	sum := bucketDigest(b)
	buf := make([]byte, 0, len(s.prefix)+len(b.Policy)+len(b.Tier)+16+32)
	buf = append(buf, s.prefix...)
	for _, part := range [...]string{b.Policy, b.Tier} {
		buf = strconv.AppendInt(buf, int64(len(part)), 10)
		buf = append(buf, ':')
		buf = append(buf, part...)
		buf = append(buf, ':')
	}
	buf = hex.AppendEncode(buf, sum[:16])
	return string(buf)
}

// Take implements Store.
func (s *RedisStore) Take(ctx context.Context, b *Bucket, l Limit, cost int64) (Result, error) {
	key := s.key(b)
	start := s.conn.now()
	res, epoch, ok := s.conn.denied.get(key, l, cost, start)
	if ok {
		return res, nil
	}
	res, _, err := s.run(ctx, key, l, cost)
	if err == nil && !res.Allowed {
		s.conn.denied.put(key, epoch, l, cost, start, res)
	}
	return res, err
}

// Peek implements Store.
func (s *RedisStore) Peek(ctx context.Context, b *Bucket, l Limit) (Result, error) {
	res, _, err := s.run(ctx, s.key(b), l, 0)
	return res, err
}

// Reset implements Store. It forgets the bucket's denial on this node
// whether or not Redis answers; other nodes may still answer from their
// deny caches until the retry time they were given.
func (s *RedisStore) Reset(ctx context.Context, b *Bucket) error {
	key := s.key(b)
	s.conn.denied.remove(key)
	// Again once Redis has answered: a Take that went to Redis before the
	// reset is dropped when it puts its denial, but one that set out
	// between the first remove and the DEL carries the newer epoch.
	defer s.conn.denied.remove(key)
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return errBreakerOpen
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	err := s.conn.client.Del(ctx, key).Err()
	s.record(ctx, probe, err)
	if err != nil {
		return fmt.Errorf("redis store: reset: %w", err)
	}
	return nil
}

// run makes one decision in Redis, within the timeout and through the
// breaker. It also returns the server's time of the decision.
func (s *RedisStore) run(ctx context.Context, key string, l Limit, cost int64) (Result, int64, error) {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return Result{}, 0, errBreakerOpen
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	args := []any{l.Capacity, l.Rate.Tokens, l.Rate.Interval, cost}
	if s.clockOffset != 0 {
		args = append(args, s.clockOffset)
	}
	var vals []int64
	var err error
	if s.conn.batcher != nil {
		vals, err = s.conn.batcher.take(ctx, []string{key}, args)
	} else {
		vals, err = bucketScript.Run(ctx, s.conn.client, []string{key}, args...).Int64Slice()
	}
	if err == nil && len(vals) != 5 {
		err = fmt.Errorf("script answered %d values, want 5", len(vals))
	}
	s.record(ctx, probe, err)
	if err != nil {
		var netErr net.Error
		if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout() {
			return Result{}, 0, fmt.Errorf("redis store: no answer within %s: %w", s.timeout, err)
		}
		return Result{}, 0, fmt.Errorf("redis store: %w", err)
	}
	return Result{Allowed: vals[0] == 1, Remaining: vals[1], RetryAfter: vals[2], ResetAfter: vals[3]}, vals[4], nil
}

// record tells the breaker how a call went; probe says whether the breaker
// let it through as its probe. A request whose client went away says
// nothing about Redis, but it still ends its probe.
func (s *RedisStore) record(ctx context.Context, probe bool, err error) {
	out := callOK
	switch {
	case err == nil:
	case errors.Is(err, context.Canceled) && ctx.Err() == context.Canceled:
		out = callAbandoned
	default:
		out = callFailed
	}
	s.conn.breaker.record(probe, out, s.conn.now())
}

// DenyCacheHits counts the decisions answered by the deny cache, without
// Redis, since the client was made.
func (s *RedisStore) DenyCacheHits() uint64 { return s.conn.denied.hits.Load() }

// breaker is a circuit breaker over consecutive failures. Closed, it costs
// two atomic loads. Times are monotonic microseconds.
type breaker struct {
	threshold int64
	cooldown  int64

	failures  atomic.Int64
	openUntil atomic.Int64 // 0 when closed
	probing   atomic.Bool
	// changed, when set, hears the breaker open and close.
	changed func(open bool)
}

// allow says whether a call may go to Redis now, and whether it is the
// probe. Once the cool-down is over, one call at a time probes; whoever
// gets probe must pass it to record, whatever becomes of the call.
func (b *breaker) allow(now int64) (ok, probe bool) {
	until := b.openUntil.Load()
	if until == 0 {
		return true, false
	}
	if now < until {
		return false, false
	}
	ok = b.probing.CompareAndSwap(false, true)
	return ok, ok
}

// callOutcome is how a call to Redis went, for the breaker.
type callOutcome uint8

const (
	callOK        callOutcome = iota
	callFailed                // Redis failed or did not answer in time
	callAbandoned             // the caller went away first: nothing learned
)

// record counts a call's outcome. Any outcome ends a probe: a failed one
// starts another cool-down, an abandoned one lets the next call probe.
func (b *breaker) record(probe bool, out callOutcome, now int64) {
	switch out {
	case callOK:
		if b.failures.Load() != 0 {
			b.failures.Store(0)
		}
		if until := b.openUntil.Load(); until != 0 && b.openUntil.CompareAndSwap(until, 0) {
			b.notify(false)
		}
	case callFailed:
		n := b.failures.Add(1)
		if probe {
			if b.openUntil.Swap(now+b.cooldown) == 0 {
				b.notify(true)
			}
		} else if n >= b.threshold && b.openUntil.CompareAndSwap(0, now+b.cooldown) {
			b.notify(true)
		}
	}
	if probe {
		b.probing.Store(false)
	}
}

func (b *breaker) notify(open bool) {
	if b.changed != nil {
		b.changed(open)
	}
}

// open reports whether the breaker is failing calls.
func (b *breaker) open() bool { return b.openUntil.Load() != 0 }

// denyCache remembers denied buckets until their retry time, by Redis key.
// It only ever answers "denied", and only before the time Redis gave, so it
// never admits what Redis would deny, and denies only what Redis would.
type denyCache struct {
	shards [denyShards]denyShard
	hits   atomic.Uint64
}

const denyShards = 64

type denyShard struct {
	mu      sync.Mutex
	entries map[string]denyEntry
	max     int
	// epoch counts the resets of the shard's keys. A denial is kept only
	// if no reset came between the Take's look at the cache and its put:
	// one that Redis gave before a reset must not outlive it. Per shard,
	// not per key, to stay bounded; a put dropped for another key's reset
	// only sends that client's next request to Redis.
	epoch uint64
}

type denyEntry struct {
	limit   Limit
	cost    int64
	result  Result
	until   int64 // monotonic µs at which the client may retry
	resetAt int64 // monotonic µs at which the bucket is full
}

func newDenyCache(size int) *denyCache {
	c := &denyCache{}
	for i := range c.shards {
		c.shards[i].entries = make(map[string]denyEntry)
		c.shards[i].max = max(1, (size+denyShards-1)/denyShards)
	}
	return c
}

func (c *denyCache) shard(key string) *denyShard {
	// FNV-1a over the key's hex tail is plenty: the keys are hashes already.
	h := uint32(2166136261)
	for i := max(0, len(key)-8); i < len(key); i++ {
		h = (h ^ uint32(key[i])) * 16777619
	}
	return &c.shards[h%denyShards]
}

// get answers a Take that a remembered denial already decides. The same
// cost on the same limit is denied until the retry time, since tokens
// refill at a fixed rate and only Reset adds more. Otherwise it returns
// the epoch to hand to put.
func (c *denyCache) get(key string, l Limit, cost, now int64) (Result, uint64, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	e, ok := sh.entries[key]
	epoch := sh.epoch
	sh.mu.Unlock()
	if !ok || now >= e.until || e.limit != l || e.cost != cost {
		return Result{}, epoch, false
	}
	c.hits.Add(1)
	denyCacheHitsTotal.Add(1)
	res := e.result
	res.RetryAfter = e.until - now
	res.ResetAfter = max(res.RetryAfter, e.resetAt-now)
	return res, epoch, true
}

// put remembers a denial that Redis gave to a request sent at start, when
// get gave epoch. Redis decided at or after start, so start plus its retry
// time is never later than the moment Redis would allow. A reset since
// then drops it.
func (c *denyCache) put(key string, epoch uint64, l Limit, cost, start int64, res Result) {
	sh := c.shard(key)
	sh.mu.Lock()
	if sh.epoch != epoch {
		sh.mu.Unlock()
		return
	}
	if _, ok := sh.entries[key]; !ok && len(sh.entries) >= sh.max {
		sh.makeRoom(start)
	}
	sh.entries[key] = denyEntry{limit: l, cost: cost, result: res, until: start + res.RetryAfter, resetAt: start + res.ResetAfter}
	sh.mu.Unlock()
}

// remove forgets the key's denial, and any a Take in flight would put.
func (c *denyCache) remove(key string) {
	sh := c.shard(key)
	sh.mu.Lock()
	delete(sh.entries, key)
	sh.epoch++
	sh.mu.Unlock()
}

// makeRoom drops expired entries, then any, to free a 16th of the shard.
// Dropping an entry only sends that client's next request to Redis.
func (sh *denyShard) makeRoom(now int64) {
	want := len(sh.entries) - sh.max + max(1, sh.max/16)
	for k, e := range sh.entries {
		if now >= e.until {
			delete(sh.entries, k)
			want--
		}
	}
	for k := range sh.entries {
		if want <= 0 {
			break
		}
		delete(sh.entries, k)
		want--
	}
}

func (c *denyCache) len() int {
	n := 0
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		n += len(sh.entries)
		sh.mu.Unlock()
	}
	return n
}

// UnmarshalCaddyfile sets up the store from Caddyfile tokens:
//
//	store redis {
//	    address <url...>        # redis://, rediss://, unix://; several: a Cluster
//	    sentinel <master> <address...>
//	    username <u>
//	    password <p>
//	    db <n>
//	    tls {
//	        ca <file>
//	        cert <file>
//	        key <file>
//	        insecure_skip_verify
//	    }
//	    prefix <string>         # default "rl:"
//	    timeout <duration>      # per decision, default 100ms
//	    pool_size <n>
//	    breaker_failures <n>    # failed decisions in a row that open it, default 5
//	    breaker_cooldown <duration>  # default 2s
//	    deny_cache_size <n>     # default 100000
//	    batch on|off            # pipeline concurrent decisions, default on
//	}
func (s *RedisStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // "redis"
	if d.NextArg() {
		return d.Errf("store redis: unexpected %q; the settings go in a block", d.Val())
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "address":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.Err("address: want one or more redis://, rediss:// or unix:// URLs")
			}
			s.Addresses = append(s.Addresses, args...)
		case "sentinel":
			args := d.RemainingArgs()
			if len(args) < 2 {
				return d.Err("sentinel: want <master> <address...>")
			}
			if s.Sentinel != nil {
				return d.Err("sentinel: given twice")
			}
			s.Sentinel = &RedisSentinel{Master: args[0], Addresses: args[1:]}
		case "username":
			if err := oneArg(d, &s.Username); err != nil {
				return err
			}
		case "password":
			if err := oneArg(d, &s.Password); err != nil {
				return err
			}
		case "db":
			n, err := intArg(d)
			if err != nil {
				return err
			}
			if n < 0 || n > 1<<20 {
				return d.Errf("db %d: want a database number, 0 or more", n)
			}
			s.DB = int(n)
		case "tls":
			if err := s.unmarshalTLS(d); err != nil {
				return err
			}
		case "prefix":
			if err := oneArg(d, &s.Prefix); err != nil {
				return err
			}
		case "timeout":
			if err := positiveDuration(d, &s.Timeout); err != nil {
				return err
			}
		case "pool_size":
			if err := intBetween(d, 1, 1<<20, &s.PoolSize); err != nil {
				return err
			}
		case "breaker_failures":
			if err := intBetween(d, 1, 1<<20, &s.BreakerFailures); err != nil {
				return err
			}
		case "breaker_cooldown":
			if err := positiveDuration(d, &s.BreakerCooldown); err != nil {
				return err
			}
		case "deny_cache_size":
			if err := intBetween(d, 1, 1<<26, &s.DenyCacheSize); err != nil {
				return err
			}
		case "batch":
			var v string
			if err := oneArg(d, &v); err != nil {
				return err
			}
			if v != "on" && v != "off" {
				return d.Errf("batch %q: want on or off", v)
			}
			on := v == "on"
			s.Batch = &on
		default:
			return d.Errf("store redis: unknown subdirective %q", d.Val())
		}
	}
	if err := s.checkFields(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// positiveDuration reads a subdirective's one duration, which must be
// above zero.
func positiveDuration(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	if err := durationArg(d, dur); err != nil {
		return err
	}
	if *dur == 0 {
		return d.Errf("%s %q: must be above 0", name, d.Val())
	}
	return nil
}

func (s *RedisStore) unmarshalTLS(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.Errf("tls: unexpected %q; the settings go in a block", d.Val())
	}
	if s.TLS == nil {
		s.TLS = new(RedisTLS)
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		var target *string
		switch d.Val() {
		case "ca":
			target = &s.TLS.CA
		case "cert":
			target = &s.TLS.Cert
		case "key":
			target = &s.TLS.Key
		case "insecure_skip_verify":
			s.TLS.InsecureSkipVerify = true
			continue
		default:
			return d.Errf("tls: unknown subdirective %q", d.Val())
		}
		name := d.Val()
		if !d.NextArg() {
			return d.Errf("tls %s: want a file", name)
		}
		*target = d.Val()
	}
	return nil
}

// Interface guards
var (
	_ Store                 = (*RedisStore)(nil)
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddy.CleanerUpper    = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
	_ caddy.Destructor      = (*redisConn)(nil)
)
