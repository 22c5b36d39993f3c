package ratelimit

import (
	"context"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/golang-jwt/jwt/v5"
	"go.step.sm/crypto/jose"
)

// jwksOf writes a JWKS document for Ed25519 keys by kid.
func jwksOf(keys map[string]ed25519.PublicKey) []byte {
	type key struct {
		Kty string `json:"kty"`
		Crv string `json:"crv"`
		X   string `json:"x"`
		Kid string `json:"kid"`
		Use string `json:"use"`
		Alg string `json:"alg"`
	}
	doc := struct {
		Keys []key `json:"keys"`
	}{Keys: []key{}}
	for kid, pub := range keys {
		doc.Keys = append(doc.Keys, key{"OKP", "Ed25519", base64.RawURLEncoding.EncodeToString(pub), kid, "sig", "EdDSA"})
	}
	b, _ := json.Marshal(doc)
	return b
}

func newEd25519(t testing.TB) (ed25519.PublicKey, ed25519.PrivateKey) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return pub, priv
}

// eventually polls cond for up to 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// allowFastJWKSRefresh lets jwks_refresh go below its one-minute floor
// until the test ends, so that refreshes can be watched happening.
func allowFastJWKSRefresh(t testing.TB) {
	old := jwksMinRefresh
	jwksMinRefresh = time.Millisecond
	t.Cleanup(func() { jwksMinRefresh = old })
}

func TestJWKSKeyRotation(t *testing.T) {
	useJWTClock(t)
	allowFastJWKSRefresh(t)
	dir := t.TempDir()
	pub1, priv1 := newEd25519(t)
	pub2, priv2 := newEd25519(t)
	jwksFile := writeFile(t, dir, "jwks.json", jwksOf(map[string]ed25519.PublicKey{"one": pub1}))
	s := serve(t, fmt.Sprintf(`
	rate_limit 1000 100/s {
		key jwt sub
		jwt {
			jwks %s
			jwks_refresh 50ms
		}
	}
	respond "{http.rate_limit.key_id}"`, jwksFile))

	tok1 := sign(t, jwt.SigningMethodEdDSA, priv1, "one", claimsAt("old", "free"))
	tok2 := sign(t, jwt.SigningMethodEdDSA, priv2, "two", claimsAt("new", "free"))
	verified := func(tok, sub string) bool {
		return s.from("127.0.0.2", "/", bearer(tok)).body == keyIDOf("jwt/sub", sub)
	}
	if !verified(tok1, "old") {
		t.Fatal("a token signed with the JWKS key does not verify")
	}
	if verified(tok2, "new") {
		t.Fatal("a token signed with a key not yet in the JWKS verifies")
	}

	writeFile(t, dir, "jwks.json", jwksOf(map[string]ed25519.PublicKey{"one": pub1, "two": pub2}))
	eventually(t, "the new key verifies", func() bool { return verified(tok2, "new") })
	if !verified(tok1, "old") {
		t.Error("the old key stopped verifying while still in the JWKS")
	}

	writeFile(t, dir, "jwks.json", jwksOf(map[string]ed25519.PublicKey{"two": pub2}))
	eventually(t, "the removed key stops verifying", func() bool { return !verified(tok1, "old") })

	// A broken JWKS keeps the last good keys.
	writeFile(t, dir, "jwks.json", []byte("{not json"))
	time.Sleep(200 * time.Millisecond) // several refresh periods
	if !verified(tok2, "new") {
		t.Error("a broken JWKS dropped the last good keys")
	}
}

