package redisbucket

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

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"
)

// Options are a connection's settings, with placeholders expanded: which
// Redis (one node, a Cluster, or the master a Sentinel names), how to reach
// it, and how the connection guards the decisions it makes.
type Options struct {
	// Addresses are redis://, rediss:// or unix:// URLs, or host:port: one
	// is a single node, several the seeds of a Cluster. Default
	// DefaultAddress.
	Addresses []string
	// Sentinel, instead of Addresses, finds the master through Sentinel.
	Sentinel *Sentinel
	// Username, Password and DB override what an address URL gives.
	Username, Password string
	DB                 int
	// TLS turns TLS on for every address.
	TLS *TLS
	// Timeout bounds each decision and each dial. Default DefaultTimeout.
	Timeout time.Duration
	// PoolSize is the most connections per node; 0 is go-redis's default.
	PoolSize int
	// BreakerFailures failed decisions in a row open the breaker for
	// BreakerCooldown. Defaults DefaultBreakerFailures, DefaultBreakerCooldown.
	BreakerFailures int
	BreakerCooldown time.Duration
	// DenyCacheSize bounds the deny cache. Default DefaultDenyCacheSize.
	DenyCacheSize int
	// Batch pipelines concurrent decisions.
	Batch bool
}

// Sentinel names the master that Sentinel watches, and the Sentinels.
type Sentinel struct {
	Master    string
	Addresses []string
}

// TLS names the PEM files that set up TLS: the authorities that may sign
// the server's certificate (the system's roots without CA), and a client
// certificate and key for servers that verify clients.
type TLS struct {
	CA, Cert, Key      string
	InsecureSkipVerify bool
}

// Defaults of a connection's settings, in one place.
const (
	DefaultAddress         = "redis://127.0.0.1:6379"
	DefaultTimeout         = 100 * time.Millisecond
	DefaultBreakerFailures = 5
	DefaultBreakerCooldown = 2 * time.Second
	DefaultDenyCacheSize   = 100000
)

// withDefaults fills what o leaves out.
func (o Options) withDefaults() Options {
	o.Timeout = cmp.Or(o.Timeout, DefaultTimeout)
	o.BreakerFailures = cmp.Or(o.BreakerFailures, DefaultBreakerFailures)
	o.BreakerCooldown = cmp.Or(o.BreakerCooldown, DefaultBreakerCooldown)
	o.DenyCacheSize = cmp.Or(o.DenyCacheSize, DefaultDenyCacheSize)
	return o
}

// Plan is a connection's settings, checked and with the TLS files read,
// ready to connect.
type Plan struct {
	// Key names every setting that shapes the connection (the password
	// only as a hash): connections with the same key may be shared.
	Key       string
	o         Options
	newClient func() redis.UniversalClient
	// asCluster, for one TCP address, makes a Cluster client seeded with
	// it, for when that node turns out to be one of a Cluster's (Conn
	// follows it); nil for the other kinds.
	asCluster func() (redis.UniversalClient, error)
	// sentinels are the Sentinels' own settings, for following the
	// master's address (Sentinel only).
	sentinels []*redis.Options
	// handshakes counts the handshakes of the clients it makes.
	handshakes *handshakes
}

// NewPlan checks o, reads its TLS files and readies its client. It never
// talks to Redis.
func NewPlan(o Options) (*Plan, error) {
	o = o.withDefaults()
	c := &clientParams{username: o.Username, password: o.Password, handshakes: new(handshakes)}
	var err error
	if c.tls, c.id.TLS, err = o.tlsConfig(); err != nil {
		return nil, err
	}
	c.id.Username, c.id.Password, c.id.DB, c.id.PoolSize, c.id.Timeout = c.username, hashString(c.password), o.DB, o.PoolSize, o.Timeout
	c.id.Breaker, c.id.DenyCache, c.id.Batch = fmt.Sprint(o.BreakerFailures, o.BreakerCooldown), o.DenyCacheSize, o.Batch
	p := &Plan{o: o, handshakes: c.handshakes}
	if o.Sentinel != nil {
		p.newClient, p.sentinels, err = o.sentinelClient(c)
	} else {
		p.newClient, p.asCluster, err = o.nodeClient(c)
	}
	if err != nil {
		return nil, err
	}
	key, _ := json.Marshal(c.id)
	p.Key = "redis/" + string(key)
	return p, nil
}

