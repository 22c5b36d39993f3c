package ratelimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"mime"
	"mime/multipart"
	"net/http"
	"net/textproto"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(FormKeyer{})
	caddy.RegisterModule(JSONKeyer{})
}

// maxKeyedBody is the most of a body that a body keyer reads. A longer
// body yields no key, and still flows whole to the next handlers.
const maxKeyedBody = 64 << 10

// bodyKeyerID is the ID of every body keyer: a form field and a JSON field
// that name one user give one bucket, whichever encoding the attempt used,
// while a header or a cookie equal to that name keeps its own.
const bodyKeyerID = "body"

// FormKeyer names the client by a field of an
// application/x-www-form-urlencoded or multipart/form-data body, such as
// the username of a login form.
type FormKeyer struct {
	// Field is the form field's name.
	Field string `json:"field"`
	// Normalize maps the value by RFC 8265's UsernameCaseMapped profile
	// before it names the client; see normalizedValue.
	Normalize bool `json:"normalize,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (FormKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "form",
		New: func() caddy.Module { return new(FormKeyer) },
	}
}

// Provision checks the field.
func (k *FormKeyer) Provision(caddy.Context) error {
	if k.Field == "" {
		return fmt.Errorf("key form: a field name is required")
	}
	return nil
}

// Kind implements Keyer.
func (*FormKeyer) Kind() string { return "form" }

// ID implements Keyer: the body keyers share one, bodyKeyerID.
func (*FormKeyer) ID() string { return bodyKeyerID }

// Key implements Keyer. It parses a copy of the body, never the request's
// own form, which would consume the body. It names nothing when origins
// could read the field differently: a body that does not parse, the field
// twice (in any case or spelling, since some frameworks fold names), the
// field also in the query string, which many frameworks merge with the
// body, a cookie of the field's name with another value (PHP's $_REQUEST
// merges cookies over the body), a multipart body that parsers read two
// ways (multipartField), or a urlencoded body that is also a JSON document,
// which origins that parse every body as JSON read as one.
func (k *FormKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	mediaType, boundary, ok := bodyType(r)
	if !ok {
		return buf, false
	}
	var value string
	switch mediaType {
	case "application/x-www-form-urlencoded":
		body, whole := peekBody(r)
		if !whole || looksLikeJSON(body) {
			return buf, false
		}
		value, ok = urlencodedField(string(body), k.Field)
	case "multipart/form-data":
		body, whole := peekBody(r)
		if !whole {
			return buf, false
		}
		value, ok = multipartField(body, boundary, k.Field)
	default:
		return buf, false
	}
	if !ok || !absentFromQuery(r.URL.RawQuery, k.Field) || !cookieAgrees(r, k.Field, value) {
		return buf, false
	}
	return appendValue(buf, value, k.Normalize)
}

// bodyType is the request's media type, and a multipart body's boundary,
// when every origin reads the body as the keyer does: one Content-Type line
// (origins differ on which of two wins), no Content-Encoding (an origin that
// inflates the body reads what the keyer cannot), and no parameter but a
// UTF-8 charset and a multipart body's plain boundary, each once. An origin
// that honours another charset decodes other names from the same bytes;
// and origins find the parameters loosely: Tomcat takes the charset from
// the first "charset=" in the field, in whatever parameter it stands, PHP
// the boundary from the first "boundary", and Go the boundary* form of
// RFC 2231 where werkzeug takes the plain one.
func bodyType(r *http.Request) (mediaType, boundary string, ok bool) {
	ct := r.Header["Content-Type"]
	if len(ct) != 1 || len(r.Header["Content-Encoding"]) != 0 {
		return "", "", false
	}
	typ, rest, _ := strings.Cut(ct[0], ";")
	mediaType = strings.ToLower(strings.TrimSpace(typ))
	multipart := mediaType == "multipart/form-data"
	charset := false
	for {
		if rest = strings.TrimLeft(rest, " \t"); rest == "" {
			break
		}
		var key, val string
		if key, rest, ok = strings.Cut(rest, "="); !ok {
			return "", "", false
		}
		if val, rest, ok = dispositionValue(rest); !ok {
			return "", "", false
		}
		switch key = strings.ToLower(key); {
		case key == "charset" && !charset && strings.EqualFold(val, "utf-8"):
			charset = true
		case key == "boundary" && multipart && boundary == "" && plainBoundary(val):
			boundary = val
		default:
			return "", "", false
		}
	}
	if multipart && boundary == "" {
		return "", "", false
	}
	return mediaType, boundary, true
}

// plainBoundary reports whether b is a boundary as browsers and HTTP
// clients write them: at most 70 letters, digits and RFC 2046's other
// characters, but no space or "=", which lenient parsers could read as the
// start of another parameter.
func plainBoundary(b string) bool {
	if len(b) == 0 || len(b) > 70 {
		return false
	}
	for i := 0; i < len(b); i++ {
		c := b[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("'()+_,-./:?", c) >= 0) {
			return false
		}
	}
	return true
}

// looksLikeJSON reports whether body, after white space and a byte order
// mark, opens a JSON object or array.
func looksLikeJSON(body []byte) bool {
	body = bytes.TrimLeft(bytes.TrimPrefix(bytes.TrimLeft(body, " \t\r\n"), []byte("\ufeff")), " \t\r\n")
	return len(body) > 0 && (body[0] == '{' || body[0] == '[')
}

// urlencodedField returns the value of the field, which must be in the
// form once, in a form that parses whole, beside no name that origins
// could read as the field (resemblesField). It reads a query string too.
func urlencodedField(body, field string) (string, bool) {
	form, err := url.ParseQuery(body)
	if err != nil {
		return "", false
	}
	var value string
	n := 0
	for name, vs := range form {
		switch {
		case strings.EqualFold(name, field):
			n += len(vs)
			value = vs[0]
		case resemblesField(name, field):
			return "", false
		}
	}
	return value, n == 1
}

// absentFromQuery reports whether the query string parses and lacks the
// field in any case or spelling (resemblesField).
func absentFromQuery(rawQuery, field string) bool {
	if rawQuery == "" {
		return true
	}
	query, err := url.ParseQuery(rawQuery)
	if err != nil {
		return false
	}
	for name := range query {
		if resemblesField(name, field) {
			return false
		}
	}
	return true
}

// cookieAgrees reports whether the request's cookies leave the field's
// value as the body gives it: PHP's $_REQUEST, unless php.ini says
// otherwise, takes a cookie of the field's name over the body. A cookie of
// that name with the same value changes nothing; one with another value,
// or in another spelling, names nobody.
func cookieAgrees(r *http.Request, field, value string) bool {
	v, n, ok := scanCookies(r, field)
	switch {
	case !ok || n > 1:
		return false
	case n == 0:
		return true
	}
	u, err := url.QueryUnescape(v)
	return err == nil && u == value
}

// multipartField returns the value of the one part named field, in a body
// that parses to its closing boundary. It reads the body as browsers write
// it, and reports false for anything parsers read in different ways: a
// body that is not plain (plainMultipart), a part without exactly one plain
// form-data disposition (werkzeug reads the name of an `attachment`, Go
// skips it), a name that resembles the field's, or a field part that is a
// file or carries a transfer encoding or a charset (Go decodes
// quoted-printable, others do not).
func multipartField(body []byte, boundary, field string) (string, bool) {
	if !plainMultipart(body, boundary) {
		return "", false
	}
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	var value []byte
	n := 0
	for {
		part, err := mr.NextRawPart()
		if err == io.EOF { // the closing boundary; a truncated body wraps io.EOF
			return string(value), n == 1
		}
		if err != nil {
			return "", false
		}
		cd := part.Header["Content-Disposition"]
		if len(cd) != 1 {
			return "", false
		}
		name, file, ok := formDisposition(cd[0])
		switch {
		case !ok:
			return "", false
		case strings.EqualFold(name, field):
			if n++; file || !plainFieldHeader(part.Header) {
				return "", false
			}
			if value, err = io.ReadAll(part); err != nil {
				return "", false
			}
		case resemblesField(name, field):
			return "", false
		}
	}
}

// plainMultipart reports whether body is split into parts as every
// parser splits it: it opens with the first delimiter (werkzeug starts a
// part at a delimiter anywhere in a preamble, even mid-line), every
// delimiter stands alone at the start of a line, after a CRLF, and is
// followed at once by CRLF or "--" (Go's reader also takes a bare LF and
// trailing spaces; others split elsewhere), and nothing but white space
// follows the closing delimiter (PHP reads parts after it).
func plainMultipart(body []byte, boundary string) bool {
	delim := []byte("--" + boundary)
	if !bytes.HasPrefix(body, append(delim, '\r', '\n')) {
		return false
	}
	for i := 0; ; {
		j := bytes.Index(body[i:], delim)
		if j < 0 {
			return false // no closing delimiter
		}
		j += i
		if j > 0 && (j < 2 || body[j-2] != '\r' || body[j-1] != '\n') {
			return false
		}
		after := body[j+len(delim):]
		if bytes.HasPrefix(after, []byte("--")) {
			return len(bytes.Trim(after[2:], " \t\r\n")) == 0
		}
		if !bytes.HasPrefix(after, []byte("\r\n")) {
			return false
		}
		i = j + len(delim)
	}
}

// formDisposition reads a part's Content-Disposition as browsers write it:
// form-data, then a name and perhaps a filename, each once, quoted (with no
// backslash or semicolon inside) or a token. It reports false for anything
// else: another type, a stray, repeated or RFC 2231 parameter, an escape.
func formDisposition(v string) (name string, file, ok bool) {
	typ, rest, _ := strings.Cut(v, ";")
	if !strings.EqualFold(strings.TrimSpace(typ), "form-data") {
		return "", false, false
	}
	hasName := false
	for rest != "" {
		var key, val string
		if key, rest, ok = strings.Cut(strings.TrimLeft(rest, " \t"), "="); !ok {
			return "", false, false
		}
		if val, rest, ok = dispositionValue(rest); !ok {
			return "", false, false
		}
		switch {
		case key == "name" && !hasName:
			name, hasName = val, true
		case key == "filename" && !file:
			file = true
		default:
			return "", false, false
		}
	}
	return name, file, hasName
}

// dispositionValue reads a parameter's value, quoted or a token, and the
// ";" after it, if any.
func dispositionValue(s string) (val, rest string, ok bool) {
	if strings.HasPrefix(s, `"`) {
		end := strings.IndexByte(s[1:], '"')
		if end < 0 {
			return "", "", false
		}
		val, s = s[1:1+end], s[2+end:]
		if strings.ContainsAny(val, `\;`) {
			return "", "", false
		}
	} else {
		end := strings.IndexByte(s, ';')
		if end < 0 {
			end = len(s)
		}
		val, s = strings.TrimRight(s[:end], " \t"), s[end:]
		if !isToken(val) || val[0] == '\'' { // PHP unquotes 'name'
			return "", "", false
		}
	}
	s = strings.TrimLeft(s, " \t")
	if s == "" {
		return val, "", true
	}
	if s[0] != ';' {
		return "", "", false
	}
	return val, s[1:], true
}

