package ratelimit

import (
	"cmp"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
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

	// Lease is how many tokens of a shared bucket this node takes at once,
	// to decide the requests they cover without calling Redis: a number,
	// or a share of each tier's capacity such as "10%" (at least 1). The
	// fleet still admits no more than with one call per decision (DESIGN
	// section 9). Default 1: every decision asks Redis.
	Lease string `json:"lease,omitempty"`

	// LeaseTTL is how long leased tokens may stay unused on this node
	// before they go back to the shared bucket. Default 1s.
	LeaseTTL caddy.Duration `json:"lease_ttl,omitempty"`

	conn    *redisConn
	leases  *leaseTable // nil in strict mode
	poolKey string
	prefix  string
	timeout time.Duration

	// clockOffset is added to the Redis server's TIME. Only tests set it,
	// to replay traces faster than real time; it is always 0 otherwise.
	clockOffset int64
}

// CaddyModule returns the Caddy module information.
func (RedisStore) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit.stores.redis",
		New: func() caddy.Module { return new(RedisStore) },
	}
}

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
	if !cfg.lease.strict() {
		s.leases = newLeaseTable(s, s.conn.now, cfg.lease, cfg.leaseTTL, s.timeout, cfg.denyCapacity, ctx.Logger())
		s.leases.after = func(d time.Duration, f func()) { time.AfterFunc(d, f) }
		s.leases.current = func(key string, l bucket.Limit) (bucket.Limit, bool) {
			policy, tier, ok := s.splitKey(key)
			if !ok {
				return l, true
			}
			return liveLimit(policy, tier, l)
		}
	}
	return nil
}

// Cleanup releases this config's hold on the client; the last config to
// let go closes it.
func (s *RedisStore) Cleanup() error {
	if s.poolKey == "" {
		return nil
	}
	if s.leases != nil {
		s.leases.close()
	}
	_, err := redisPool.Delete(s.poolKey)
	s.poolKey = ""
	return err
}

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
	return string(s.appendKey(make([]byte, 0, len(s.prefix)+len(b.Policy)+len(b.Tier)+16+32), b))
}

// appendKey appends the bucket's key to buf.
func (s *RedisStore) appendKey(buf []byte, b *Bucket) []byte {
	sum := bucketDigest(b)
	buf = append(buf, s.prefix...)
	for _, part := range [...]string{b.Policy, b.Tier} {
		buf = strconv.AppendInt(buf, int64(len(part)), 10)
		buf = append(buf, ':')
		buf = append(buf, part...)
		buf = append(buf, ':')
	}
	return hex.AppendEncode(buf, sum[:16])
}

// splitKey reads the policy and the tier back from a bucket's key.
func (s *RedisStore) splitKey(key string) (policy, tier string, ok bool) {
	rest, ok := strings.CutPrefix(key, s.prefix)
	var parts [2]string
	for i := range parts {
		size, after, found := strings.Cut(rest, ":")
		n, err := strconv.Atoi(size)
		if !ok || !found || err != nil || n < 0 || n+1 > len(after) {
			return "", "", false
		}
		parts[i], rest = after[:n], after[n+1:]
	}
	return parts[0], parts[1], true
}

// Take implements Store: from this node's lease when leases are on and
// larger than the cost, else by one script call, unless the deny cache
// already knows the answer.
func (s *RedisStore) Take(ctx context.Context, b *Bucket, l bucket.Limit, cost int64) (bucket.Result, error) {
	if s.leases != nil && s.leases.size.of(l) > cost && cost > 0 {
		var buf [192]byte
		res, err := s.leases.take(ctx, s.appendKey(buf[:0], b), l, cost)
		if !errors.Is(err, errLeasesClosed) {
			return res, err
		}
	}
	key := s.key(b)
	start := s.conn.now()
	res, epoch, ok := s.conn.denied.get(key, l, cost, start)
	if ok {
		return res, nil
	}
	var out [1]bucket.Result
	_, _, err := s.takeAll(ctx, "take", key, []bucket.Limit{l}, cost, out[:], true)
	res = out[0]
	if err == nil && !res.Allowed {
		s.conn.denied.put(key, epoch, l, cost, start, res)
	}
	return res, err
}

