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

// FormKeyer names the client by a field of an
// application/x-www-form-urlencoded or multipart/form-data body, such as
// the username of a login form.
type FormKeyer struct {
	// Field is the form field's name.
	Field string `json:"field"`

	id string
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
	k.id = "form/" + k.Field
	return nil
}

// Kind implements Keyer.
func (*FormKeyer) Kind() string { return "form" }

// ID implements Keyer.
func (k *FormKeyer) ID() string { return k.id }

// Key implements Keyer. It parses a copy of the body, never the request's
// own form, which would consume the body. It names nothing when origins
// could read the field differently: a body that does not parse, the field
// twice (in any case, since some frameworks fold names), or the field also
// in the query string, which many frameworks merge with the body.
func (k *FormKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	mediaType, params, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil {
		return buf, false
	}
	var value string
	var ok bool
	switch mediaType {
	case "application/x-www-form-urlencoded":
		body, whole := peekBody(r)
		if !whole {
			return buf, false
		}
		value, ok = urlencodedField(string(body), k.Field)
	case "multipart/form-data":
		boundary := params["boundary"]
		if boundary == "" {
			return buf, false
		}
		body, whole := peekBody(r)
		if !whole {
			return buf, false
		}
		value, ok = multipartField(body, boundary, k.Field)
	default:
		return buf, false
	}
	if !ok || value == "" || !absentFromQuery(r.URL.RawQuery, k.Field) {
		return buf, false
	}
	return append(buf, value...), true
}

// urlencodedField returns the value of the field, which must be in the
// form once, in a form that parses whole.
func urlencodedField(body, field string) (string, bool) {
	form, err := url.ParseQuery(body)
	if err != nil {
		return "", false
	}
	var value string
	n := 0
	for name, vs := range form {
		if strings.EqualFold(name, field) {
			n += len(vs)
			value = vs[0]
		}
	}
	return value, n == 1
}

// absentFromQuery reports whether the query string parses and lacks the
// field in any case.
func absentFromQuery(rawQuery, field string) bool {
	if rawQuery == "" {
		return true
	}
	query, err := url.ParseQuery(rawQuery)
	if err != nil {
		return false
	}
	for name := range query {
		if strings.EqualFold(name, field) {
			return false
		}
	}
	return true
}

// multipartField returns the value of the one part named field, in a body
// that parses to its closing boundary. A file of that name is no value.
func multipartField(body []byte, boundary, field string) (string, bool) {
	mr := multipart.NewReader(bytes.NewReader(body), boundary)
	var value []byte
	n := 0
	for {
		part, err := mr.NextPart()
		if err == io.EOF { // the closing boundary; a truncated body wraps io.EOF
			return string(value), n == 1
		}
		if err != nil {
			return "", false
		}
		if !strings.EqualFold(part.FormName(), field) {
			continue
		}
		if n++; part.FileName() != "" {
			return "", false
		}
		if value, err = io.ReadAll(part); err != nil {
			return "", false
		}
	}
}

// UnmarshalCaddyfile reads `form <field>`.
func (k *FormKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Field) {
		return d.Err("key form: want exactly one field name")
	}
	return nil
}

// JSONKeyer names the client by a field of an application/json body, found
// by a dot path such as user.name (a number indexes an array: items.0.id).
// The field must be a string, a number or a boolean.
type JSONKeyer struct {
	// Path is the field's dot path.
	Path string `json:"path"`

	path []string
	id   string
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
	k.id = "json/" + k.Path
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

// ID implements Keyer.
func (k *JSONKeyer) ID() string { return k.id }

// Key implements Keyer. It walks the document's tokens itself rather than
// decoding into a map, which would keep the last of two equal keys without
// a word. It names nothing when origins could read the field differently:
// a body that is not one JSON document, or an object on the path that has
// the path's key twice or in another case (Go's encoding/json matches keys
// case-insensitively and keeps the last).
func (k *JSONKeyer) Key(r *http.Request, buf []byte) ([]byte, bool) {
	mediaType, _, err := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if err != nil || mediaType != "application/json" {
		return buf, false
	}
	body, ok := peekBody(r)
	if !ok {
		return buf, false
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	v, ok, err := jsonField(dec, k.path)
	if err != nil || !ok || v == "" {
		return buf, false
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return buf, false // trailing data: not one JSON document
	}
	return append(buf, v...), true
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

// UnmarshalCaddyfile reads `json <dot.path>`.
func (k *JSONKeyer) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.AllArgs(&k.Path) {
		return d.Err("key json: want exactly one dot path, such as user.name")
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
