package ratelimit

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/golang-jwt/jwt/v5"
)

// jwtT0 is the time every JWT test runs at, through jwtClock.
var jwtT0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// jwtTestClock is a settable clock for token checks.
type jwtTestClock struct{ unix atomic.Int64 }

func (c *jwtTestClock) now() time.Time          { return time.Unix(0, c.unix.Load()) }
func (c *jwtTestClock) advance(d time.Duration) { c.unix.Add(int64(d)) }

// useJWTClock makes JWT configs provisioned from now on, until the test
// ends, check tokens against a clock that starts at jwtT0.
func useJWTClock(t testing.TB) *jwtTestClock {
	c := new(jwtTestClock)
	c.unix.Store(jwtT0.UnixNano())
	old := jwtClock
	jwtClock = c.now
	t.Cleanup(func() { jwtClock = old })
	return c
}

var testRSAKey = sync.OnceValue(func() *rsa.PrivateKey {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		panic(err)
	}
	return k
})

var otherRSAKey = sync.OnceValue(func() *rsa.PrivateKey {
	k, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		panic(err)
	}
	return k
})

// publicPEM returns the PKIX PEM of a public key.
func publicPEM(t testing.TB, pub any) []byte {
	t.Helper()
	der, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der})
}

// writeFile writes data to a file in the test's temporary directory,
// atomically, and returns its path.
func writeFile(t testing.TB, dir, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(dir, name)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// sign makes a token; kid, when not empty, goes in the header.
func sign(t testing.TB, method jwt.SigningMethod, key any, kid string, claims jwt.MapClaims) string {
	t.Helper()
	tok := jwt.NewWithClaims(method, claims)
	if kid != "" {
		tok.Header["kid"] = kid
	}
	s, err := tok.SignedString(key)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// claimsAt returns standard claims for sub and plan, valid an hour around jwtT0.
func claimsAt(sub, plan string) jwt.MapClaims {
	return jwt.MapClaims{
		"sub":  sub,
		"plan": plan,
		"iss":  "https://issuer.test",
		"aud":  "api",
		"iat":  jwtT0.Unix(),
		"exp":  jwtT0.Add(time.Hour).Unix(),
	}
}

// keyIDOf is the {http.rate_limit.key_id} the handler shows for a client.
func keyIDOf(keyer, value string) string {
	sum := (&Bucket{Keyer: keyer, Value: []byte(value)}).Digest()
	return hex.EncodeToString(sum[:8])
}

// provisionJWT provisions a config outside Caddy, for unit tests.
func provisionJWT(t testing.TB, j *JWTConfig) *JWTConfig {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := j.provision(ctx); err != nil {
		t.Fatalf("provision: %v", err)
	}
	return j
}

func bearer(tok string) string { return "Authorization: Bearer " + tok }

func TestValidJWTGetsItsTierAndItsOwnBucket(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	pemFile := writeFile(t, t.TempDir(), "pub.pem", publicPEM(t, &testRSAKey().PublicKey))
	s := serve(t, fmt.Sprintf(`
	rate_limit 2 1/h {
		key jwt sub
		jwt {
			public_key %s
			issuer https://issuer.test
			audience api
		}
		tier enterprise 5 1/h {
			claim plan enterprise
		}
	}
	respond "{http.rate_limit.tier} {http.rate_limit.key_id} {http.rate_limit.claim.plan}"`, pemFile))

	alice := sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claimsAt("alice", "enterprise"))
	bob := sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claimsAt("bob", "enterprise"))
	carol := sign(t, jwt.SigningMethodPS256, testRSAKey(), "", claimsAt("carol", "free"))

	for i, c := range []struct {
		token, tier, sub, limit, remaining, plan string
	}{
		{alice, "enterprise", "alice", "5", "4", "enterprise"},
		{alice, "enterprise", "alice", "5", "3", "enterprise"},
		{bob, "enterprise", "bob", "5", "4", "enterprise"},
		{carol, "default", "carol", "2", "1", "free"},
	} {
		r := s.from("127.0.0.2", "/", bearer(c.token))
		want := c.tier + " " + keyIDOf("jwt/sub", c.sub) + " " + c.plan
		if r.status != 200 || r.body != want {
			t.Errorf("request %d (%s): %d %q, want 200 %q", i+1, c.sub, r.status, r.body, want)
		}
		if got := r.header.Get("X-RateLimit-Limit"); got != c.limit {
			t.Errorf("request %d (%s): limit %s, want %s", i+1, c.sub, got, c.limit)
		}
		if got := r.header.Get("X-RateLimit-Remaining"); got != c.remaining {
			t.Errorf("request %d (%s): remaining %s, want %s", i+1, c.sub, got, c.remaining)
		}
	}
}

