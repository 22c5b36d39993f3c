package ratelimit

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	jose "github.com/go-jose/go-jose/v4"
	"github.com/golang-jwt/jwt/v5"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(JWTKeyer{})
	handlerSubdirectives["jwt"] = parseJWT
}

// JWTConfig verifies the request's bearer token. Only a verified token's
// claims may name a client or choose a tier: anyone can write a token that
// claims anything, so an unverified one counts as no token at all.
//
// A token is verified once and its verdict kept briefly (at most 30 s, and
// never past its expiry), so a client that sends the same token with every
// request costs one signature check, and a flood of forged tokens is cheap.
type JWTConfig struct {
	// FromHeader reads the token from this request header field instead of
	// `Authorization: Bearer`. A "Bearer " prefix, if present, is removed.
	FromHeader string `json:"from_header,omitempty"`
	// FromCookie reads the token from this cookie.
	FromCookie string `json:"from_cookie,omitempty"`
	// FromQuery reads the token from this query parameter.
	FromQuery string `json:"from_query,omitempty"`

	// Secret is the HMAC key, for HS256, HS384 and HS512. Placeholders
	// such as {env.JWT_SECRET} are expanded at provision.
	Secret string `json:"secret,omitempty"`
	// PublicKey is a PEM file holding a public key (or a certificate) for
	// RS*, PS*, ES* or EdDSA.
	PublicKey string `json:"public_key,omitempty"`
	// JWKS is a JSON Web Key Set: a file path or an https URL. It is read
	// in the background and refreshed every JWKSRefresh; a failed read keeps
	// the last good keys, and no request waits for one. Symmetric (oct)
	// keys in the set are ignored. An https URL must be the document's
	// own: a fetch that is redirected fails, wherever the redirect points.
	JWKS string `json:"jwks,omitempty"`
	// JWKSRefresh is how often the JWKS is read again. Default 5m; at
	// least 1m.
	JWKSRefresh caddy.Duration `json:"jwks_refresh,omitempty"`

	// Algorithms, when set, is the allow-list of signing algorithms.
	// Default: HS256/384/512 with a secret, and the algorithms of the
	// public key's or the JWKS keys' types. "none" is never accepted.
	Algorithms []string `json:"algorithms,omitempty"`
	// Issuer, when set, must equal the token's iss claim.
	Issuer string `json:"issuer,omitempty"`
	// Audience, when set, must be one of the token's aud claim.
	Audience string `json:"audience,omitempty"`
	// Leeway is the clock skew allowed when checking exp and nbf. Default 0.
	Leeway caddy.Duration `json:"leeway,omitempty"`
	// Require lists claims a token must carry, such as ["exp"]: a token
	// without one of them counts as no token at all. A dot path reaches
	// into objects. Default: none, so a token without exp never expires.
	Require []string `json:"require,omitempty"`

	parser    *jwt.Parser
	secret    []byte
	publicKey crypto.PublicKey
	jwks      atomic.Pointer[jwkSet]
	// gen counts key set changes; cached verdicts from older keys are void.
	gen    atomic.Uint64
	nudge  chan struct{}
	client *http.Client
	cache  tokenCache
	cookie *CookieKeyer
	now    func() time.Time
	logger *zap.Logger
	// onVerify is jwtVerifying, read once at provision.
	onVerify func()
}

// jwtUser is a keyer that reads verified claims.
type jwtUser interface {
	useJWT(*JWTConfig)
}

const (
	// maxTokenSize is the longest token verified; longer ones are rejected
	// unread, so that a huge token costs no hashing or parsing.
	maxTokenSize = 8 << 10
	// verifiedTTL and rejectedTTL bound how long a verdict is cached.
	verifiedTTL = 30 * time.Second
	rejectedTTL = 5 * time.Second
	// maxJWKSSize bounds a JWKS document.
	maxJWKSSize = 1 << 20
)

