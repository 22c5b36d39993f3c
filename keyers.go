package ratelimit

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(IPKeyer{})
	caddy.RegisterModule(HeaderKeyer{})
	caddy.RegisterModule(CookieKeyer{})
	caddy.RegisterModule(PlaceholderKeyer{})
	caddy.RegisterModule(JWTKeyer{})
}

// A Keyer names the client of a request. Keyers are guest modules in the
// namespace http.handlers.rate_limit.keys; the handler tries them in order
// and the first that yields a non-empty value names the client.
type Keyer interface {
	// Kind is the keyer's module name (ip, header, cookie, placeholder,
	// jwt, form, json), which tiers may test with `keyer <kind>`.
	Kind() string
	// ID names the keyer and what it reads, such as "header/X-API-Key" or
	// "ip/32/64". It is part of the bucket's name, so two keyers never
	// share buckets.
	ID() string
	// Key appends the client's identity to buf and reports whether it found
	// one. It must not keep buf. A keyer that reads the body must leave it
	// whole for later handlers.
	Key(r *http.Request, buf []byte) ([]byte, bool)
}

// keyerModulePrefix is the namespace of keyer modules.
const keyerModulePrefix = "http.handlers.rate_limit.keys."

// IPKeyer names the client by its IP address, as Caddy resolved it: the
// connection's address, or the forwarded one when the connection comes from
// one of the server's trusted_proxies. Addresses are grouped by prefix.
type IPKeyer struct {
	// IPv4Prefix groups IPv4 clients by this many leading bits. Default 32.
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`
	// IPv6Prefix groups IPv6 clients by this many leading bits. Default 64,
	// since one subscriber usually holds a whole /64.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	id string
}

// CaddyModule returns the Caddy module information.
func (IPKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "ip",
		New: func() caddy.Module { return new(IPKeyer) },
	}
}

// Provision applies the defaults.
func (k *IPKeyer) Provision(caddy.Context) error {
	if k.IPv4Prefix == 0 {
		k.IPv4Prefix = 32
	}
	if k.IPv6Prefix == 0 {
		k.IPv6Prefix = 64
	}
	k.id = "ip/" + strconv.Itoa(k.IPv4Prefix) + "/" + strconv.Itoa(k.IPv6Prefix)
	return k.Validate()
}

// Validate checks the prefixes.
func (k *IPKeyer) Validate() error {
	if k.IPv4Prefix < 0 || k.IPv4Prefix > 32 {
		return fmt.Errorf("key ip: IPv4 prefix %d: must be from 1 to 32", k.IPv4Prefix)
	}
	if k.IPv6Prefix < 0 || k.IPv6Prefix > 128 {
		return fmt.Errorf("key ip: IPv6 prefix %d: must be from 1 to 128", k.IPv6Prefix)
	}
	return nil
}

// Kind implements Keyer.
func (*IPKeyer) Kind() string { return "ip" }

// ID implements Keyer.
func (k *IPKeyer) ID() string { return k.id }

// Key implements Keyer.
func (k *IPKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	addr, ok := clientAddr(r)
	if !ok {
		return buf, false
	}
	return k.appendAddr(buf, addr)
}

// fallbackKey names a client that no keyer named: by its IP address, or,
// when the connection has none that parses (a listener wrapper or another
// module set an odd remote address), by the whole remote address, so that
// such clients do not all share one bucket. Unix sockets, where every
// client's remote address is "@", are refused at provision instead (see
// checkListeners).
func (k *IPKeyer) fallbackKey(r *http.Request, buf []byte) []byte {
	if v, ok := k.Key(r, buf); ok {
		return v
	}
	return append(buf, r.RemoteAddr...)
}

// appendAddr appends the address's network, by the keyer's prefixes.
func (k *IPKeyer) appendAddr(buf []byte, addr netip.Addr) ([]byte, bool) {
	addr = addr.Unmap().WithZone("")
	bits := k.IPv6Prefix
	if addr.Is4() {
		bits = k.IPv4Prefix
	}
	prefix, err := addr.Prefix(bits)
	if err != nil {
		return buf, false
	}
	return prefix.Addr().AppendTo(buf), true
}

// clientAddr is Caddy's client_ip for the request, which honours the
// server's trusted_proxies, or else the connection's peer. A raw
// X-Forwarded-For is never read here: anyone can send one.
func clientAddr(r *http.Request) (netip.Addr, bool) {
	s, _ := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string)
	if s == "" {
		s = r.RemoteAddr
		if host, _, err := net.SplitHostPort(s); err == nil {
			s = host
		}
	}
	addr, err := netip.ParseAddr(s)
	return addr, err == nil
}

// UnmarshalCaddyfile reads `ip [<v4 prefix> [<v6 prefix>]]`. A prefix may be
// written with or without its slash: 24 or /24.
func (k *IPKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	args := d.RemainingArgs()
	if len(args) > 2 {
		return d.ArgErr()
	}
	for i, arg := range args {
		n, err := strconv.Atoi(strings.TrimPrefix(arg, "/"))
		if err != nil || n < 1 {
			return d.Errf("key ip: prefix %q: want a number of bits such as /24", arg)
		}
		if i == 0 {
			k.IPv4Prefix = n
		} else {
			k.IPv6Prefix = n
		}
	}
	if err := k.Validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// HeaderKeyer names the client by a request header, such as an API key.
type HeaderKeyer struct {
	// Field is the header field to read.
	Field string `json:"field"`

	id string
}

// CaddyModule returns the Caddy module information.
func (HeaderKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "header",
		New: func() caddy.Module { return new(HeaderKeyer) },
	}
}

// Provision checks the field and canonicalises it.
func (k *HeaderKeyer) Provision(caddy.Context) error {
	if k.Field == "" {
		return fmt.Errorf("key header: a field name is required")
	}
	k.Field = textproto.CanonicalMIMEHeaderKey(k.Field)
	k.id = "header/" + k.Field
	return nil
}

// Kind implements Keyer.
func (*HeaderKeyer) Kind() string { return "header" }

// ID implements Keyer.
func (k *HeaderKeyer) ID() string { return k.id }

// Key implements Keyer.
func (k *HeaderKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	v := r.Header[k.Field]
	if len(v) == 0 || v[0] == "" {
		return buf, false
	}
	return append(buf, v[0]...), true
}

// UnmarshalCaddyfile reads `header <field>`.
func (k *HeaderKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Field) {
		return d.Err("key header: want exactly one field name")
	}
	return nil
}

// CookieKeyer names the client by a cookie, such as a session id.
type CookieKeyer struct {
	// Name is the cookie's name.
	Name string `json:"name"`

	id string
}

// CaddyModule returns the Caddy module information.
func (CookieKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "cookie",
		New: func() caddy.Module { return new(CookieKeyer) },
	}
}

// Provision checks the name.
func (k *CookieKeyer) Provision(caddy.Context) error {
	if k.Name == "" || strings.ContainsAny(k.Name, "=; \t") {
		return fmt.Errorf("key cookie: name %q: want a cookie name", k.Name)
	}
	k.id = "cookie/" + k.Name
	return nil
}

// Kind implements Keyer.
func (*CookieKeyer) Kind() string { return "cookie" }

// ID implements Keyer.
func (k *CookieKeyer) ID() string { return k.id }

// Key implements Keyer. It scans the Cookie fields itself rather than
// through r.Cookie, which would parse and copy every cookie.
func (k *CookieKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	for _, line := range r.Header["Cookie"] {
		for line != "" {
			var part string
			part, line, _ = strings.Cut(line, ";")
			name, value, ok := strings.Cut(strings.TrimSpace(part), "=")
			if !ok || name != k.Name {
				continue
			}
			if len(value) >= 2 && value[0] == '"' && value[len(value)-1] == '"' {
				value = value[1 : len(value)-1]
			}
			if value == "" {
				return buf, false
			}
			return append(buf, value...), true
		}
	}
	return buf, false
}

// UnmarshalCaddyfile reads `cookie <name>`.
func (k *CookieKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Name) {
		return d.Err("key cookie: want exactly one cookie name")
	}
	return nil
}

// PlaceholderKeyer names the client by any Caddy placeholder, or a string
// of several, such as {http.auth.user.id}. Unknown placeholders read as
// empty, so a mistyped one never puts every client in one bucket.
type PlaceholderKeyer struct {
	// Value is the string to expand.
	Value string `json:"value"`

	id string
}

// CaddyModule returns the Caddy module information.
func (PlaceholderKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "placeholder",
		New: func() caddy.Module { return new(PlaceholderKeyer) },
	}
}

// Provision checks the value.
func (k *PlaceholderKeyer) Provision(caddy.Context) error {
	k.id = "placeholder/" + k.Value
	return k.Validate()
}

// Validate checks that the value can tell clients apart.
func (k *PlaceholderKeyer) Validate() error {
	if !strings.Contains(k.Value, "{") {
		return fmt.Errorf("key placeholder: %q holds no placeholder, so every client would share one bucket", k.Value)
	}
	return nil
}

// Kind implements Keyer.
func (*PlaceholderKeyer) Kind() string { return "placeholder" }

// ID implements Keyer.
func (k *PlaceholderKeyer) ID() string { return k.id }

// Key implements Keyer.
func (k *PlaceholderKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return buf, false
	}
	v := repl.ReplaceAll(k.Value, "")
	if v == "" {
		return buf, false
	}
	return append(buf, v...), true
}

// UnmarshalCaddyfile reads `placeholder <string>`.
func (k *PlaceholderKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Value) {
		return d.Err("key placeholder: want exactly one string, such as {http.auth.user.id}")
	}
	if err := k.Validate(); err != nil {
		return d.Err(err.Error())
	}
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
	_ Keyer                 = (*IPKeyer)(nil)
	_ Keyer                 = (*HeaderKeyer)(nil)
	_ Keyer                 = (*CookieKeyer)(nil)
	_ Keyer                 = (*PlaceholderKeyer)(nil)
	_ Keyer                 = (*JWTKeyer)(nil)
	_ jwtUser               = (*JWTKeyer)(nil)
	_ claimsKeyer           = (*JWTKeyer)(nil)
	_ caddy.Provisioner     = (*JWTKeyer)(nil)
	_ caddyfile.Unmarshaler = (*JWTKeyer)(nil)
	_ caddy.Provisioner     = (*IPKeyer)(nil)
	_ caddy.Provisioner     = (*HeaderKeyer)(nil)
	_ caddy.Provisioner     = (*CookieKeyer)(nil)
	_ caddy.Provisioner     = (*PlaceholderKeyer)(nil)
	_ caddyfile.Unmarshaler = (*IPKeyer)(nil)
	_ caddyfile.Unmarshaler = (*HeaderKeyer)(nil)
	_ caddyfile.Unmarshaler = (*CookieKeyer)(nil)
	_ caddyfile.Unmarshaler = (*PlaceholderKeyer)(nil)
)

// nameClient asks the keyers in order: the first that yields a value names
// the client, and is returned; when none does, the client IP does, through
// h.fallback.
func (h *Handler) nameClient(r *http.Request, d *decision) Keyer {
	value := d.value[:0]
	for _, k := range h.keyers {
		if v, ok := keyWith(k, r, value, &d.claims); ok && len(v) > 0 {
			d.bucket.Value = v
			return k
		}
	}
	d.bucket.Value = h.fallback.fallbackKey(r, value)
	return h.fallback
}