// TakeAll implements Store with one script call on the bucket's key, whose
// hash holds every limit. Leases take no part: a tier of several limits is
// refused with lease, at provision.
func (s *RedisStore) TakeAll(ctx context.Context, b *Bucket, ls []bucket.Limit, cost int64, out []bucket.Result) (bool, error) {
	allowed, _, err := s.takeAll(ctx, "take", s.key(b), ls, cost, out, false)
	return allowed, err
}

// takeAll runs op, take or peek, on key, and also returns the server's
// time of the decision. A single limit's take goes through the batcher.
func (s *RedisStore) takeAll(ctx context.Context, op, key string, ls []bucket.Limit, cost int64, out []bucket.Result, batched bool) (bool, int64, error) {
	vals, err := s.call(ctx, key, s.args(op, ls, cost), batched, 3+4*len(ls))
	if err != nil {
		return false, 0, err
	}
	banned := vals[1] == 1
	for i := range ls {
		v := vals[3+4*i:]
		out[i] = bucket.Result{Allowed: v[0] == 1, Remaining: v[1], RetryAfter: v[2], ResetAfter: v[3], Banned: banned}
	}
	return vals[0] == 1, vals[2], nil
}

// args are the script's arguments for op on limits ls, and then extra.
func (s *RedisStore) args(op string, ls []bucket.Limit, count int64, extra ...any) []any {
	args := make([]any, 0, 5+3*len(ls)+len(extra))
	args = append(args, op, len(ls), count, s.clockOffset, ls[0].Ban)
	for _, l := range ls {
		args = append(args, l.Capacity, l.Rate.Tokens, l.Rate.Interval)
	}
	return append(args, extra...)
}

// Charge implements Store: one script call takes n more tokens, into debt
// if need be. Leases take no part: lease refuses cost_from_response at
// provision.
func (s *RedisStore) Charge(ctx context.Context, b *Bucket, l bucket.Limit, n int64) error {
	_, err := s.call(context.WithoutCancel(ctx), s.key(b), s.args("charge", []bucket.Limit{l}, n), false, 2)
	return err
}

// GiveBack implements Store: into this node's lease when it holds one for
// the bucket, up to what the lease's record counts, and the rest by one
// script call.
func (s *RedisStore) GiveBack(ctx context.Context, b *Bucket, l bucket.Limit, n int64) error {
	if n <= 0 {
		return nil
	}
	if s.leases != nil {
		var buf [192]byte
		if n = s.leases.giveBackHeld(s.appendKey(buf[:0], b), n); n == 0 {
			return nil
		}
	}
	_, err := s.call(context.WithoutCancel(ctx), s.key(b), s.args("giveback", []bucket.Limit{l}, n), false, 2)
	return err
}

// Peek implements Store.
func (s *RedisStore) Peek(ctx context.Context, b *Bucket, l bucket.Limit) (bucket.Result, error) {
	var out [1]bucket.Result
	_, _, err := s.takeAll(ctx, "peek", s.key(b), []bucket.Limit{l}, 0, out[:], false)
	return out[0], err
}

// lease is a lease call on the bucket at key, within the timeout and
// through the breaker.
func (s *RedisStore) lease(key string, l bucket.Limit, a bucket.LeaseAsk) (bucket.LeaseResult, error) {
	prefetch := 0
	if a.Prefetch {
		prefetch = 1
	}
	args := s.args("lease", []bucket.Limit{l}, a.Cost, a.Node, a.Seq, a.Held, a.Want, a.Hold, a.Spend, prefetch)
	v, err := s.call(context.Background(), key, args, false, 8)
	if err != nil {
		return bucket.LeaseResult{}, err
	}
	return bucket.LeaseResult{Granted: v[0], Remaining: v[1], RetryAfter: v[2], HoldOff: v[3], ResetAfter: v[4], Banned: v[5] == 1, Drop: v[6] == 1}, nil
}

