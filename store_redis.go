package ratelimit

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
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
	// Sentinels. Default 100ms. Each node logs a warning when it is under
	// twice the round trip the node measures (docs/operating.md).
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
	// fleet still admits no more than one bucket would (docs/fleet.md).
	// Default 1: every decision asks Redis. Each node logs a warning when
	// a tier's lease is under what its rate refills in one measured round
	// trip.
	Lease string `json:"lease,omitempty"`

	// LeaseTTL is how long leased tokens may stay unused on this node
	// before they go back to the shared bucket. Default 1s. Each node logs
	// a warning when it is under four times the measured round trip.
	LeaseTTL caddy.Duration `json:"lease_ttl,omitempty"`

	// Credit is how many requests of a bucket this node holds no lease
	// entry for (a cold key) it admits at once, before any call; it
	// charges them to every limit of the tier in one background call, as
	// cost_from_response does, into debt if need be, and a ban the charge
	// meets holds. A cold key then costs no wait, and still one call. A
	// node keeps a key its charge left in debt until the debt is paid, so
	// over any window the fleet admits at most nodes x Credit requests
	// more than the limit (docs/fleet.md). Needs Lease; refused on a tier
	// with a quota. Default 0: none.
	Credit int `json:"credit,omitempty"`

	// SlotTTL is how long an in-flight slot (a tier's concurrency) lives
	// in Redis unless its node renews it, which it does while the request
	// runs: a node that dies frees its slots within this. At least three
	// times timeout. Default 30s, or three times timeout if longer.
	SlotTTL caddy.Duration `json:"slot_ttl,omitempty"`

	engine  *redisbucket.Store
	poolKey string
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

// redisPool holds the connections, by their settings, across reloads.
var redisPool = caddy.NewUsagePool()

// redisConn is a pooled connection, closed when no config uses it.
type redisConn struct{ *redisbucket.Conn }

// Destruct implements caddy.Destructor.
func (c redisConn) Destruct() error { return c.Close() }

// Provision checks the settings and takes, or makes, the connection for
// them. It never talks to Redis, so that a config loads while Redis is
// down.
func (s *RedisStore) Provision(ctx caddy.Context) error {
	opts, store, err := s.options()
	if err != nil {
		return err
	}
	for _, p := range s.emptyPasswords() {
		ctx.Logger().Warn("redis store: the password is a placeholder that expands to nothing, so no password is sent; is the variable set?", zap.String("placeholder", p))
	}
	plan, err := redisbucket.NewPlan(opts)
	if err != nil {
		return err
	}
	// The connection outlives this config, and so would a logger it kept:
	// its lines go to the newest config that uses it (store.Logger,
	// redisbucket.Conn.UseLogger), and nowhere when none does.
	val, _, err := redisPool.LoadOrNew(plan.Key, func() (caddy.Destructor, error) {
		return redisConn{plan.Connect(zap.NewNop())}, nil
	})
	if err != nil {
		return err
	}
	s.poolKey = plan.Key
	store.Logger = ctx.Logger()
	if msg, capped := store.Lease.Capped(); capped {
		store.Logger.Warn(msg)
	}
	store.Current = func(key string, tr bucket.Tier) (bucket.Tier, bool) {
		policy, tier, ok := s.engine.SplitKey(key)
		if !ok {
			return tr, true
		}
		t, running := liveTier(policy, tier)
		switch {
		case !running:
			return tr, true
		case t == nil || t.Unlimited || t.Deny:
			return bucket.Tier{}, false
		}
		return bucket.Tier{Limits: t.limits, Quotas: t.quotas}, true
	}
	store.OnBan = func(key string) {
		if policy, tier, ok := s.engine.SplitKey(key); ok {
			bansTotal.WithLabelValues(policy, tier).Inc()
		}
	}
	s.engine = redisbucket.NewStore(val.(redisConn).Conn, store)
	return nil
}