// plainFieldHeader reports whether a field part's header is what browsers
// send: its disposition, and at most a text/plain type in UTF-8.
func plainFieldHeader(h textproto.MIMEHeader) bool {
	for name, vs := range h {
		switch name {
		case "Content-Disposition":
		case "Content-Type":
			mediaType, params, err := mime.ParseMediaType(vs[0])
			if len(vs) != 1 || err != nil || mediaType != "text/plain" {
				return false
			}
			for p, v := range params {
				if p != "charset" || !strings.EqualFold(v, "utf-8") {
					return false
				}
			}
		default:
			return false
		}
	}
	return true
}

// UnmarshalCaddyfile reads `form <field> [normalize]`.
func (k *FormKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	var ok bool
	if k.Field, k.Normalize, ok = nameAndNormalize(d.RemainingArgs()); !ok {
		return d.Err("key form: want one field name, then normalize or nothing")
	}
	return nil
}

// JSONKeyer names the client by a field of an application/json body, found
// by a dot path such as user.name (a number indexes an array: items.0.id).
// The field must be a string, a number or a boolean.
type JSONKeyer struct {
	// Path is the field's dot path.
	Path string `json:"path"`
	// Normalize maps the value by RFC 8265's UsernameCaseMapped profile
	// before it names the client; see normalizedValue.
	Normalize bool `json:"normalize,omitempty"`

	path []string
}

