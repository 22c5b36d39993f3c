package ratelimit

import (
	"net/http"

	"github.com/golang-jwt/jwt/v5"
)

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

// Claims are the claims of a verified JWT, as strings. A nil Claims has none.
type Claims interface {
	// Claim returns the values of a claim: one for a string or number, each
	// element for an array.
	Claim(name string) []string
}

// claimsHoldAll reports whether, for every claim named in want, the
// verified claims have one of the values listed.
func claimsHoldAll(c Claims, want map[string][]string) bool {
	if c == nil {
		return false
	}
	for name, values := range want {
		if !anyEqual(c.Claim(name), values) {
			return false
		}
	}
	return true
}

func anyEqual(have, want []string) bool {
	for _, h := range have {
		for _, w := range want {
			if h == w {
				return true
			}
		}
	}
	return false
}
