package ratelimit

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.step.sm/crypto/jose"
	"go.uber.org/zap"
)

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
