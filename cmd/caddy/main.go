// Command caddy is standard Caddy with the rate_limit plugin compiled in, so
// that `go run ./cmd/caddy run --config example.Caddyfile` works from a checkout.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	// The standard modules, as the official Caddy build has them.
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/bramsley/caddy-ratelimit"
)

func main() {
	caddycmd.Main()
}