// Tests replace these.
var (
	// jwtClock is the time tokens are checked against.
	jwtClock = time.Now
	// jwksHTTPClient fetches https JWKS.
	jwksHTTPClient = &http.Client{Timeout: 10 * time.Second}
	// jwksFirstWait is how long provision waits for the first https fetch.
	jwksFirstWait = 2 * time.Second
	// jwksMinRefresh is the shortest jwks_refresh accepted.
	jwksMinRefresh = time.Minute
	// jwtVerifying, when set, is called on every verification of a
	// request's token, cached or not: tests count them.
	jwtVerifying func()
)

// algFamily maps each accepted algorithm to the kind of key it needs.
var algFamily = map[string]string{
	"HS256": "hmac", "HS384": "hmac", "HS512": "hmac",
	"RS256": "rsa", "RS384": "rsa", "RS512": "rsa",
	"PS256": "rsa", "PS384": "rsa", "PS512": "rsa",
	"ES256": "ec", "ES384": "ec", "ES512": "ec",
	"EdDSA": "ed25519",
}

// check validates what needs no Caddy context, for the Caddyfile adapter
// and provision alike.
func (j *JWTConfig) check() error {
	from := 0
	for _, f := range []string{j.FromHeader, j.FromCookie, j.FromQuery} {
		if f != "" {
			from++
		}
	}
	if from > 1 {
		return fmt.Errorf("jwt: give one of from header, cookie or query")
	}
	if j.Secret == "" && j.PublicKey == "" && j.JWKS == "" {
		return fmt.Errorf("jwt: no key to verify tokens with: give secret, public_key or jwks")
	}
	if j.JWKS != "" && strings.Contains(j.JWKS, "://") && !strings.HasPrefix(j.JWKS, "https://") {
		return fmt.Errorf("jwt: jwks %q: want a file or an https:// URL", j.JWKS)
	}
	for _, alg := range j.Algorithms {
		fam, ok := algFamily[alg]
		if !ok {
			return fmt.Errorf("jwt: algorithm %q: want one of HS256, HS384, HS512, RS256, RS384, RS512, PS256, PS384, PS512, ES256, ES384, ES512, EdDSA (none is never accepted)", alg)
		}
		if fam == "hmac" && j.Secret == "" {
			return fmt.Errorf("jwt: algorithm %s needs a secret", alg)
		}
		if fam != "hmac" && j.PublicKey == "" && j.JWKS == "" {
			return fmt.Errorf("jwt: algorithm %s needs a public_key or jwks", alg)
		}
	}
	if j.Leeway < 0 {
		return fmt.Errorf("jwt: leeway %v: must not be negative", time.Duration(j.Leeway))
	}
	if j.JWKSRefresh != 0 && time.Duration(j.JWKSRefresh) < jwksMinRefresh {
		// The issuer's server is not ours to poll hard; rotation is caught
		// sooner anyway, when a token names a key id not yet held.
		return fmt.Errorf("jwt: jwks_refresh %v: must be at least %s", time.Duration(j.JWKSRefresh), strings.TrimSuffix(jwksMinRefresh.String(), "0s"))
	}
	for _, name := range j.Require {
		if name == "" {
			return fmt.Errorf("jwt: require: an empty claim name")
		}
	}
	return nil
}

func (j *JWTConfig) provision(ctx caddy.Context) error {
	if err := j.check(); err != nil {
		return err
	}
	j.logger = ctx.Logger().Named("jwt")
	j.now = jwtClock
	j.onVerify = jwtVerifying
	if j.FromCookie != "" {
		j.cookie = &CookieKeyer{Name: j.FromCookie}
		if err := j.cookie.Provision(ctx); err != nil {
			return fmt.Errorf("jwt: from cookie: %v", err)
		}
	}
	if j.Secret != "" {
		secret := caddy.NewReplacer().ReplaceKnown(j.Secret, "")
		if secret == "" {
			return fmt.Errorf("jwt: secret is empty once its placeholders are expanded")
		}
		j.secret = []byte(secret)
	}
	if j.PublicKey != "" {
		pub, err := readPublicKey(j.PublicKey)
		if err != nil {
			return fmt.Errorf("jwt: public_key: %v", err)
		}
		j.publicKey = pub
	}

	allowed, err := j.allowedAlgorithms()
	if err != nil {
		return err
	}
	opts := []jwt.ParserOption{
		jwt.WithValidMethods(allowed),
		jwt.WithLeeway(time.Duration(j.Leeway)),
		jwt.WithTimeFunc(j.now),
		jwt.WithJSONNumber(),
	}
	if j.Issuer != "" {
		opts = append(opts, jwt.WithIssuer(j.Issuer))
	}
	if j.Audience != "" {
		opts = append(opts, jwt.WithAudience(j.Audience))
	}
	if slices.Contains(j.Require, "exp") {
		opts = append(opts, jwt.WithExpirationRequired())
	}
	j.parser = jwt.NewParser(opts...)

	if j.JWKS != "" {
		return j.startJWKS(ctx)
	}
	return nil
}