func TestInvalidJWTFallsBackToIPAndDefaultTier(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	pubPEM := publicPEM(t, &testRSAKey().PublicKey)
	pemFile := writeFile(t, t.TempDir(), "pub.pem", pubPEM)
	s := serve(t, fmt.Sprintf(`
	rate_limit 10 1/h {
		key jwt sub
		jwt {
			public_key %s
			issuer https://issuer.test
			audience api
			leeway 5s
		}
		tier enterprise 50 1/h {
			claim plan enterprise
		}
	}
	respond "{http.rate_limit.tier} {http.rate_limit.key_id}"`, pemFile))

	with := func(change func(jwt.MapClaims)) jwt.MapClaims {
		c := claimsAt("mallory", "enterprise")
		change(c)
		return c
	}
	rs := func(c jwt.MapClaims) string { return sign(t, jwt.SigningMethodRS256, testRSAKey(), "", c) }
	valid := claimsAt("mallory", "enterprise")
	huge := with(func(c jwt.MapClaims) { c["pad"] = strings.Repeat("x", 16<<10) })

	cases := []struct {
		name  string
		token string
	}{
		{"wrong signature", sign(t, jwt.SigningMethodRS256, otherRSAKey(), "", valid)},
		{"alg none", sign(t, jwt.SigningMethodNone, jwt.UnsafeAllowNoneSignatureType, "", valid)},
		{"HS256 signed with the public key's PEM", sign(t, jwt.SigningMethodHS256, pubPEM, "", valid)},
		{"expired", rs(with(func(c jwt.MapClaims) { c["exp"] = jwtT0.Add(-10 * time.Second).Unix() }))},
		{"not yet valid", rs(with(func(c jwt.MapClaims) { c["nbf"] = jwtT0.Add(10 * time.Second).Unix() }))},
		{"wrong issuer", rs(with(func(c jwt.MapClaims) { c["iss"] = "https://evil.test" }))},
		{"wrong audience", rs(with(func(c jwt.MapClaims) { c["aud"] = "other" }))},
		{"no audience", rs(with(func(c jwt.MapClaims) { delete(c, "aud") }))},
		{"garbage", "not.a.token"},
		{"payload tampered", tamper(t, rs(valid))},
		{"16 KB token", rs(huge)},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ip := "127.0.0." + strconv.Itoa(10+i)
			r := s.from(ip, "/", bearer(c.token))
			want := "default " + keyIDOf("ip/32/64", ip)
			if r.status != 200 || r.body != want {
				t.Errorf("%d %q, want 200 %q (the client IP and the default tier)", r.status, r.body, want)
			}
		})
	}

	// The same checks pass a good token, and leeway admits small skew.
	for i, c := range []jwt.MapClaims{
		valid,
		with(func(c jwt.MapClaims) { c["exp"] = jwtT0.Add(-3 * time.Second).Unix() }),
		with(func(c jwt.MapClaims) { c["nbf"] = jwtT0.Add(3 * time.Second).Unix() }),
	} {
		r := s.from("127.0.0.100", "/", bearer(rs(c)))
		if want := "enterprise " + keyIDOf("jwt/sub", "mallory"); r.body != want {
			t.Errorf("good token %d: %q, want %q", i, r.body, want)
		}
	}
}