// Cleanup gives back what this config holds on lease, hands the
// connection's lines back to the newest config left, and releases its
// hold on the connection; the last config to let go closes it.
func (s *RedisStore) Cleanup() error {
	if s.poolKey == "" {
		return nil
	}
	storeUnloading(s) // reconcile's last charges (fallback_reconcile.go)
	s.engine.Close()
	key := s.poolKey
	s.poolKey = ""
	// Requests of this config that hold in-flight slots still run; their
	// slots are renewed and freed on this connection, so it stays open
	// until the last has ended, even when the new config dials another.
	idle := s.engine.SlotsIdle()
	select {
	case <-idle:
		_, err := redisPool.Delete(key)
		return err
	default:
		go func() {
			<-idle
			_, _ = redisPool.Delete(key)
		}()
		return nil
	}
}

// validate checks what needs no expansion, for adapt and provision.
func (s *RedisStore) validate() error {
	switch {
	case s.Sentinel != nil && len(s.Addresses) > 0:
		return errors.New("redis store: give address or sentinel, not both")
	case s.Sentinel != nil && s.Sentinel.Master == "":
		return errors.New("redis store: sentinel: the master's name is missing")
	case s.Sentinel != nil && len(s.Sentinel.Addresses) == 0:
		return fmt.Errorf("redis store: sentinel %q: no sentinel address", s.Sentinel.Master)
	case s.DB < 0:
		return fmt.Errorf("redis store: db %d: must be 0 or more", s.DB)
	case s.Timeout < 0:
		return fmt.Errorf("redis store: timeout %s: must be above 0", time.Duration(s.Timeout))
	case s.PoolSize < 0:
		return fmt.Errorf("redis store: pool_size %d: must be at least 1", s.PoolSize)
	case s.BreakerFailures < 0:
		return fmt.Errorf("redis store: breaker_failures %d: must be at least 1", s.BreakerFailures)
	case s.BreakerCooldown < 0:
		return fmt.Errorf("redis store: breaker_cooldown %s: must be above 0", time.Duration(s.BreakerCooldown))
	case s.LeaseTTL < 0:
		return fmt.Errorf("redis store: lease_ttl %s: must be above 0", time.Duration(s.LeaseTTL))
	case s.SlotTTL < 0 || s.SlotTTL > 0 && time.Duration(s.SlotTTL) < redisbucket.MinSlotTTL(time.Duration(s.Timeout)):
		return fmt.Errorf("redis store: slot_ttl %s: must be at least %s, three times timeout, so that a renewal lands before the slot expires",
			time.Duration(s.SlotTTL), redisbucket.MinSlotTTL(time.Duration(s.Timeout)))
	case s.DenyCacheSize < 0:
		return fmt.Errorf("redis store: deny_cache_size %d: must be at least 1", s.DenyCacheSize)
	case s.Credit < 0:
		return fmt.Errorf("redis store: credit %d: want 0 or more", s.Credit)
	}
	if z, err := redisbucket.ParseLeaseSize(s.Lease); err == nil && z.Strict() && s.Credit > 0 {
		return fmt.Errorf("redis store: credit %d needs lease: credit admits a cold key's requests while a lease call is out, and in strict mode every decision waits on Redis", s.Credit)
	}
	if t := s.TLS; t != nil && (t.Cert == "") != (t.Key == "") {
		return errors.New("redis store: tls: give cert and key together")
	}
	return nil
}

// options checks the settings and expands their placeholders, for the
// engine: the connection's options and this config's view of it.
func (s *RedisStore) options() (redisbucket.Options, redisbucket.StoreOptions, error) {
	if err := s.validate(); err != nil {
		return redisbucket.Options{}, redisbucket.StoreOptions{}, err
	}
	lease, err := redisbucket.ParseLeaseSize(s.Lease)
	if err != nil {
		return redisbucket.Options{}, redisbucket.StoreOptions{}, err
	}
	repl := caddy.NewReplacer()
	expand := func(v string) string { return repl.ReplaceKnown(v, "") }
	o := redisbucket.Options{
		Username: expand(s.Username), Password: expand(s.Password), DB: s.DB,
		Timeout: time.Duration(s.Timeout), PoolSize: s.PoolSize,
		BreakerFailures: s.BreakerFailures, BreakerCooldown: time.Duration(s.BreakerCooldown),
		DenyCacheSize: s.DenyCacheSize, Batch: s.Batch == nil || *s.Batch,
	}
	for _, a := range s.Addresses {
		o.Addresses = append(o.Addresses, expandAddress(repl, a))
	}
	if s.Sentinel != nil {
		o.Sentinel = &redisbucket.Sentinel{Master: expand(s.Sentinel.Master)}
		for _, a := range s.Sentinel.Addresses {
			o.Sentinel.Addresses = append(o.Sentinel.Addresses, expand(a))
		}
	}
	if t := s.TLS; t != nil {
		o.TLS = &redisbucket.TLS{CA: expand(t.CA), Cert: expand(t.Cert), Key: expand(t.Key), InsecureSkipVerify: t.InsecureSkipVerify}
	}
	return o, redisbucket.StoreOptions{Prefix: s.Prefix, Lease: lease, LeaseTTL: time.Duration(s.LeaseTTL), MaxLeases: s.DenyCacheSize, SlotTTL: time.Duration(s.SlotTTL), Credit: int64(s.Credit)}, nil
}