// allowedAlgorithms is the allow-list: Algorithms, or else the algorithms
// of the keys configured. HMAC is allowed only with a secret, so that a
// token signed with a public key's bytes as an HMAC secret never passes.
func (j *JWTConfig) allowedAlgorithms() ([]string, error) {
	if len(j.Algorithms) > 0 {
		for _, alg := range j.Algorithms {
			fam := algFamily[alg]
			if fam != "hmac" && j.JWKS == "" && !keyFits(alg, j.publicKey) {
				return nil, fmt.Errorf("jwt: algorithm %s does not fit the public_key's type", alg)
			}
		}
		return j.Algorithms, nil
	}
	var algs []string
	for alg, fam := range algFamily {
		switch {
		case fam == "hmac" && j.secret != nil,
			fam != "hmac" && j.JWKS != "",
			fam != "hmac" && keyFits(alg, j.publicKey):
			algs = append(algs, alg)
		}
	}
	slices.Sort(algs)
	return algs, nil
}

// keyFits reports whether an asymmetric algorithm verifies with pub.
func keyFits(alg string, pub crypto.PublicKey) bool {
	switch k := pub.(type) {
	case *rsa.PublicKey:
		return algFamily[alg] == "rsa"
	case *ecdsa.PublicKey:
		switch k.Curve {
		case elliptic.P256():
			return alg == "ES256"
		case elliptic.P384():
			return alg == "ES384"
		case elliptic.P521():
			return alg == "ES512"
		}
	case ed25519.PublicKey:
		return alg == "EdDSA"
	}
	return false
}

// readPublicKey reads a PEM public key or certificate.
func readPublicKey(file string) (crypto.PublicKey, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("%s: no PEM block", file)
	}
	var pub any
	switch block.Type {
	case "CERTIFICATE":
		cert, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("%s: %v", file, err)
		}
		pub = cert.PublicKey
	case "RSA PUBLIC KEY":
		pub, err = x509.ParsePKCS1PublicKey(block.Bytes)
	default:
		pub, err = x509.ParsePKIXPublicKey(block.Bytes)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %v", file, err)
	}
	switch pub.(type) {
	case *rsa.PublicKey, *ecdsa.PublicKey, ed25519.PublicKey:
		return pub, nil
	}
	return nil, fmt.Errorf("%s: unsupported key type %T", file, pub)
}

// token returns the request's raw token, or "".
func (j *JWTConfig) token(r *http.Request) string {
	switch {
	case j.FromHeader != "":
		return stripBearer(r.Header.Get(j.FromHeader))
	case j.cookie != nil:
		v, _ := j.cookie.Key(r, nil)
		return string(v)
	case j.FromQuery != "":
		return r.URL.Query().Get(j.FromQuery)
	}
	v := r.Header.Get("Authorization")
	if len(v) < 7 || !strings.EqualFold(v[:7], "bearer ") {
		return ""
	}
	return strings.TrimSpace(v[7:])
}

func stripBearer(v string) string {
	if len(v) >= 7 && strings.EqualFold(v[:7], "bearer ") {
		v = v[7:]
	}
	return strings.TrimSpace(v)
}

// requestClaims are a request's verified claims, verified when first asked
// for, and then kept: keyers, tiers and placeholders share one verification,
// and a request that none of them asks about costs none.
type requestClaims struct {
	jwt    *JWTConfig // nil without a jwt block
	r      *http.Request
	done   bool
	claims tokenClaims
}