// tamper changes the payload of a signed token, keeping its signature.
func tamper(t testing.TB, tok string) string {
	parts := strings.Split(tok, ".")
	payload, err := base64.RawURLEncoding.DecodeString(parts[1])
	if err != nil {
		t.Fatal(err)
	}
	payload = []byte(strings.Replace(string(payload), "mallory", "mallorz", 1))
	parts[1] = base64.RawURLEncoding.EncodeToString(payload)
	return strings.Join(parts, ".")
}

// enterpriseSite limits anonymous clients to 2 an hour by IP, and
// enterprise tokens to 5 an hour by subject.
func enterpriseSite(t *testing.T) *testServer {
	t.Setenv("RL_TEST_JWT_SECRET", "correct horse battery staple")
	return serve(t, `
	rate_limit 2 1/h {
		key jwt sub
		jwt {
			secret {env.RL_TEST_JWT_SECRET}
			algorithms HS256
		}
		tier enterprise 5 1/h {
			claim plan enterprise
		}
	}
	respond "{http.rate_limit.tier} {http.rate_limit.key_id}"`)
}

func TestForgedEnterpriseTokenGetsAnonymousLimitKeyedByIP(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	s := enterpriseSite(t)
	// Each request mints a new subject, as an attacker would.
	for i, want := range []int{200, 200, 429, 429} {
		forged := sign(t, jwt.SigningMethodHS256, []byte("guessed secret"), "", claimsAt("sub-"+strconv.Itoa(i), "enterprise"))
		r := s.from("127.0.0.2", "/", bearer(forged))
		if r.status != want {
			t.Fatalf("forged request %d: status %d, want %d", i+1, r.status, want)
		}
		if r.header.Get("X-RateLimit-Limit") != "2" {
			t.Errorf("forged request %d: limit %q, want the anonymous 2", i+1, r.header.Get("X-RateLimit-Limit"))
		}
		if want == 200 && r.body != "default "+keyIDOf("ip/32/64", "127.0.0.2") {
			t.Errorf("forged request %d: %q, want the default tier keyed by IP", i+1, r.body)
		}
	}
}

func TestGenuineEnterpriseTokenGetsLargerBucket(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	s := enterpriseSite(t)
	genuine := sign(t, jwt.SigningMethodHS256, []byte("correct horse battery staple"), "", claimsAt("acme", "enterprise"))
	for i := range 5 {
		// From several addresses: the bucket follows the subject.
		r := s.from("127.0.0."+strconv.Itoa(2+i), "/", bearer(genuine))
		if r.status != 200 || r.body != "enterprise "+keyIDOf("jwt/sub", "acme") {
			t.Fatalf("request %d: %d %q, want 200 from the enterprise tier", i+1, r.status, r.body)
		}
		if got, want := r.header.Get("X-RateLimit-Remaining"), strconv.Itoa(4-i); got != want {
			t.Errorf("request %d: remaining %s, want %s", i+1, got, want)
		}
	}
	if r := s.from("127.0.0.9", "/", bearer(genuine)); r.status != 429 {
		t.Errorf("6th request: status %d, want 429", r.status)
	}
}