// checkCredit refuses credit on a tier with a quota, for the handler's
// check: a quota is never in debt, so the debt rule could not stop the
// nodes from crediting a client again and again past a used-up quota
// (internal/redisbucket/lease_credit.go).
func checkCredit(raw json.RawMessage, tiers []*Tier) error {
	var s struct {
		Store  string `json:"store"`
		Credit int    `json:"credit"`
	}
	if raw == nil || json.Unmarshal(raw, &s) != nil || s.Store != "redis" || s.Credit <= 0 {
		return nil
	}
	for _, t := range tiers {
		if len(t.Quotas) > 0 {
			return fmt.Errorf("tier %q: credit %d with a quota: credit admits requests before the store counts them, and a quota is never in debt, so the nodes would credit a client again and again past a used-up quota; drop credit or the quota", t.Name, s.Credit)
		}
	}
	return nil
}

// warnLeaseCaps logs, once a tier at load, a lease given in tokens that
// the tier's capacity holds to half of it (LeaseSize.Of): the setting asks
// for more than the tier's buckets give.
func (s *RedisStore) warnLeaseCaps(logger *zap.Logger, tiers []*Tier) {
	z, err := redisbucket.ParseLeaseSize(s.Lease)
	if err != nil {
		return
	}
	for _, t := range tiers {
		for _, l := range t.limits {
			if z.CappedAt(l) {
				logger.Warn("redis store: lease capped at half the tier's capacity: the tokens out on lease never pass half of it",
					zap.String("lease", s.Lease), zap.String("tier", t.Name), zap.Int64("capacity", l.Capacity), zap.Int64("lease_tokens", z.Of(l)))
				break
			}
		}
	}
}

// expandAddress expands an address's placeholders. In a URL's user and
// password, a value is escaped as the URL needs it: a managed service's
// access key in {env.REDIS_PASSWORD} may hold a / or a +.
func expandAddress(repl *caddy.Replacer, addr string) string {
	scheme, rest, isURL := strings.Cut(addr, "://")
	at := strings.LastIndex(rest, "@")
	if !isURL || at < 0 || !strings.Contains(rest[:at], "{") {
		return repl.ReplaceKnown(addr, "")
	}
	userinfo, err := repl.ReplaceFunc(rest[:at], func(_ string, v any) (any, error) {
		return url.PathEscape(fmt.Sprint(v)), nil
	})
	if err != nil {
		return repl.ReplaceKnown(addr, "")
	}
	return scheme + "://" + userinfo + "@" + repl.ReplaceKnown(rest[at+1:], "")
}

// emptyPasswords lists the passwords given as placeholders, in the
// password setting or an address URL, that expand to nothing: an unset
// {env.REDIS_PASSWORD} would otherwise connect with no password, and fail
// later with an error that does not name it. What it lists is placeholders
// only, never a password.
func (s *RedisStore) emptyPasswords() []string {
	repl := caddy.NewReplacer()
	empty := func(v string) bool { return strings.Contains(v, "{") && repl.ReplaceKnown(v, "") == "" }
	var found []string
	if empty(s.Password) {
		found = append(found, s.Password)
	}
	for _, a := range s.Addresses {
		_, rest, ok := strings.Cut(a, "://")
		at := strings.LastIndex(rest, "@")
		if !ok || at < 0 {
			continue
		}
		if _, pass, hasPass := strings.Cut(rest[:at], ":"); hasPass && empty(pass) {
			found = append(found, pass)
		}
	}
	return found
}