func (rc *requestClaims) get() tokenClaims {
	if !rc.done && rc.jwt != nil {
		rc.done = true
		rc.claims = rc.jwt.verify(rc.jwt.token(rc.r))
	}
	return rc.claims
}

// Claim implements Claims.
func (rc *requestClaims) Claim(name string) []string { return rc.get()[name] }

// claimsKeyer is a keyer that names the client by verified claims, which
// the handler verifies once per request and hands it.
type claimsKeyer interface {
	keyFromClaims(c tokenClaims, buf []byte) ([]byte, bool)
}

// keyWith is k.Key, but hands a claims keyer the request's claims.
func keyWith(k Keyer, r *http.Request, buf []byte, rc *requestClaims) ([]byte, bool) {
	if ck, ok := k.(claimsKeyer); ok {
		return ck.keyFromClaims(rc.get(), buf)
	}
	return k.Key(r, buf)
}

// verify returns the token's claims if it checks out, or nil. Verdicts are
// cached by the token's SHA-256.
func (j *JWTConfig) verify(token string) tokenClaims {
	if j.onVerify != nil {
		j.onVerify()
	}
	if token == "" || len(token) > maxTokenSize {
		return nil
	}
	sum := sha256.Sum256([]byte(token))
	now := j.now()
	gen := j.gen.Load()
	if c, ok := j.cache.get(sum, now, gen); ok {
		return c
	}
	mc := jwt.MapClaims{}
	parsed, err := j.parser.ParseWithClaims(token, mc, j.keyFor)
	if err != nil || !parsed.Valid {
		j.cache.put(sum, cacheEntry{until: now.Add(rejectedTTL), gen: gen}, now)
		return nil
	}
	c := flattenClaims(mc)
	for _, name := range j.Require {
		if len(c[name]) == 0 {
			j.cache.put(sum, cacheEntry{until: now.Add(rejectedTTL), gen: gen}, now)
			return nil
		}
	}
	until := now.Add(verifiedTTL)
	if exp, err := mc.GetExpirationTime(); err == nil && exp != nil {
		if end := exp.Add(time.Duration(j.Leeway)); end.Before(until) {
			until = end
		}
	}
	j.cache.put(sum, cacheEntry{claims: c, until: until, gen: gen}, now)
	return c
}

// keyFor picks the keys that may verify the token. The key's type follows
// from the algorithm, which the parser has already checked against the
// allow-list: HMAC gets the secret and nothing else, the others get public
// keys of their own type only.
func (j *JWTConfig) keyFor(t *jwt.Token) (any, error) {
	alg := t.Method.Alg()
	if algFamily[alg] == "hmac" {
		if j.secret == nil {
			return nil, errors.New("no secret for HMAC")
		}
		return j.secret, nil
	}
	var keys []jwt.VerificationKey
	if keyFits(alg, j.publicKey) {
		keys = append(keys, j.publicKey)
	}
	if set := j.jwks.Load(); set != nil {
		kid, _ := t.Header["kid"].(string)
		for _, k := range set.keys {
			if (kid == "" || k.kid == kid) && (k.alg == "" || k.alg == alg) && keyFits(alg, k.pub) {
				keys = append(keys, k.pub)
			}
		}
	}
	if len(keys) == 0 && j.nudge != nil {
		// Perhaps the issuer has rotated its keys, or the first fetch
		// failed: read the JWKS again soon, without waiting for it.
		select {
		case j.nudge <- struct{}{}:
		default:
		}
	}
	if len(keys) == 0 {
		return nil, errors.New("no key for the token")
	}
	return jwt.VerificationKeySet{Keys: keys}, nil
}

// tokenClaims are verified claims, flattened: nested objects by dot path,
// arrays as one value per element.
type tokenClaims map[string][]string

// Claim implements Claims.
func (c tokenClaims) Claim(name string) []string { return c[name] }

// flattenClaims turns a token's claims into strings.
func flattenClaims(mc jwt.MapClaims) tokenClaims {
	c := make(tokenClaims, len(mc))
	for name, v := range mc {
		flattenClaim(c, name, v, 0)
	}
	return c
}