func TestJWTPublicKeyTypesAndAlgorithmAllowList(t *testing.T) {
	useJWTClock(t)
	dir := t.TempDir()
	ecKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	edPub, edPriv := newEd25519(t)
	rsaFile := writeFile(t, dir, "rsa.pem", publicPEM(t, &testRSAKey().PublicKey))
	ecFile := writeFile(t, dir, "ec.pem", publicPEM(t, &ecKey.PublicKey))
	edFile := writeFile(t, dir, "ed.pem", publicPEM(t, edPub))
	claims := claimsAt("s", "free")

	cases := []struct {
		name   string
		config *JWTConfig
		token  string
		ok     bool
	}{
		{"RS256 with an RSA key", &JWTConfig{PublicKey: rsaFile}, sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claims), true},
		{"PS512 with an RSA key", &JWTConfig{PublicKey: rsaFile}, sign(t, jwt.SigningMethodPS512, testRSAKey(), "", claims), true},
		{"RS256 outside the allow-list", &JWTConfig{PublicKey: rsaFile, Algorithms: []string{"PS256"}}, sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claims), false},
		{"ES256 with a P-256 key", &JWTConfig{PublicKey: ecFile}, sign(t, jwt.SigningMethodES256, ecKey, "", claims), true},
		{"EdDSA with an Ed25519 key", &JWTConfig{PublicKey: edFile}, sign(t, jwt.SigningMethodEdDSA, edPriv, "", claims), true},
		{"HS256 with the Ed25519 PEM as secret", &JWTConfig{PublicKey: edFile}, sign(t, jwt.SigningMethodHS256, publicPEM(t, edPub), "", claims), false},
		{"HS384 with a secret", &JWTConfig{Secret: "s3cret"}, sign(t, jwt.SigningMethodHS384, []byte("s3cret"), "", claims), true},
		{"HS512 outside the allow-list", &JWTConfig{Secret: "s3cret", Algorithms: []string{"HS256"}}, sign(t, jwt.SigningMethodHS512, []byte("s3cret"), "", claims), false},
		{"RS256 with only a secret", &JWTConfig{Secret: "s3cret"}, sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claims), false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			j := provisionJWT(t, c.config)
			if got := j.verify(c.token) != nil; got != c.ok {
				t.Errorf("verified = %v, want %v", got, c.ok)
			}
		})
	}
}

func TestJWTTokenSources(t *testing.T) {
	useJWTClock(t)
	tok := sign(t, jwt.SigningMethodHS256, []byte("k"), "", claimsAt("alice", "free"))
	cases := []struct {
		name   string
		config *JWTConfig
		set    func(r *http.Request)
		ok     bool
	}{
		{"bearer by default", &JWTConfig{}, func(r *http.Request) { r.Header.Set("Authorization", "bearer "+tok) }, true},
		{"not basic auth", &JWTConfig{}, func(r *http.Request) { r.Header.Set("Authorization", "Basic "+tok) }, false},
		{"header", &JWTConfig{FromHeader: "X-Token"}, func(r *http.Request) { r.Header.Set("X-Token", tok) }, true},
		{"header ignores Authorization", &JWTConfig{FromHeader: "X-Token"}, func(r *http.Request) { r.Header.Set("Authorization", "Bearer "+tok) }, false},
		{"cookie", &JWTConfig{FromCookie: "session"}, func(r *http.Request) { r.Header.Set("Cookie", "a=b; session="+tok) }, true},
		{"query", &JWTConfig{FromQuery: "access_token"}, func(r *http.Request) { r.URL.RawQuery = "access_token=" + tok }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.config.Secret = "k"
			k := &JWTKeyer{Claim: "sub"}
			k.useJWT(provisionJWT(t, c.config))
			if err := k.Provision(caddy.Context{}); err != nil {
				t.Fatal(err)
			}
			r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
			c.set(r)
			v, ok := k.Key(r, nil)
			if ok != c.ok || ok && string(v) != "alice" {
				t.Errorf("Key = %q, %v; want alice: %v", v, ok, c.ok)
			}
		})
	}
}