// giveBack returns the unused tokens of node's leases to their buckets in
// one pipeline, and reports how many went back.
func (s *RedisStore) giveBack(node string, back []leaseReturn) (int64, error) {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return 0, errBreakerOpen
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.timeout)
	defer cancel()
	args := func(g leaseReturn) []any { return s.args("return", []bucket.Limit{g.limit}, g.tokens, node, g.seq) }
	cmds := make([]*redis.Cmd, len(back))
	_, err := s.conn.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for i, g := range back {
			cmds[i] = bucketScript.EvalSha(ctx, pipe, []string{g.key}, args(g)...)
		}
		return nil
	})
	var returned int64
	var failed error
	for i, cmd := range cmds {
		if isNoScript(cmd.Err()) {
			// Redis lost its scripts (a restart, a failover): EVAL loads it.
			cmd = bucketScript.Run(ctx, s.conn.client, []string{back[i].key}, args(back[i])...)
		}
		vals, err := cmd.Int64Slice()
		if err == nil && len(vals) == 2 {
			returned += vals[0]
		} else if failed == nil {
			failed = cmp.Or(err, fmt.Errorf("script answered %d values, want 2", len(vals)))
		}
	}
	if failed == nil && err != nil && !isNoScript(err) {
		failed = err
	}
	s.record(ctx, probe, failed)
	if failed != nil {
		return returned, s.wrap(failed)
	}
	return returned, nil
}

// Reset implements Store. It forgets the bucket's denial on this node
// whether or not Redis answers; other nodes may still answer from their
// deny caches until the retry time they were given.
func (s *RedisStore) Reset(ctx context.Context, b *Bucket) error {
	key := s.key(b)
	if s.leases != nil {
		s.leases.reset([]byte(key))
	}
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

// call runs the bucket script on one key, within the timeout and through
// the breaker; batched, through the batcher if there is one. The script
// must answer want values.
func (s *RedisStore) call(ctx context.Context, key string, args []any, batched bool, want int) ([]int64, error) {
	ok, probe := s.conn.breaker.allow(s.conn.now())
	if !ok {
		return nil, errBreakerOpen
	}
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	var vals []int64
	var err error
	if batched && s.conn.batcher != nil {
		vals, err = s.conn.batcher.take(ctx, []string{key}, args)
	} else {
		vals, err = bucketScript.Run(ctx, s.conn.client, []string{key}, args...).Int64Slice()
	}
	if err == nil && len(vals) != want {
		err = fmt.Errorf("script answered %d values, want %d", len(vals), want)
	}
	s.record(ctx, probe, err)
	if err != nil {
		return nil, s.wrap(err)
	}
	return vals, nil
}

// wrap says what went wrong with a call to Redis.
func (s *RedisStore) wrap(err error) error {
	var netErr net.Error
	if errors.Is(err, context.DeadlineExceeded) || errors.As(err, &netErr) && netErr.Timeout() {
		return fmt.Errorf("redis store: no answer within %s: %w", s.timeout, err)
	}
	return fmt.Errorf("redis store: %w", err)
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
//	    lease <n>|<p>%          # tokens a node takes at once, default 1 (strict)
//	    lease_ttl <duration>    # unused leased tokens go back after, default 1s
//	}
func (s *RedisStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // "redis"
	if d.NextArg() {
		return d.Errf("store redis: unexpected %q; the settings go in a block", d.Val())
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		if err := once(d, seen, "sentinel", "username", "password", "db", "tls", "prefix", "timeout", "pool_size", "breaker_failures", "breaker_cooldown", "deny_cache_size", "batch", "lease", "lease_ttl"); err != nil {
			return err
		}
		if err := s.unmarshalSetting(d); err != nil {
			return err
		}
	}
	if err := s.validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// unmarshalSetting reads one subdirective of the store block.
func (s *RedisStore) unmarshalSetting(d *caddyfile.Dispenser) error {
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
		s.Sentinel = &RedisSentinel{Master: args[0], Addresses: args[1:]}
	case "username":
		return oneArg(d, &s.Username)
	case "password":
		return oneArg(d, &s.Password)
	case "db":
		return intBetween(d, 0, 1<<20, &s.DB)
	case "tls":
		return s.unmarshalTLS(d)
	case "prefix":
		return oneArg(d, &s.Prefix)
	case "timeout":
		return positiveDuration(d, &s.Timeout)
	case "pool_size":
		return intBetween(d, 1, 1<<20, &s.PoolSize)
	case "breaker_failures":
		return intBetween(d, 1, 1<<20, &s.BreakerFailures)
	case "breaker_cooldown":
		return positiveDuration(d, &s.BreakerCooldown)
	case "deny_cache_size":
		return intBetween(d, 1, 1<<26, &s.DenyCacheSize)
	case "lease":
		if err := oneArg(d, &s.Lease); err != nil {
			return err
		}
		_, err := parseLeaseSize(s.Lease)
		if err != nil {
			return d.Err(err.Error())
		}
	case "lease_ttl":
		return positiveDuration(d, &s.LeaseTTL)
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