// key appends the bucket's Redis key to buf (redisbucket.Store.AppendKey):
// its policy, its tier, and a hash of the client, never its value.
func (s *RedisStore) key(buf []byte, b *Bucket) []byte {
	sum := b.Digest()
	return s.engine.AppendKey(buf, b.Policy, b.Tier, sum[:16])
}

// chargeDigest is charge for the bucket of policy and tier whose client
// digest (Bucket.Digest) is sum: reconcile keeps no client value.
func (s *RedisStore) chargeDigest(ctx context.Context, policy, tier string, sum *[sha256.Size]byte, tr bucket.Tier, n int64) error {
	var buf [192]byte
	return s.engine.Charge(ctx, s.engine.AppendKey(buf[:0], policy, tier, sum[:16]), tr, n)
}

// take decides the request. One that the tokens this node holds on lease
// cover is decided by the bucket's local id (localID, a keyed hash of its
// name), without its Redis key: the key's digest (SHA-256, or HMAC under
// key_secret) was about a third of what such a request cost the store
// (BenchmarkServeHTTPStores). The ids of two names differ but by a 64-bit
// chance, as the local store's do.
func (s *RedisStore) take(ctx context.Context, b *Bucket, tr bucket.Tier, cost int64, out []bucket.Result) (bool, error) {
	var buf [192]byte
	if !s.engine.Leasing(tr, cost) {
		return s.engine.Take(ctx, s.key(buf[:0], b), tr, cost, out)
	}
	id := localID(b)
	if allowed, ok := s.engine.TakeHeld(id, tr, cost, out); ok {
		return allowed, nil
	}
	return s.engine.TakeNamed(ctx, s.key(buf[:0], b), id, tr, cost, out)
}

func (s *RedisStore) peek(ctx context.Context, b *Bucket, tr bucket.Tier, out []bucket.Result) error {
	var buf [192]byte
	return s.engine.Peek(ctx, s.key(buf[:0], b), tr, out)
}

// giveBack returns the tokens into this node's lease when they came from
// one, else by one script call. A tier of no quota gives back what its
// limits take, at no moment in particular: the lease may take it.
func (s *RedisStore) giveBack(ctx context.Context, b *Bucket, tr bucket.Tier, limitsN, n, at int64) error {
	if len(tr.Quotas) == 0 {
		n, at = limitsN, 0
	}
	var buf [192]byte
	return s.engine.GiveBack(ctx, s.key(buf[:0], b), tr, limitsN, n, at)
}

func (s *RedisStore) charge(ctx context.Context, b *Bucket, tr bucket.Tier, n int64) error {
	var buf [192]byte
	return s.engine.Charge(ctx, s.key(buf[:0], b), tr, n)
}

// held is how many tokens of the bucket this node holds on lease and may
// spend now (leaseHolder).
func (s *RedisStore) held(b *Bucket) int64 {
	var buf [192]byte
	return s.engine.Held(s.key(buf[:0], b))
}

// reset resets the shared bucket, this node's lease and its deny cache
// entry.
func (s *RedisStore) reset(ctx context.Context, b *Bucket) error {
	var buf [192]byte
	return s.engine.Reset(ctx, s.key(buf[:0], b))
}

// forgetHere drops this node's lease and denial of b and leaves Redis
// alone (resetCopies).
func (s *RedisStore) forgetHere(b *Bucket) {
	var buf [192]byte
	s.engine.Forget(s.key(buf[:0], b))
}

// resetLayers resets this node's deny cache and lease whatever Redis
// does, then the shared bucket.
func (s *RedisStore) resetLayers(ctx context.Context, b *Bucket) ([]string, []error) {
	return []string{"deny_cache", "redis"}, []error{nil, s.reset(ctx, b)}
}

func (s *RedisStore) acquire(ctx context.Context, b *Bucket, n int64) (uint64, int64, bool, error) {
	var buf [192]byte
	return s.engine.Acquire(ctx, s.key(buf[:0], b), n)
}