// clientParams are the expanded settings shared by every kind of client,
// and the pool key that they and the addresses make.
type clientParams struct {
	username, password string
	tls                *tls.Config
	handshakes         *handshakes
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

// sentinelClient makes a client of the master that Sentinel names, and
// says how to reach each Sentinel.
func (o *Options) sentinelClient(c *clientParams) (func() redis.UniversalClient, []*redis.Options, error) {
	master := o.Sentinel.Master
	var sentinels []string
	for _, raw := range o.Sentinel.Addresses {
		addr := raw
		if err := checkHostPort(addr); err != nil {
			return nil, nil, fmt.Errorf("redis store: sentinel address %q: %v", raw, err)
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
		DB:                    o.DB,
		TLSConfig:             c.tls,
		PoolSize:              o.PoolSize,
		DialTimeout:           o.Timeout,
		MaxRetries:            oneTryMaxRetries,
		DialerRetries:         oneTryDialerRetries,
		ContextTimeoutEnabled: true,
		// The Sentinels' connections and the master's, TLS included.
		Dialer:    dialer(c.tls, o.Timeout),
		OnConnect: c.handshakes.onConnect,
		// No CLIENT SETINFO at connect (noMaintNotifications says why).
		DisableIdentity: true,
	}
	var each []*redis.Options
	for _, addr := range sentinels {
		each = append(each, &redis.Options{
			Addr: addr, Username: opts.SentinelUsername, Password: opts.SentinelPassword,
			TLSConfig: c.tls, Dialer: opts.Dialer, DialTimeout: o.Timeout,
			MaxRetries: oneTryMaxRetries, DialerRetries: oneTryDialerRetries, ContextTimeoutEnabled: true,
			PoolSize: 1, DisableIdentity: true,
		})
	}
	return func() redis.UniversalClient { return redis.NewFailoverClient(opts) }, each, nil
}

// nodeClient makes a client of one node, or of a Cluster when several
// addresses are given. For one TCP address it also returns how to make a
// Cluster client seeded with it.
func (o *Options) nodeClient(c *clientParams) (newClient func() redis.UniversalClient, asCluster func() (redis.UniversalClient, error), err error) {
	addresses := o.Addresses
	if len(addresses) == 0 {
		addresses = []string{DefaultAddress}
	}
	var nodes []*redis.Options
	for _, raw := range addresses {
		node, err := parseAddress(raw)
		if err != nil {
			return nil, nil, fmt.Errorf("redis store: address %q: %v", redactURL(raw), err)
		}
		nodes = append(nodes, node)
		c.id.Nodes = append(c.id.Nodes, node.Network+"|"+node.Addr+"|"+node.Username+"|"+hashString(node.Password)+"|"+strconv.Itoa(node.DB)+"|"+strconv.FormatBool(node.TLSConfig != nil))
	}
	first := nodes[0]
	first.Username = cmp.Or(c.username, first.Username)
	first.Password = cmp.Or(c.password, first.Password)
	first.DB = cmp.Or(o.DB, first.DB)
	if c.tls != nil {
		first.TLSConfig = c.tls.Clone()
		if first.TLSConfig.ServerName == "" && first.Network != "unix" {
			first.TLSConfig.ServerName, _, _ = net.SplitHostPort(first.Addr)
		}
	}
	if len(nodes) > 1 {
		newClient, err = o.clusterClient(c, addresses, nodes)
		return newClient, nil, err
	}
	// Before first's settings become a node client's.
	seed := *first
	asCluster = func() (redis.UniversalClient, error) {
		node := seed
		if node.TLSConfig != nil {
			// The Cluster client changes it; the node client still uses it.
			node.TLSConfig = node.TLSConfig.Clone()
		}
		newCluster, err := o.clusterClient(c, addresses, []*redis.Options{&node})
		if err != nil {
			return nil, err
		}
		return newCluster(), nil
	}
	first.PoolSize = o.PoolSize
	first.MaxRetries = oneTryMaxRetries
	first.DialerRetries = oneTryDialerRetries
	first.ContextTimeoutEnabled = true
	first.DialTimeout = o.Timeout
	first.Dialer = dialer(first.TLSConfig, o.Timeout)
	first.OnConnect = c.handshakes.onConnect
	first.DisableIdentity = true
	first.MaintNotificationsConfig = noMaintNotifications()
	return func() redis.UniversalClient { return redis.NewClient(first) }, asCluster, nil
}

// clusterClient makes a Cluster client from its seed nodes, which must
// agree on what a Cluster cannot vary.
func (o *Options) clusterClient(c *clientParams, addresses []string, nodes []*redis.Options) (func() redis.UniversalClient, error) {
	first := nodes[0]
	for i, node := range nodes {
		raw := addresses[i]
		switch {
		case node.Network == "unix":
			return nil, fmt.Errorf("redis store: address %q: a Cluster needs TCP addresses, not a unix socket", redactURL(raw))
		case (node.TLSConfig != nil) != (first.TLSConfig != nil) && c.tls == nil:
			return nil, fmt.Errorf("redis store: address %q: the Cluster's addresses mix redis:// and rediss://", redactURL(raw))
		case node.DB != 0 || o.DB != 0:
			return nil, fmt.Errorf("redis store: address %q: a Cluster has only database 0", redactURL(raw))
		case i > 0 && c.username == "" && node.Username != first.Username:
			return nil, fmt.Errorf("redis store: address %q: the Cluster's addresses give different usernames", redactURL(raw))
		case i > 0 && c.password == "" && node.Password != first.Password:
			return nil, fmt.Errorf("redis store: address %q: the Cluster's addresses give different passwords", redactURL(raw))
		}
	}
	opts := &redis.ClusterOptions{
		Username:              first.Username,
		Password:              first.Password,
		TLSConfig:             first.TLSConfig,
		PoolSize:              o.PoolSize,
		MaxRetries:            oneTryMaxRetries,
		DialerRetries:         oneTryDialerRetries,
		ContextTimeoutEnabled: true,
		DialTimeout:           o.Timeout,
	}
	for _, node := range nodes {
		opts.Addrs = append(opts.Addrs, node.Addr)
	}
	if opts.TLSConfig != nil {
		// Cluster nodes are many hosts: verify each by its own name.
		opts.TLSConfig.ServerName = ""
	}
	opts.Dialer = dialer(opts.TLSConfig, o.Timeout)
	opts.OnConnect = c.handshakes.onConnect
	opts.DisableIdentity = true
	opts.MaintNotificationsConfig = noMaintNotifications()
	return func() redis.UniversalClient { return redis.NewClusterClient(opts) }, nil
}

// tlsConfig reads the tls block's files. The id it returns names their
// contents, so that renewed certificates make a new client.
func (o *Options) tlsConfig() (*tls.Config, string, error) {
	t := o.TLS
	if t == nil {
		return nil, "", nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: t.InsecureSkipVerify}
	h := sha256.New()
	fmt.Fprint(h, t.InsecureSkipVerify)
	if t.CA != "" {
		pem, err := os.ReadFile(t.CA)
		if err != nil {
			return nil, "", fmt.Errorf("redis store: tls ca %q: %v", t.CA, err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, "", fmt.Errorf("redis store: tls ca %q: no PEM certificate in it", t.CA)
		}
		h.Write(pem)
	}
	if t.Cert != "" {
		certPEM, err := os.ReadFile(t.Cert)
		if err != nil {
			return nil, "", fmt.Errorf("redis store: tls cert %q: %v", t.Cert, err)
		}
		keyPEM, err := os.ReadFile(t.Key)
		if err != nil {
			return nil, "", fmt.Errorf("redis store: tls key %q: %v", t.Key, err)
		}
		pair, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, "", fmt.Errorf("redis store: tls cert %q and key %q: %v", t.Cert, t.Key, err)
		}
		cfg.Certificates = []tls.Certificate{pair}
		h.Write(certPEM)
		h.Write(keyPEM)
	}
	return cfg, hex.EncodeToString(h.Sum(nil)), nil
}

// parseAddress reads a redis://, rediss:// or unix:// URL, or a plain
// host:port.
func parseAddress(addr string) (*redis.Options, error) {
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

// dialer dials within timeout and the caller's deadline, TLS handshake
// included, which go-redis's own TLS dialer does not. go-redis dials apart
// from the request that needs the connection, so without the timeout a
// Redis or Sentinel that accepts and then hangs would hold each dial, and
// a dial slot, for 5 s after the decision gave up.
func dialer(cfg *tls.Config, timeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
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

// noMaintNotifications keeps a new connection's set-up to the dial and
// HELLO: go-redis would also send CLIENT MAINT_NOTIFICATIONS (which a
// server before 8.0 refuses) and CLIENT SETINFO, a round trip each, which a
// node far from Redis pays before its first call on the connection (through
// a 160 ms link, the dial, HELLO and the call leave a 500 ms timeout 20 ms).
// Nothing here reads either.
func noMaintNotifications() *maintnotifications.Config {
	return &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
}