func TestJWTClaimsAsStrings(t *testing.T) {
	useJWTClock(t)
	j := provisionJWT(t, &JWTConfig{Secret: "k"})
	raw := `{"sub":"u1","n":1e3,"f":1.5,"big":12345678901234567890,"ok":true,` +
		`"roles":["a",2,false,{"x":1}],"org":{"id":"acme","tier":{"name":"gold"}},"exp":` + strconv.FormatInt(jwtT0.Add(time.Hour).Unix(), 10) + `}`
	var mc jwt.MapClaims
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&mc); err != nil {
		t.Fatal(err)
	}
	c := j.verify(sign(t, jwt.SigningMethodHS256, []byte("k"), "", mc))
	if c == nil {
		t.Fatal("token did not verify")
	}
	for name, want := range map[string][]string{
		"sub":           {"u1"},
		"n":             {"1000"},
		"f":             {"1.5"},
		"big":           {"12345678901234567890"},
		"ok":            {"true"},
		"roles":         {"a", "2", "false"},
		"org.id":        {"acme"},
		"org.tier.name": {"gold"},
		"org":           nil,
		"missing":       nil,
	} {
		if got := c.Claim(name); strings.Join(got, "|") != strings.Join(want, "|") {
			t.Errorf("Claim(%q) = %q, want %q", name, got, want)
		}
	}
}

func TestVerifiedJWTIsCachedUntilItExpires(t *testing.T) {
	clock := useJWTClock(t)
	j := provisionJWT(t, &JWTConfig{Secret: "k"})
	c := claimsAt("alice", "free")
	c["exp"] = jwtT0.Add(10 * time.Second).Unix()
	tok := sign(t, jwt.SigningMethodHS256, []byte("k"), "", c)
	if j.verify(tok) == nil {
		t.Fatal("token did not verify")
	}
	// A cached verdict needs no key: with the secret gone, it still holds.
	j.secret = []byte("another")
	if j.verify(tok) == nil {
		t.Error("a hot token was verified again instead of cached")
	}
	clock.advance(11 * time.Second)
	if j.verify(tok) != nil {
		t.Error("a cached token outlived its exp")
	}
}

func TestJWTVerdictCacheIsBounded(t *testing.T) {
	useJWTClock(t)
	j := provisionJWT(t, &JWTConfig{Secret: "k"})
	for i := range 3 * 16 * maxCachedPerShard {
		j.verify("forged." + strconv.Itoa(i) + ".token")
	}
	total := 0
	for i := range j.cache.shards {
		total += len(j.cache.shards[i].m)
	}
	if total > 16*maxCachedPerShard {
		t.Errorf("cache holds %d verdicts, want at most %d", total, 16*maxCachedPerShard)
	}
}

func TestJWTCaddyfile(t *testing.T) {
	t.Parallel()
	site := func(block string) string {
		return "http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey jwt sub\n" + block + "\t}\n\trespond ok\n}\n"
	}
	t.Run("full block", func(t *testing.T) {
		cfg, err := adaptCaddyfile(site(`		jwt {
			from cookie session
			secret {env.SECRET}
			jwks https://127.0.0.1/jwks.json
			jwks_refresh 1m
			algorithms HS256 RS256
			issuer https://issuer.test
			audience api
			leeway 30s
		}
`))
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{
			`"jwt":{"algorithms":["HS256","RS256"],"audience":"api","from_cookie":"session","issuer":"https://issuer.test","jwks":"https://127.0.0.1/jwks.json","jwks_refresh":60000000000,"leeway":30000000000,"secret":"{env.SECRET}"}`,
			`"keys":[{"claim":"sub","keyer":"jwt"}]`,
		} {
			if !strings.Contains(string(cfg), want) {
				t.Errorf("adapted config lacks %s:\n%s", want, cfg)
			}
		}
	})
	for _, c := range []struct{ name, block, want string }{
		{"no key", "\t\tjwt {\n\t\t\tissuer x\n\t\t}\n", "give secret, public_key or jwks, at Caddyfile:4"},
		{"unknown algorithm", "\t\tjwt {\n\t\t\tsecret k\n\t\t\talgorithms HS256 XS999\n\t\t}\n", `algorithm "XS999"`},
		{"none", "\t\tjwt {\n\t\t\tsecret k\n\t\t\talgorithms none\n\t\t}\n", `algorithm "none"`},
		{"HMAC algorithm without a secret", "\t\tjwt {\n\t\t\tjwks /tmp/x.json\n\t\t\talgorithms HS256\n\t\t}\n", "HS256 needs a secret"},
		{"bad leeway", "\t\tjwt {\n\t\t\tsecret k\n\t\t\tleeway soon\n\t\t}\n", `leeway "soon": want a duration such as 30s, at Caddyfile:6`},
		{"negative leeway", "\t\tjwt {\n\t\t\tsecret k\n\t\t\tleeway -1s\n\t\t}\n", "must not be negative"},
		{"http jwks", "\t\tjwt {\n\t\t\tjwks http://127.0.0.1/jwks.json\n\t\t}\n", "https"},
		{"bad from", "\t\tjwt {\n\t\t\tsecret k\n\t\t\tfrom body token\n\t\t}\n", `from "body"`},
		{"two sources", "\t\tjwt {\n\t\t\tsecret k\n\t\t\tfrom header X-A\n\t\t\tfrom query a\n\t\t}\n", "one of from"},
		{"unknown subdirective", "\t\tjwt {\n\t\t\tsecret k\n\t\t\tsecrets k\n\t\t}\n", `unknown subdirective "secrets"`},
		{"twice", "\t\tjwt {\n\t\t\tsecret k\n\t\t}\n\t\tjwt {\n\t\t\tsecret k\n\t\t}\n", "given twice"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := adaptCaddyfile(site(c.block))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one containing %q", err, c.want)
			}
		})
	}
	t.Run("key jwt without a claim", func(t *testing.T) {
		_, err := adaptCaddyfile("http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey jwt\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), "claim name") {
			t.Errorf("error %v, want one asking for a claim name", err)
		}
	})
}

func TestJWTProvisionErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := writeFile(t, dir, "bad.pem", []byte("hello"))
	rsaFile := writeFile(t, dir, "rsa.pem", publicPEM(t, &testRSAKey().PublicKey))
	emptyJWKS := writeFile(t, dir, "jwks.json", []byte(`{"keys":[{"kty":"oct","k":"c2VjcmV0"}]}`))
	for _, c := range []struct {
		name   string
		config *JWTConfig
		want   string
	}{
		{"no key", &JWTConfig{}, "no key"},
		{"empty secret once expanded", &JWTConfig{Secret: "{env.RL_TEST_UNSET_SECRET}"}, "empty"},
		{"missing public key file", &JWTConfig{PublicKey: filepath.Join(dir, "nope.pem")}, "public_key"},
		{"not PEM", &JWTConfig{PublicKey: notPEM}, "no PEM block"},
		{"algorithm unfit for the key", &JWTConfig{PublicKey: rsaFile, Algorithms: []string{"ES256"}}, "does not fit"},
		{"JWKS with no signing key", &JWTConfig{JWKS: emptyJWKS}, "no usable signing key"},
		{"missing JWKS file", &JWTConfig{JWKS: filepath.Join(dir, "nope.json")}, "jwks"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			err := c.config.provision(ctx)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("error %v, want one containing %q", err, c.want)
			}
		})
	}
}

// FuzzJWTKeyer checks that the jwt keyer never panics and never yields a
// value from a token that does not verify on its own.
func FuzzJWTKeyer(f *testing.F) {
	secret := []byte("fuzz secret")
	useJWTClock(f)
	f.Add(sign(f, jwt.SigningMethodHS256, secret, "", claimsAt("alice", "enterprise")))
	f.Add(sign(f, jwt.SigningMethodNone, jwt.UnsafeAllowNoneSignatureType, "", claimsAt("alice", "enterprise")))
	f.Add(sign(f, jwt.SigningMethodHS256, []byte("wrong"), "", claimsAt("alice", "enterprise")))
	f.Add("a.b.c")
	j := provisionJWT(f, &JWTConfig{Secret: string(secret)})
	k := &JWTKeyer{Claim: "sub"}
	if err := k.Provision(caddy.Context{}); err != nil {
		f.Fatal(err)
	}
	k.useJWT(j)
	f.Fuzz(func(t *testing.T, token string) {
		r := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
		r.Header["Authorization"] = []string{"Bearer " + token}
		v, ok := k.Key(r, nil)
		if !ok {
			return
		}
		tok, err := jwt.Parse(strings.TrimSpace(token), func(*jwt.Token) (any, error) { return secret, nil },
			jwt.WithValidMethods([]string{"HS256", "HS384", "HS512"}), jwt.WithTimeFunc(jwtClock))
		if err != nil || !tok.Valid {
			t.Fatalf("keyer yielded %q from a token that does not verify: %v", v, err)
		}
		if len(token) > maxTokenSize {
			t.Fatalf("keyer verified a %d-byte token", len(token))
		}
	})
}