func flattenClaim(c tokenClaims, name string, v any, depth int) {
	switch v := v.(type) {
	case map[string]any:
		if depth >= 8 {
			return
		}
		for k, x := range v {
			flattenClaim(c, name+"."+k, x, depth+1)
		}
	case []any:
		for _, x := range v {
			if s, ok := jsonScalar(x); ok {
				c[name] = append(c[name], s)
			}
		}
	default:
		if s, ok := jsonScalar(v); ok {
			c[name] = append(c[name], s)
		}
	}
}

// tokenCache holds recent verdicts, bounded, in shards so that no lock is
// shared by every request.
type tokenCache struct {
	shards [16]tokenCacheShard
}

type tokenCacheShard struct {
	mu sync.Mutex
	m  map[[sha256.Size]byte]cacheEntry
}

// cacheEntry is a verdict: claims, or nil for a rejected token.
type cacheEntry struct {
	claims tokenClaims
	until  time.Time
	gen    uint64
}

// maxCachedPerShard bounds the cache at 16 times this many tokens.
const maxCachedPerShard = 1024

func (c *tokenCache) get(sum [sha256.Size]byte, now time.Time, gen uint64) (tokenClaims, bool) {
	s := &c.shards[sum[0]&15]
	s.mu.Lock()
	e, ok := s.m[sum]
	s.mu.Unlock()
	if !ok || e.gen != gen || !now.Before(e.until) {
		return nil, false
	}
	return e.claims, true
}

func (c *tokenCache) put(sum [sha256.Size]byte, e cacheEntry, now time.Time) {
	s := &c.shards[sum[0]&15]
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.m == nil {
		s.m = make(map[[sha256.Size]byte]cacheEntry)
	}
	if len(s.m) >= maxCachedPerShard {
		// Drop the stale among a few entries, or else one of them: map
		// order is random, so this evicts at random.
		scanned, dropped := 0, 0
		for k, old := range s.m {
			if !now.Before(old.until) || old.gen != e.gen {
				delete(s.m, k)
				dropped++
			}
			if scanned++; scanned >= 8 {
				if dropped == 0 {
					delete(s.m, k)
				}
				break
			}
		}
	}
	s.m[sum] = e
}

// jwkSet is a parsed JWKS.
type jwkSet struct {
	raw  []byte
	keys []jwk
}

type jwk struct {
	kid, alg string
	pub      crypto.PublicKey
}