func TestJWKSOverHTTPSRefreshesAndKeepsKeysWhenTheFetchFails(t *testing.T) {
	useJWTClock(t)
	allowFastJWKSRefresh(t)
	pub1, priv1 := newEd25519(t)
	pub2, priv2 := newEd25519(t)
	var doc atomic.Pointer[[]byte]
	var fetches atomic.Int32
	var failing atomic.Bool
	first := jwksOf(map[string]ed25519.PublicKey{"one": pub1})
	doc.Store(&first)
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fetches.Add(1)
		if failing.Load() {
			http.Error(w, "down", http.StatusInternalServerError)
			return
		}
		w.Write(*doc.Load())
	}))
	defer srv.Close()
	old := jwksHTTPClient
	jwksHTTPClient = srv.Client()
	t.Cleanup(func() { jwksHTTPClient = old })

	j := provisionJWT(t, &JWTConfig{JWKS: srv.URL + "/jwks.json", JWKSRefresh: caddy.Duration(30 * time.Millisecond)})
	tok1 := sign(t, jwt.SigningMethodEdDSA, priv1, "one", claimsAt("old", "free"))
	tok2 := sign(t, jwt.SigningMethodEdDSA, priv2, "two", claimsAt("new", "free"))
	if j.verify(tok1) == nil {
		t.Fatal("a token signed with the fetched key does not verify")
	}

	both := jwksOf(map[string]ed25519.PublicKey{"one": pub1, "two": pub2})
	doc.Store(&both)
	eventually(t, "the new key is fetched", func() bool { return j.verify(tok2) != nil })

	failing.Store(true)
	n := fetches.Load()
	eventually(t, "failed fetches happen", func() bool { return fetches.Load() >= n+3 })
	if j.verify(tok1) == nil || j.verify(tok2) == nil {
		t.Error("failed fetches dropped the last good keys")
	}
}

func TestUnreachableJWKSDoesNotFailProvision(t *testing.T) {
	useJWTClock(t)
	srv := httptest.NewTLSServer(http.NotFoundHandler())
	url := srv.URL + "/jwks.json"
	srv.Close()
	oldWait := jwksFirstWait
	jwksFirstWait = 50 * time.Millisecond
	t.Cleanup(func() { jwksFirstWait = oldWait })

	start := time.Now()
	j := provisionJWT(t, &JWTConfig{JWKS: url})
	if took := time.Since(start); took > time.Second {
		t.Errorf("provision waited %v for an unreachable JWKS", took)
	}
	_, priv := newEd25519(t)
	if j.verify(sign(t, jwt.SigningMethodEdDSA, priv, "one", claimsAt("x", "free"))) != nil {
		t.Error("a token verified with no keys fetched")
	}
}

func TestJWKSRedirectsAreRefused(t *testing.T) {
	useJWTClock(t)
	pub, priv := newEd25519(t)
	doc := jwksOf(map[string]ed25519.PublicKey{"one": pub})
	var served atomic.Int32
	serveJWKS := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		served.Add(1)
		w.Write(doc)
	})
	// Every httptest TLS server has the same certificate, so the client of
	// one trusts them all: only the redirect refusal stops the fetch.
	otherHost := httptest.NewTLSServer(serveJWKS)
	defer otherHost.Close()
	plain := httptest.NewServer(serveJWKS)
	defer plain.Close()
	redirector := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if to := r.URL.Query().Get("to"); to != "" {
			http.Redirect(w, r, to, http.StatusFound)
			return
		}
		serveJWKS(w, r)
	}))
	defer redirector.Close()
	old := jwksHTTPClient
	jwksHTTPClient = redirector.Client()
	t.Cleanup(func() { jwksHTTPClient = old })
	oldWait := jwksFirstWait
	jwksFirstWait = time.Second
	t.Cleanup(func() { jwksFirstWait = oldWait })

	tok := sign(t, jwt.SigningMethodEdDSA, priv, "one", claimsAt("alice", "free"))
	for _, c := range []struct{ name, target string }{
		{"https to http", plain.URL + "/jwks.json"},
		{"to another host", otherHost.URL + "/jwks.json"},
		{"within the same host", redirector.URL + "/jwks.json"},
	} {
		t.Run(c.name, func(t *testing.T) {
			served.Store(0)
			j := provisionJWT(t, &JWTConfig{JWKS: redirector.URL + "/old?to=" + url.QueryEscape(c.target)})
			if j.verify(tok) != nil {
				t.Error("a token verified with keys fetched through a redirect")
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			err := j.loadJWKS(ctx)
			if !errors.Is(err, errJWKSRedirect) || !strings.Contains(err.Error(), c.target) {
				t.Errorf("fetch error %v, want one saying it refused the redirect to %s", err, c.target)
			}
			if n := served.Load(); n != 0 {
				t.Errorf("the redirect's target was fetched %d times, want 0", n)
			}
		})
	}
}