func TestTokenWithoutExpYieldsNothingWhenExpIsRequired(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	noExp := claimsAt("alice", "enterprise")
	delete(noExp, "exp")
	withExp := sign(t, jwt.SigningMethodHS256, []byte("k"), "", claimsAt("alice", "enterprise"))
	withoutExp := sign(t, jwt.SigningMethodHS256, []byte("k"), "", noExp)
	verified := "enterprise " + keyIDOf("jwt/sub", "alice") + " enterprise"
	anonymous := "default " + keyIDOf("ip/32/64", "127.0.0.2") + " "
	for _, c := range []struct {
		name    string
		require string
		token   string
		want    string
	}{
		{"exp required, token with exp", "require exp", withExp, verified},
		{"exp required, token without exp", "require exp", withoutExp, anonymous},
		{"exp not required, token without exp", "", withoutExp, verified},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serve(t, `
	rate_limit 100 1/s {
		key jwt sub
		jwt {
			secret k
			`+c.require+`
		}
		tier enterprise 100 1/s {
			claim plan enterprise
		}
	}
	respond "{http.rate_limit.tier} {http.rate_limit.key_id} {http.rate_limit.claim.plan}"`)
			if r := s.from("127.0.0.2", "/", bearer(c.token)); r.status != 200 || r.body != c.want {
				t.Errorf("%d %q, want 200 %q", r.status, r.body, c.want)
			}
		})
	}
}

func TestJWTRequireCaddyfile(t *testing.T) {
	t.Parallel()
	site := func(require string) string {
		return "http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey jwt sub\n\t\tjwt {\n\t\t\tsecret k\n\t\t\t" + require + "\n\t\t}\n\t}\n\trespond ok\n}\n"
	}
	cfg, err := adaptCaddyfile(site("require exp"))
	if err != nil || !strings.Contains(string(cfg), `"jwt":{"require":["exp"],"secret":"k"}`) {
		t.Errorf("adapted %s, %v; want a jwt with \"require\":[\"exp\"]", cfg, err)
	}
	if _, err := adaptCaddyfile(site("require")); err == nil || !strings.Contains(err.Error(), "jwt require: want one or more claims") {
		t.Errorf("error %v, want one asking for claims", err)
	}
}