// CaddyModule returns the Caddy module information.
func (JSONKeyer) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  keyerModulePrefix + "json",
		New: func() caddy.Module { return new(JSONKeyer) },
	}
}

// Provision splits the path.
func (k *JSONKeyer) Provision(caddy.Context) error {
	if err := k.Validate(); err != nil {
		return err
	}
	k.path = strings.Split(k.Path, ".")
	return nil
}

// Validate checks the path.
func (k *JSONKeyer) Validate() error {
	if slices.Contains(strings.Split(k.Path, "."), "") {
		return fmt.Errorf("key json: path %q: want a dot path such as user.name", k.Path)
	}
	return nil
}

// Kind implements Keyer.
func (*JSONKeyer) Kind() string { return "json" }

// ID implements Keyer: the body keyers share one, bodyKeyerID.
func (*JSONKeyer) ID() string { return bodyKeyerID }

// Key implements Keyer. It walks the document's tokens itself rather than
// decoding into a map, which would keep the last of two equal keys without
// a word. It names nothing when origins could read the field differently:
// a body that is not one JSON document, an object on the path that has
// the path's key twice or in another case (Go's encoding/json matches keys
// case-insensitively and keeps the last), or the field also in the query
// string, in any spelling: Rails merges the query's user[name] over the
// body's user.name.
func (k *JSONKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	if mediaType, _, ok := bodyType(r); !ok || mediaType != "application/json" || !absentFromQuery(r.URL.RawQuery, k.Path) {
		return buf, false
	}
	body, ok := peekBody(r)
	if !ok {
		return buf, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	v, ok, err := jsonField(dec, k.path)
	if err != nil || !ok {
		return buf, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return buf, false // trailing data: not one JSON document
	}
	return appendValue(buf, v, k.Normalize)
}

// errAmbiguousKey stops a walk at a key that origins could read two ways.
var errAmbiguousKey = errors.New("a key on the path is given twice or in another case")

// jsonField reads one JSON value from dec, whole, and returns the scalar at
// path within it (a number indexes an array). It fails on malformed JSON and
// on an ambiguous key along the path.
func jsonField(dec *json.Decoder, path []string) (string, bool, error) {
	tok, err := dec.Token()
	if err != nil {
		return "", false, err
	}
	delim, ok := tok.(json.Delim)
	if !ok {
		if len(path) > 0 {
			return "", false, nil
		}
		v, ok := jsonScalar(tok)
		return v, ok, nil
	}
	if len(path) == 0 {
		return "", false, skipJSONNested(dec)
	}
	var v string
	found := false
	switch delim {
	case '{':
		v, found, err = jsonObjectField(dec, path)
	default: // '['
		v, found, err = jsonArrayField(dec, path)
	}
	if err != nil {
		return "", false, err
	}
	if _, err := dec.Token(); err != nil { // the closing delimiter
		return "", false, err
	}
	return v, found, nil
}

// jsonObjectField reads an object's members, after its '{', and follows
// path[0], which must be its key exactly once and in no other case.
func jsonObjectField(dec *json.Decoder, path []string) (v string, found bool, err error) {
	seen := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return "", false, err
		}
		key, _ := tok.(string)
		switch {
		case key == path[0] && !seen:
			seen = true
			if v, found, err = jsonField(dec, path[1:]); err != nil {
				return "", false, err
			}
		case strings.EqualFold(key, path[0]):
			return "", false, errAmbiguousKey
		default:
			if err := skipJSONValue(dec); err != nil {
				return "", false, err
			}
		}
	}
	return v, found, nil
}

