package ratelimit

import (
	"crypto"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/golang-jwt/jwt/v5"
	"go.uber.org/zap"
)

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
	// onVerify, when set before Provision, is called on every
	// verification of a request's token, cached or not: tests count them.
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
)

// algFamily maps each accepted algorithm to the kind of key it needs.
var algFamily = map[string]string{
	"HS256": "hmac", "HS384": "hmac", "HS512": "hmac",
	"RS256": "rsa", "RS384": "rsa", "RS512": "rsa",
	"PS256": "rsa", "PS384": "rsa", "PS512": "rsa",
	"ES256": "ec", "ES384": "ec", "ES512": "ec",
	"EdDSA": "ed25519",
}

// validate checks what needs no Caddy context, for the Caddyfile adapter
// and provision alike.
func (j *JWTConfig) validate() error {
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
	if err := j.validate(); err != nil {
		return err
	}
	j.logger = ctx.Logger().Named("jwt")
	if j.now == nil { // a test may hand the config its clock
		j.now = jwtClock
	}
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

// token returns the request's raw token, or "". A token given twice, in
// two header lines or two query parameters, is none: PHP and Rack read the
// last of two where Go reads the first, so a keyer that read one would name
// another identity than the origin serves (see urlencodedField). The cookie
// is found as the cookie keyer finds it.
func (j *JWTConfig) token(r *http.Request) string {
	switch {
	case j.FromHeader != "":
		return stripBearer(oneHeader(r, j.FromHeader))
	case j.cookie != nil:
		v, _ := j.cookie.Key(r, nil)
		return string(v)
	case j.FromQuery != "":
		if v, ok := urlencodedField(r.URL.RawQuery, j.FromQuery); ok {
			return v
		}
		return ""
	}
	v := oneHeader(r, "Authorization")
	if len(v) < 7 || !strings.EqualFold(v[:7], "bearer ") {
		return ""
	}
	return strings.TrimSpace(v[7:])
}

// oneHeader is the header field's value when it is given on one line, or "".
func oneHeader(r *http.Request, name string) string {
	if vs := r.Header.Values(name); len(vs) == 1 {
		return vs[0]
	}
	return ""
}

func stripBearer(v string) string {
	if len(v) >= 7 && strings.EqualFold(v[:7], "bearer ") {
		v = v[7:]
	}
	return strings.TrimSpace(v)
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

// Interface guards
var (
	_ Claims = tokenClaims(nil)
	_ Claims = (*requestClaims)(nil)
)
