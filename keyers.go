package ratelimit

import (
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"unicode"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"golang.org/x/text/secure/precis"
	"golang.org/x/text/unicode/norm"
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
//
// Where parsers could disagree about who a request names (a header or a
// cookie given twice, a form field in an odd multipart part), a keyer names
// nothing, and no_key decides: otherwise an attacker sends one value for the
// keyer and another for the origin, and gets a fresh bucket per request for
// one account (docs/logins.md).
type Keyer interface {
	// Kind is the keyer's module name (ip, header, cookie, placeholder,
	// jwt, form, json), which tiers may test with `keyer <kind>`.
	Kind() string
	// ID names the keyer and what it reads, such as "header/X-API-Key" or
	// "ip/32/64". It is part of the bucket's name, so that keyers never
	// share buckets: an API key equal to a client's address is not that
	// address. The body keyers share one ID (bodyKeyerID), so that a user
	// has one bucket whatever the body's encoding.
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
// A field given twice names nobody: origins differ on which line wins.
// (Caddy itself drops names with an underscore or a dot, which CGI-style
// origins read as the hyphenated field; see its expected_underscore_headers.)
type HeaderKeyer struct {
	// Field is the header field to read.
	Field string `json:"field"`
	// Normalize maps the value by RFC 8265's UsernameCaseMapped profile
	// before it names the client; see normalizedValue.
	Normalize bool `json:"normalize,omitempty"`

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
	if len(v) != 1 {
		return buf, false
	}
	return appendValue(buf, v[0], k.Normalize)
}

// UnmarshalCaddyfile reads `header <field> [normalize]`.
func (k *HeaderKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	var ok bool
	if k.Field, k.Normalize, ok = nameAndNormalize(d.RemainingArgs()); !ok {
		return d.Err("key header: want one field name, then normalize or nothing")
	}
	return nil
}

// CookieKeyer names the client by a cookie, such as a session id. The
// cookie must be given once, in a Cookie field that parsers read alike:
// see Key.
type CookieKeyer struct {
	// Name is the cookie's name.
	Name string `json:"name"`
	// Normalize maps the value by RFC 8265's UsernameCaseMapped profile
	// before it names the client; see normalizedValue.
	Normalize bool `json:"normalize,omitempty"`

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

// Key implements Keyer. A value is percent-decoded, as Express's cookie
// parser and PHP read it, so that every spelling of one session shares its
// bucket (see cookieValue).
func (k *CookieKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	value, n, ok := scanCookies(r, k.Name)
	if !ok || n != 1 {
		return buf, false
	}
	if value, ok = cookieValue(value); !ok {
		return buf, false
	}
	return appendValue(buf, value, k.Normalize)
}

// scanCookies finds the cookie name in the request's Cookie fields, and
// returns its raw value (unquoted) and how many times it is given. It
// scans the fields itself rather than through r.Cookie, which would parse
// and copy every cookie. It reports false when another parser could read
// another value: a pair in another case or spelling (resembles), or a pair
// that is not plain RFC 6265 and mentions the name, since lenient parsers
// split on spaces and commas and decode escapes in quotes:
// `session=x, session=REAL` and `session="R\105AL"` name nobody. The
// caller decides about a cookie given twice (Python's http.cookies keeps
// the last, Go the first).
func scanCookies(r *http.Request, cookie string) (value string, n int, ok bool) {
	for _, line := range r.Header["Cookie"] {
		for line != "" {
			var pair string
			pair, line, _ = strings.Cut(line, ";")
			pair = strings.TrimSpace(pair)
			if pair == "" {
				continue
			}
			name, v, _ := strings.Cut(pair, "=")
			name, v = strings.TrimSpace(name), strings.TrimSpace(v)
			switch {
			case !isToken(name) || !isCookieValue(v):
				if mentions(pair, cookie) || resembles(name, cookie) {
					return "", 0, false
				}
			case name == cookie:
				n++
				value = v
			case resembles(name, cookie):
				return "", 0, false
			}
		}
	}
	if len(value) >= 2 && value[0] == '"' {
		value = value[1 : len(value)-1]
	}
	return value, n, true
}

// cookieValue is a cookie's value as Express's cookie parser and PHP read
// it, percent-decoded; a space (PHP reads "+" as one, Express does not) is
// read as "+", so that both parsers' spellings of one value share a key.
// A malformed escape, which one parser keeps whole and another decodes in
// part, reports false. A value without "%" is returned as it is, without
// allocating.
func cookieValue(v string) (string, bool) {
	if strings.IndexByte(v, '%') < 0 {
		return v, true
	}
	u, err := url.PathUnescape(v)
	if err != nil {
		return "", false
	}
	return strings.ReplaceAll(u, " ", "+"), true
}

// isCookieValue reports whether v is an RFC 6265 cookie-value: cookie-octets,
// perhaps in double quotes. Such a value reads the same in every parser.
func isCookieValue(v string) bool {
	if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
		v = v[1 : len(v)-1]
	}
	for i := 0; i < len(v); i++ {
		if c := v[i]; c <= ' ' || c >= 0x7f || c == '"' || c == ',' || c == ';' || c == '\\' {
			return false
		}
	}
	return true
}

// isToken reports whether s is an RFC 9110 token, such as a cookie's or a
// form field's name.
func isToken(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// UnmarshalCaddyfile reads `cookie <name> [normalize]`.
func (k *CookieKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	var ok bool
	if k.Name, k.Normalize, ok = nameAndNormalize(d.RemainingArgs()); !ok {
		return d.Err("key cookie: want one cookie name, then normalize or nothing")
	}
	return nil
}

// nameAndNormalize reads the arguments `<name> [normalize]` of a keyer.
func nameAndNormalize(args []string) (name string, normalize, ok bool) {
	switch {
	case len(args) == 1:
		return args[0], false, true
	case len(args) == 2 && args[1] == "normalize":
		return args[0], true, true
	}
	return "", false, false
}

// normalizer is a keyer that may map its values (normalize), for the admin
// API to map a value it is given the same way.
type normalizer interface{ normalizes() bool }

func (k *HeaderKeyer) normalizes() bool { return k.Normalize }
func (k *CookieKeyer) normalizes() bool { return k.Normalize }
func (k *FormKeyer) normalizes() bool   { return k.Normalize }
func (k *JSONKeyer) normalizes() bool   { return k.Normalize }

// appendValue appends a keyer's value to buf, mapped by normalizedValue
// when normalize is set; an empty value, or one the profile rejects, names
// nobody.
func appendValue(buf []byte, v string, normalize bool) ([]byte, bool) {
	if normalize {
		var ok bool
		if v, ok = normalizedValue(v); !ok {
			return buf, false
		}
	}
	if v == "" {
		return buf, false
	}
	return append(buf, v...), true
}

// normalizedValue maps a username by RFC 8265's UsernameCaseMapped profile,
// after trimming surrounding spaces: full-width letters to their usual
// width, upper case to lower, and NFC, so that "Dave", " dave " and a
// full-width "ｄａｖｅ" name one user. Then it drops accents (nonspacing
// marks, once decomposed), since MySQL's and MariaDB's default collations
// find dave for "dàve" and "dávé": merging users who differ by an accent
// only costs them a shared bucket, while telling apart what the origin's
// database reads as one user gives an attacker a bucket per spelling. It
// reports false for a value the profile rejects, such as one with a space
// inside.
func normalizedValue(v string) (string, bool) {
	s, err := precis.UsernameCaseMapped.String(strings.TrimSpace(v))
	if err != nil || s == "" {
		return "", false
	}
	s = norm.NFC.String(strings.Map(func(r rune) rune {
		if unicode.Is(unicode.Mn, r) {
			return -1
		}
		return r
	}, norm.NFD.String(s)))
	return s, s != ""
}

// resembles reports whether an origin could read the cookie or form name
// as field although the two differ: in case, with surrounding spaces,
// percent-encoded, cut at a NUL byte (PHP), in PHP's spelling (which reads
// "user.name", "user name" and "user[name" as "user_name"), with brackets
// dropped (Rack 2 reads "[user]" and "user]" as "user"), or nested under
// or above it ("user[]", "user[0]" and, for the field "user[name]", "user";
// but not the sibling "user[password]"). It never allocates when neither
// name holds one of looseSpecial.
func resembles(name, field string) bool {
	return resemblesAs(name, field, false)
}

// resemblesField is resembles for a form, query or multipart field, which
// model binders also read by a dotted path, and by its last part under any
// prefix: ASP.NET Core binds "model.Username" to the property Username of
// the parameter model before a bare "Username".
func resemblesField(name, field string) bool {
	return resemblesAs(name, field, true)
}

// looseSpecial are the characters that origins read loosely in a name;
// without them, a name is read as itself, in any case.
const looseSpecial = "%+[]. \t\x00"

func resemblesAs(name, field string, model bool) bool {
	if strings.EqualFold(name, field) {
		return true
	}
	if !strings.ContainsAny(name, looseSpecial) && !strings.ContainsAny(field, looseSpecial) {
		return false
	}
	names, fields := loosePaths(name, model), loosePaths(field, model)
	for _, a := range names {
		for _, b := range fields {
			if len(a) == 0 || len(b) == 0 {
				continue
			}
			if nestedPaths(a, b) || model && len(a) > len(b) && slices.Equal(a[len(a)-len(b):], b) {
				return true
			}
		}
	}
	return false
}

// nestedPaths reports whether one path is the other or lies under it.
func nestedPaths(a, b []string) bool {
	n := min(len(a), len(b))
	return slices.Equal(a[:n], b[:n])
}

// loosePaths are the paths the most lenient origins read a name as, lower
// case, percent-decoded and cut at a NUL byte: split at brackets (and at
// dots, for model binders), and as PHP reads it.
func loosePaths(s string, model bool) [2][]string {
	if u, err := url.QueryUnescape(s); err == nil {
		s = u
	}
	if i := strings.IndexByte(s, 0); i >= 0 {
		s = s[:i]
	}
	s = strings.ToLower(s)
	seps := "[]"
	if model {
		seps = "[]."
	}
	var split []string
	for _, seg := range strings.FieldsFunc(s, func(r rune) bool { return strings.ContainsRune(seps, r) }) {
		if seg = strings.TrimSpace(seg); seg != "" {
			split = append(split, seg)
		}
	}
	return [2][]string{split, phpPath(strings.TrimLeft(s, " "))}
}

// phpPath is a name as PHP reads it: spaces and dots before the first
// bracket are underscores, a bracket with no closing one is an underscore
// too, and each [index] after it is a level; what follows is ignored.
func phpPath(s string) []string {
	base, rest := s, ""
	if i := strings.IndexByte(s, '['); i >= 0 {
		if strings.IndexByte(s[i:], ']') < 0 {
			base = s[:i] + "_" + s[i+1:]
		} else {
			base, rest = s[:i], s[i:]
		}
	}
	path := []string{strings.TrimSpace(strings.Map(func(r rune) rune {
		if r == ' ' || r == '.' {
			return '_'
		}
		return r
	}, base))}
	for strings.HasPrefix(rest, "[") {
		j := strings.IndexByte(rest, ']')
		if j < 0 {
			break
		}
		path = append(path, strings.TrimSpace(rest[1:j]))
		rest = rest[j+1:]
	}
	return path
}

// mentions reports whether s holds name in any case, also once
// percent-decoded: whether a lenient parser could find it there.
func mentions(s, name string) bool {
	if containsFold(s, name) {
		return true
	}
	if strings.Contains(s, "%") {
		if u, err := url.PathUnescape(s); err == nil {
			return containsFold(u, name)
		}
		return true // a malformed escape: assume the worst
	}
	return false
}

func containsFold(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if strings.EqualFold(s[i:i+len(sub)], sub) {
			return true
		}
	}
	return false
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