func (s *RedisStore) release(b *Bucket, slot uint64) {
	var buf [192]byte
	s.engine.Release(s.key(buf[:0], b), slot)
}

func (s *RedisStore) inFlight(ctx context.Context, b *Bucket) (int64, error) {
	var buf [192]byte
	return s.engine.InFlight(ctx, s.key(buf[:0], b))
}

func (s *RedisStore) report() storeReport {
	return storeReport{breaker: s.engine.BreakerState(), leases: s.engine.LeasesHeld(), master: s.engine.Master(), rtt: s.roundTrip()}
}

// roundTrip is the engine's measured round trip, 0 before its first
// answer.
func (s *RedisStore) roundTrip() time.Duration {
	rtt, _ := s.engine.RoundTrip()
	return rtt
}

// watchRoundTrip makes the engine warn on the policy's logger when
// timeout, lease_ttl or a tier's lease is too small for the round trip it
// measures (redisbucket.Store.WatchRoundTrip). A tier of quotas alone has
// no rate to weigh its lease against.
func (s *RedisStore) watchRoundTrip(logger *zap.Logger, tiers []*Tier) {
	var named []redisbucket.NamedTier
	for _, t := range tiers {
		if !t.Unlimited && !t.Deny && len(t.limits) > 0 && t.hidden == 0 {
			named = append(named, redisbucket.NamedTier{Name: t.Name, Tier: bucket.Tier{Limits: t.limits, Quotas: t.quotas}})
		}
	}
	s.engine.WatchRoundTrip(logger, named)
}

// shareRoundTrip makes the handler's Redis store share the round trip,
// and its warnings, of a copy of the handler in the same config load: a
// site on two ports has a copy in each server, one policy that measures
// one round trip (docs/operating.md, "Round-trip warnings").
func (h *Handler) shareRoundTrip() {
	mine, ok := h.store.(*RedisStore)
	if !ok || h.loadKey == nil {
		return
	}
	configLoads.Lock()
	defer configLoads.Unlock()
	for _, other := range configLoads.m[h.loadKey] {
		if o, ok := other.store.(*RedisStore); ok && other != h && other.Name == h.Name && bytes.Equal(other.written, h.written) {
			mine.engine.ShareRoundTrip(o.engine)
			return
		}
	}
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
//	    lease <n>|<p>%          # tokens a node takes at once, default 1 (strict)
//	    lease_ttl <duration>    # unused leased tokens go back after, default 1s
//	    credit <k>              # a cold key's first k requests at once, with lease; default 0
//	    slot_ttl <duration>     # an in-flight slot lives unrenewed, default 30s
//	}
func (s *RedisStore) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // "redis"
	if d.NextArg() {
		return d.Errf("redis store: unexpected %q; the settings go in a block", d.Val())
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		if err := once(d, seen, "sentinel", "username", "password", "db", "tls", "prefix", "timeout", "pool_size", "breaker_failures", "breaker_cooldown", "deny_cache_size", "batch", "lease", "lease_ttl", "slot_ttl", "credit"); err != nil {
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
		_, err := redisbucket.ParseLeaseSize(s.Lease)
		if err != nil {
			return d.Err(err.Error())
		}
	case "lease_ttl":
		return positiveDuration(d, &s.LeaseTTL)
	case "credit":
		return intBetween(d, 0, 1<<20, &s.Credit)
	case "slot_ttl":
		return positiveDuration(d, &s.SlotTTL)
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
		return d.Errf("redis store: unknown subdirective %q", d.Val())
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
	_ store                 = (*RedisStore)(nil)
	_ reporter              = (*RedisStore)(nil)
	_ leaseHolder           = (*RedisStore)(nil)
	_ layeredResetter       = (*RedisStore)(nil)
	_ leaseWarner           = (*RedisStore)(nil)
	_ roundTripWatcher      = (*RedisStore)(nil)
	_ caddy.Provisioner     = (*RedisStore)(nil)
	_ caddy.CleanerUpper    = (*RedisStore)(nil)
	_ caddyfile.Unmarshaler = (*RedisStore)(nil)
	_ caddy.Destructor      = redisConn{}
)