// parseJWKS reads the signing keys of a JWKS document. Keys it cannot use
// (symmetric, encryption-only or malformed) are skipped.
func parseJWKS(data []byte) (*jwkSet, error) {
	var doc struct {
		Keys []json.RawMessage `json:"keys"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("parsing JWKS: %v", err)
	}
	set := &jwkSet{raw: data}
	for _, raw := range doc.Keys {
		var k jose.JSONWebKey
		if err := k.UnmarshalJSON(raw); err != nil || !k.Valid() || (k.Use != "" && k.Use != "sig") {
			continue
		}
		pub := k.Public()
		switch pub.Key.(type) {
		case *rsa.PublicKey, *ecdsa.PublicKey, ed25519.PublicKey:
			set.keys = append(set.keys, jwk{kid: k.KeyID, alg: k.Algorithm, pub: pub.Key})
		}
	}
	if len(set.keys) == 0 {
		return nil, errors.New("JWKS holds no usable signing key")
	}
	return set, nil
}

// startJWKS reads the JWKS once, then refreshes it in the background until
// the config is unloaded. A file is read before provision returns, and an
// unreadable one fails it. An https URL is fetched in the background; provision
// waits a little for it but never fails because it is unreachable.
func (j *JWTConfig) startJWKS(ctx caddy.Context) error {
	j.nudge = make(chan struct{}, 1)
	client := *jwksHTTPClient
	client.CheckRedirect = refuseRedirect
	j.client = &client
	refresh := time.Duration(j.JWKSRefresh)
	if refresh == 0 {
		refresh = 5 * time.Minute
	}
	first := make(chan struct{})
	remote := strings.HasPrefix(j.JWKS, "https://")
	if !remote {
		if err := j.loadJWKS(ctx); err != nil {
			return fmt.Errorf("jwt: jwks: %v", err)
		}
		close(first)
	}
	go j.refreshJWKS(ctx, refresh, first)
	if remote {
		select {
		case <-first:
		case <-time.After(jwksFirstWait):
			j.logger.Warn("JWKS not fetched yet; tokens fall back to the next keyer until it is", zap.String("jwks", j.JWKS))
		}
	}
	return nil
}

func (j *JWTConfig) refreshJWKS(ctx context.Context, every time.Duration, first chan struct{}) {
	last := time.Now()
	if first != nil {
		select {
		case <-first:
		default:
			if err := j.loadJWKS(ctx); err != nil {
				j.logFetchError("fetching JWKS", err)
			}
			close(first)
		}
	}
	ticker := time.NewTicker(every)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		case <-j.nudge:
			// Unknown key ids ask at most this often.
			if time.Since(last) < min(every, 10*time.Second) {
				continue
			}
		}
		last = time.Now()
		if err := j.loadJWKS(ctx); err != nil {
			j.logFetchError("refreshing JWKS; keeping the last good keys", err)
		}
	}
}

// loadJWKS reads the JWKS and, if it changed, swaps it in.
func (j *JWTConfig) loadJWKS(ctx context.Context) error {
	data, err := readJWKS(ctx, j.client, j.JWKS)
	if err != nil {
		return err
	}
	if old := j.jwks.Load(); old != nil && string(old.raw) == string(data) {
		return nil
	}
	set, err := parseJWKS(data)
	if err != nil {
		return err
	}
	j.jwks.Store(set)
	j.gen.Add(1)
	return nil
}

// refuseRedirect fails a JWKS fetch that is redirected. The keys decide
// whose tokens are believed, so they come from the URL configured and from
// nowhere it might point: not plain http, not another host, not another
// path that a compromised or misconfigured server names.
func refuseRedirect(req *http.Request, via []*http.Request) error {
	return fmt.Errorf("redirected to %s: %w", req.URL.Redacted(), errJWKSRedirect)
}

var errJWKSRedirect = errors.New("redirects are refused; give the JWKS's final https URL")

// logFetchError logs a failed JWKS read: a redirect as an error, since no
// retry will succeed until the config changes; the rest as warnings.
func (j *JWTConfig) logFetchError(msg string, err error) {
	log := j.logger.Warn
	if errors.Is(err, errJWKSRedirect) {
		log = j.logger.Error
	}
	log(msg, zap.String("jwks", j.JWKS), zap.Error(err))
}

func readJWKS(ctx context.Context, client *http.Client, src string) ([]byte, error) {
	if !strings.HasPrefix(src, "https://") {
		return os.ReadFile(src)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, src, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: status %d", src, resp.StatusCode)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxJWKSSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxJWKSSize {
		return nil, fmt.Errorf("GET %s: JWKS larger than %d bytes", src, maxJWKSSize)
	}
	return data, nil
}

// parseJWT reads the jwt block:
//
//	jwt {
//	    from header <field> | cookie <name> | query <param>
//	    secret <hmac secret>
//	    public_key <pem file>
//	    jwks <file or https url>
//	    jwks_refresh <duration>
//	    algorithms <alg...>
//	    issuer <iss>
//	    audience <aud>
//	    leeway <duration>
//	    require <claim...>
//	}
func parseJWT(h *Handler, d *caddyfile.Dispenser) error {
	seg := d.NewFromNextSegment()
	seg.Next() // jwt
	if h.JWT != nil {
		return seg.Err("jwt: given twice")
	}
	if seg.NextArg() {
		return seg.Errf("jwt: takes a block, not %q", seg.Val())
	}
	j := new(JWTConfig)
	for seg.NextBlock(0) {
		var err error
		switch sub := seg.Val(); sub {
		case "from":
			var where, name string
			if !seg.AllArgs(&where, &name) {
				return seg.Err("jwt from: want header <field>, cookie <name> or query <param>")
			}
			switch where {
			case "header":
				j.FromHeader = name
			case "cookie":
				j.FromCookie = name
			case "query":
				j.FromQuery = name
			default:
				return seg.Errf("jwt from %q: want header, cookie or query", where)
			}
		case "secret":
			err = oneArg(seg, &j.Secret)
		case "public_key":
			err = oneArg(seg, &j.PublicKey)
		case "jwks":
			err = oneArg(seg, &j.JWKS)
		case "jwks_refresh":
			err = durationArg(seg, &j.JWKSRefresh)
		case "algorithms":
			j.Algorithms = append(j.Algorithms, seg.RemainingArgs()...)
			if len(j.Algorithms) == 0 {
				return seg.Err("jwt algorithms: want one or more, such as RS256")
			}
		case "issuer":
			err = oneArg(seg, &j.Issuer)
		case "audience":
			err = oneArg(seg, &j.Audience)
		case "leeway":
			err = durationArg(seg, &j.Leeway)
		case "require":
			names := seg.RemainingArgs()
			if len(names) == 0 {
				return seg.Err("jwt require: want one or more claims, such as exp")
			}
			j.Require = append(j.Require, names...)
		default:
			return seg.Errf("jwt: unknown subdirective %q", sub)
		}
		if err != nil {
			return err
		}
	}
	if err := j.check(); err != nil {
		seg.Reset()
		seg.Next()
		return seg.Err(err.Error())
	}
	h.JWT = j
	return nil
}

// durationArg reads exactly one duration argument.
func durationArg(d *caddyfile.Dispenser, dur *caddy.Duration) error {
	name := d.Val()
	var s string
	if !d.AllArgs(&s) {
		return d.Errf("%s: want exactly one duration", name)
	}
	v, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("%s %q: want a duration such as 30s", name, s)
	}
	if v < 0 {
		return d.Errf("%s %q: must not be negative", name, s)
	}
	*dur = caddy.Duration(v)
	return nil
}

// JWTKeyer names the client by a claim of the request's verified JWT, such
// as sub. It yields nothing when the token is absent or does not verify.
type JWTKeyer struct {
	// Claim is the claim's name; a dot path reaches into objects.
	Claim string `json:"claim"`

	jwt *JWTConfig
	id  string
}

// CaddyModule returns the Caddy module information.
func (JWTKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "jwt",
		New: func() caddy.Module { return new(JWTKeyer) },
	}
}

// Provision checks the claim's name.
func (k *JWTKeyer) Provision(caddy.Context) error {
	if k.Claim == "" {
		return fmt.Errorf("key jwt: a claim name is required, such as sub")
	}
	k.id = "jwt/" + k.Claim
	return nil
}

func (k *JWTKeyer) useJWT(j *JWTConfig) { k.jwt = j }

// Kind implements Keyer.
func (*JWTKeyer) Kind() string { return "jwt" }

// ID implements Keyer.
func (k *JWTKeyer) ID() string { return k.id }

// Key implements Keyer. The handler calls keyFromClaims instead.
func (k *JWTKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	if k.jwt == nil {
		return buf, false
	}
	return k.keyFromClaims(k.jwt.verify(k.jwt.token(r)), buf)
}

// keyFromClaims implements claimsKeyer. An array claim's elements are
// joined by commas.
func (k *JWTKeyer) keyFromClaims(c tokenClaims, buf []byte) ([]byte, bool) {
	vals := c[k.Claim]
	n := len(buf)
	for i, v := range vals {
		if i > 0 {
			buf = append(buf, ',')
		}
		buf = append(buf, v...)
	}
	return buf, len(buf) > n
}

// UnmarshalCaddyfile reads `jwt <claim>`.
func (k *JWTKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Claim) {
		return d.Err("key jwt: want exactly one claim name, such as sub")
	}
	return nil
}

// Interface guards
var (
	_ Keyer                 = (*JWTKeyer)(nil)
	_ jwtUser               = (*JWTKeyer)(nil)
	_ claimsKeyer           = (*JWTKeyer)(nil)
	_ caddy.Provisioner     = (*JWTKeyer)(nil)
	_ caddyfile.Unmarshaler = (*JWTKeyer)(nil)
	_ Claims                = tokenClaims(nil)
	_ Claims                = (*requestClaims)(nil)
)
