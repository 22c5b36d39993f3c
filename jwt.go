//go:build !wip_jwt

package ratelimit

import (
	"net/http"

	"github.com/caddyserver/caddy/v2"
)

// JWTConfig verifies the request's bearer token. Only a verified token's
// claims may name a client or choose a tier.
//
// This is the seam for the JWT issue: verification is not built yet, so no
// request has claims.
type JWTConfig struct{}

// jwtUser is a keyer that reads verified claims.
type jwtUser interface {
	useJWT(*JWTConfig)
}

func (j *JWTConfig) provision(caddy.Context) error { return nil }

// claims returns the request's verified claims, or nil.
func (j *JWTConfig) claims(*http.Request) Claims { return nil }