func TestJWKSRefreshUnderAMinuteIsAnError(t *testing.T) {
	t.Parallel()
	jwksFile := writeFile(t, t.TempDir(), "jwks.json", jwksOf(map[string]ed25519.PublicKey{"one": func() ed25519.PublicKey { p, _ := newEd25519(t); return p }()}))
	site := func(refresh string) string {
		return "http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey jwt sub\n\t\tjwt {\n\t\t\tjwks " + jwksFile +
			"\n\t\t\tjwks_refresh " + refresh + "\n\t\t}\n\t}\n\trespond ok\n}\n"
	}
	for _, c := range []struct {
		refresh string
		want    string // "" for no error
	}{
		{"50ms", "jwt: jwks_refresh 50ms: must be at least 1m, at Caddyfile:4"},
		{"59s", "jwt: jwks_refresh 59s: must be at least 1m, at Caddyfile:4"},
		{"1m", ""},
		{"1h", ""},
	} {
		t.Run("caddyfile "+c.refresh, func(t *testing.T) {
			_, err := adaptCaddyfile(site(c.refresh))
			if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
				t.Errorf("error %v, want %q", err, c.want)
			}
		})
		t.Run("json "+c.refresh, func(t *testing.T) {
			d, err := caddy.ParseDuration(c.refresh)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			err = (&JWTConfig{JWKS: jwksFile, JWKSRefresh: caddy.Duration(d)}).provision(ctx)
			want, _, _ := strings.Cut(c.want, ", at")
			if want == "" && err != nil || want != "" && (err == nil || !strings.Contains(err.Error(), want)) {
				t.Errorf("error %v, want %q", err, want)
			}
		})
	}
}

// TestJWTWithoutKidIsTriedOnlyAgainstKeysOfItsFamily: a token with no kid
// may be checked against each key of its algorithm's type, never against a
// key of another type, which would cost an attempt and prove nothing.
func TestJWTWithoutKidIsTriedOnlyAgainstKeysOfItsFamily(t *testing.T) {
	useJWTClock(t)
	ec256, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ec384, err := ecdsa.GenerateKey(elliptic.P384(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	edPub, edPriv := newEd25519(t)
	var keys []jose.JSONWebKey
	for kid, pub := range map[string]any{"rsa1": &testRSAKey().PublicKey, "rsa2": &otherRSAKey().PublicKey, "ec256": &ec256.PublicKey, "ec384": &ec384.PublicKey, "ed": edPub} {
		keys = append(keys, jose.JSONWebKey{Key: pub, KeyID: kid, Use: "sig"})
	}
	doc, err := json.Marshal(jose.JSONWebKeySet{Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	jwksFile := writeFile(t, t.TempDir(), "jwks.json", doc)
	j := provisionJWT(t, &JWTConfig{Secret: "k", JWKS: jwksFile})
	claims := claimsAt("alice", "free")

	for _, c := range []struct {
		name  string
		token string
		want  string // the types of the keys offered, in JWKS order
	}{
		{"RS256", sign(t, jwt.SigningMethodRS256, testRSAKey(), "", claims), "rsa rsa"},
		{"PS384", sign(t, jwt.SigningMethodPS384, testRSAKey(), "", claims), "rsa rsa"},
		{"ES256", sign(t, jwt.SigningMethodES256, ec256, "", claims), "P-256"},
		{"ES384", sign(t, jwt.SigningMethodES384, ec384, "", claims), "P-384"},
		{"EdDSA", sign(t, jwt.SigningMethodEdDSA, edPriv, "", claims), "ed25519"},
		{"HS256", sign(t, jwt.SigningMethodHS256, []byte("k"), "", claims), "hmac"},
	} {
		t.Run(c.name, func(t *testing.T) {
			tok, _, err := jwt.NewParser().ParseUnverified(c.token, jwt.MapClaims{})
			if err != nil {
				t.Fatal(err)
			}
			key, err := j.keyFor(tok)
			if err != nil {
				t.Fatal(err)
			}
			var offered []any
			if set, ok := key.(jwt.VerificationKeySet); ok {
				for _, k := range set.Keys {
					offered = append(offered, k)
				}
			} else {
				offered = []any{key}
			}
			var types []string
			for _, k := range offered {
				switch k := k.(type) {
				case *rsa.PublicKey:
					types = append(types, "rsa")
				case *ecdsa.PublicKey:
					types = append(types, k.Curve.Params().Name)
				case ed25519.PublicKey:
					types = append(types, "ed25519")
				case []byte:
					types = append(types, "hmac")
				default:
					types = append(types, fmt.Sprintf("%T", k))
				}
			}
			if got := strings.Join(types, " "); got != c.want {
				t.Errorf("keys offered: %s, want %s", got, c.want)
			}
			if j.verify(c.token) == nil {
				t.Error("the token does not verify with the key of its family")
			}
		})
	}
}