// TestRequestJWTIsVerifiedOnceForKeyersTiersAndPlaceholders: a request's
// token is verified once, whatever reads its claims (keyers, a claim tier,
// the claim placeholders), and not at all when nothing does. The handler
// runs alone, counting verifications through its JWT config, and the
// origin answers the body's placeholders as Caddy's respond would.
func TestRequestJWTIsVerifiedOnceForKeyersTiersAndPlaceholders(t *testing.T) {
	t.Parallel()
	genuine := sign(t, jwt.SigningMethodHS256, []byte("k"), "", claimsAt("alice", "enterprise"))
	forged := sign(t, jwt.SigningMethodHS256, []byte("guess"), "", claimsAt("alice", "enterprise"))
	const claimTier = `
		tier enterprise 100 1/s {
			claim plan enterprise
		}`
	for i, c := range []struct {
		name, keys, tiers, body, token, want string
		verifications                        int64
	}{
		{"jwt keyer, claim tier and claim placeholder", "key jwt sub", claimTier, "{http.rate_limit.tier} {http.rate_limit.claim.plan}", genuine, "enterprise enterprise", 1},
		{"two jwt keyers, the first finding nothing", "key jwt email\n\t\tkey jwt sub", claimTier, "{http.rate_limit.tier} {http.rate_limit.claim.sub}", genuine, "enterprise alice", 1},
		{"forged token", "key jwt sub", claimTier, "{http.rate_limit.tier} {http.rate_limit.claim.plan}", forged, "default ", 1},
		{"claim tier only", "key header X-Key", claimTier, "{http.rate_limit.tier}", genuine, "enterprise", 1},
		{"claim placeholder only", "key header X-Key", "", "{http.rate_limit.claim.sub}", genuine, "alice", 1},
		{"nothing reads claims", "key header X-Key", "", "{http.rate_limit.tier}", genuine, "default", 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			cfg, err := adaptSite(fmt.Sprintf(`rate_limit 100 1/s {
		name jwt_verified_once_%d
		%s
		jwt {
			secret k
		}%s
	}`, i, c.keys, c.tiers))
			if err != nil {
				t.Fatal(err)
			}
			raw, err := json.Marshal(handlerJSON(t, cfg))
			if err != nil {
				t.Fatal(err)
			}
			var n atomic.Int64
			h, done := provisionedHandlerWith(t, string(raw), func(h *Handler) {
				h.clocks = newFakeClock().clocks()
				h.JWT.onVerify = func() { n.Add(1) }
				h.JWT.now = jwtT0Clock
			})
			defer done()
			r := benchRequest("127.0.0.2")
			r.Header.Set("Authorization", "Bearer "+c.token)
			respond := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				_, err := io.WriteString(w, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer).ReplaceAll(c.body, ""))
				return err
			})
			w, err := serveOne(h, r, respond)
			if w.Code != 200 || w.Body.String() != c.want {
				t.Errorf("%d %q (%v), want 200 %q", w.Code, w.Body.String(), err, c.want)
			}
			if got := n.Load(); got != c.verifications {
				t.Errorf("%d verifications, want %d", got, c.verifications)
			}
		})
	}
}

// jwtT0Clock is the time jwtT0, for a JWT config provisioned alone.
func jwtT0Clock() time.Time { return jwtT0 }

// A token given twice names nobody: PHP and Rack read the last of two
// query parameters where Go reads the first, so a keyer that reads one
// while the origin serves the other puts one account's requests on other
// identities' buckets.
func TestATokenGivenTwiceNamesNobody(t *testing.T) {
	useFakeClock(t)
	useJWTClock(t)
	t.Setenv("RL_TEST_JWT_SECRET", "correct horse battery staple")
	secret := []byte("correct horse battery staple")
	main := sign(t, jwt.SigningMethodHS256, secret, "", claimsAt("main", "free"))
	for _, c := range []struct {
		name, from string
		send       func(other string) (path string, headers []string)
	}{
		{"in the query", "query token", func(other string) (string, []string) {
			return "/?token=" + other + "&token=" + main, nil
		}},
		{"in a header", "header X-Token", func(other string) (string, []string) {
			return "/", []string{"X-Token: " + other, "X-Token: " + main}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serve(t, fmt.Sprintf(`
	rate_limit 3 1/h {
		key jwt sub
		jwt {
			secret {env.RL_TEST_JWT_SECRET}
			algorithms HS256
			from %s
		}
		no_key deny
	}
	respond "ok"`, c.from))
			passed := 0
			for i := range 10 {
				path, headers := c.send(sign(t, jwt.SigningMethodHS256, secret, "", claimsAt("throwaway-"+strconv.Itoa(i), "free")))
				if s.do(http.MethodGet, path, "", headers...).status == http.StatusOK {
					passed++
				}
			}
			if passed > 3 {
				t.Errorf("%d of 10 requests with the token given twice passed, want at most one bucket's 3", passed)
			}
		})
	}
}