// jsonArrayField reads an array's elements, after its '[', and follows the
// one that path[0] indexes.
func jsonArrayField(dec *json.Decoder, path []string) (v string, found bool, err error) {
	want, err := strconv.Atoi(path[0])
	if err != nil {
		want = -1
	}
	for i := 0; dec.More(); i++ {
		if i == want {
			v, found, err = jsonField(dec, path[1:])
		} else {
			err = skipJSONValue(dec)
		}
		if err != nil {
			return "", false, err
		}
	}
	return v, found, nil
}

// skipJSONValue reads one JSON value from dec and discards it.
func skipJSONValue(dec *json.Decoder) error {
	_, _, err := jsonField(dec, nil)
	return err
}

// skipJSONNested reads the rest of an object or array, after its opening
// delimiter, up to and including its closing one.
func skipJSONNested(dec *json.Decoder) error {
	for depth := 1; depth > 0; {
		tok, err := dec.Token()
		if err != nil {
			return err
		}
		switch tok {
		case json.Delim('{'), json.Delim('['):
			depth++
		case json.Delim('}'), json.Delim(']'):
			depth--
		}
	}
	return nil
}

// jsonScalar formats a decoded JSON string, number or boolean. Numbers are
// written without an exponent, so that 1e3 and 1000 name the same client.
func jsonScalar(v any) (string, bool) {
	switch v := v.(type) {
	case string:
		return v, true
	case bool:
		return strconv.FormatBool(v), true
	case json.Number:
		s := v.String()
		if !strings.ContainsAny(s, ".eE") {
			return s, true
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil {
			return "", false
		}
		return formatFloat(f)
	case float64:
		return formatFloat(v)
	}
	return "", false
}

func formatFloat(f float64) (string, bool) {
	if math.IsInf(f, 0) || math.IsNaN(f) {
		return "", false
	}
	return strconv.FormatFloat(f, 'f', -1, 64), true
}

// UnmarshalCaddyfile reads `json <dot.path> [normalize]`.
func (k *JSONKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	var ok bool
	if k.Path, k.Normalize, ok = nameAndNormalize(d.RemainingArgs()); !ok {
		return d.Err("key json: want one dot path, such as user.name, then normalize or nothing")
	}
	if err := k.Validate(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// peekBody returns the request body if it is at most maxKeyedBody long, and
// puts back a body that reads exactly as the original did: what was read,
// then the unread rest. It reports false for a longer body or a failed
// read; the body still flows whole.
func peekBody(r *http.Request) ([]byte, bool) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, true
	}
	if pb, ok := r.Body.(*peekedBody); ok && pb.whole && !pb.started {
		// Another body keyer has read it already.
		return pb.prefix, true
	}
	if r.ContentLength > maxKeyedBody {
		return nil, false
	}
	prefix, err := io.ReadAll(io.LimitReader(r.Body, maxKeyedBody+1))
	whole := err == nil && len(prefix) <= maxKeyedBody
	pb := &peekedBody{prefix: prefix, whole: whole, orig: r.Body}
	switch {
	case whole:
		pb.rest = bytes.NewReader(prefix)
	case err != nil:
		pb.rest = io.MultiReader(bytes.NewReader(prefix), errReader{err})
	default:
		pb.rest = io.MultiReader(bytes.NewReader(prefix), r.Body)
	}
	r.Body = pb
	return prefix, whole
}

// peekedBody replays a body that a keyer has read from: the bytes read,
// then the rest of the original. Close closes the original.
type peekedBody struct {
	prefix  []byte
	whole   bool // prefix is the whole body
	started bool
	rest    io.Reader
	orig    io.ReadCloser
}

func (b *peekedBody) Read(p []byte) (int, error) {
	b.started = true
	return b.rest.Read(p)
}

func (b *peekedBody) Close() error { return b.orig.Close() }

// errReader replays a read error after the bytes read before it.
type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// Interface guards
var (
	_ Keyer                 = (*FormKeyer)(nil)
	_ Keyer                 = (*JSONKeyer)(nil)
	_ caddy.Provisioner     = (*FormKeyer)(nil)
	_ caddy.Provisioner     = (*JSONKeyer)(nil)
	_ caddy.Validator       = (*JSONKeyer)(nil)
	_ caddyfile.Unmarshaler = (*FormKeyer)(nil)
	_ caddyfile.Unmarshaler = (*JSONKeyer)(nil)
)
