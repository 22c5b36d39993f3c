package ratelimit

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/iotest"

	"github.com/caddyserver/caddy/v2"
)

// origin is a backend that records what reaches it.
type origin struct {
	*httptest.Server
	mu       sync.Mutex
	bodies   [][]byte
	keyIDs   []string
	readErrs []error
}

func newOrigin(t *testing.T) *origin { return newOriginAnswering(t, http.StatusOK) }

// newOriginAnswering is an origin that answers every request with status,
// such as a login that refuses every guess with 401.
func newOriginAnswering(t *testing.T, status int) *origin {
	o := new(origin)
	o.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, err := io.ReadAll(r.Body)
		o.mu.Lock()
		o.bodies = append(o.bodies, b)
		o.keyIDs = append(o.keyIDs, r.Header.Get("X-Rate-Key"))
		o.readErrs = append(o.readErrs, err)
		o.mu.Unlock()
		w.WriteHeader(status)
		fmt.Fprintf(w, "%x", sha256.Sum256(b))
	}))
	t.Cleanup(o.Close)
	return o
}

// last returns the body and key id of the latest request the origin saw.
func (o *origin) last(t *testing.T) ([]byte, string) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	if len(o.bodies) == 0 {
		t.Fatal("the origin saw no request")
	}
	n := len(o.bodies) - 1
	if o.readErrs[n] != nil {
		t.Fatalf("the origin could not read the body: %v", o.readErrs[n])
	}
	return o.bodies[n], o.keyIDs[n]
}

// seen is how many requests reached the origin.
func (o *origin) seen() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.bodies)
}

// loginSite limits a login endpoint to 3 attempts an hour per username,
// with keyer and any more rate_limit subdirectives, and proxies to the
// origin, telling it the key id. A rejection's page names its status and
// the decision, through handle_errors.
func loginSite(t *testing.T, keyer string, more ...string) (*testServer, *origin) {
	o := newOrigin(t)
	s := serve(t, fmt.Sprintf(`
	rate_limit 3 1/h {
		key %s
		%s
	}
	reverse_proxy %s {
		header_up X-Rate-Key {http.rate_limit.key_id}
	}
	handle_errors {
		respond "{http.error.status_code} {http.rate_limit.decision}" {http.error.status_code}
	}`, keyer, strings.Join(more, "\n\t\t"), strings.TrimPrefix(o.URL, "http://")))
	return s, o
}

func multipartBody(t testing.TB, fields map[string]string) (string, string) {
	var b bytes.Buffer
	w := multipart.NewWriter(&b)
	for name, v := range fields {
		if err := w.WriteField(name, v); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return b.String(), w.FormDataContentType()
}

func TestLoginKeyedByUsernameSharesOneBucketAcrossIPs(t *testing.T) {
	for _, c := range []struct {
		name, keyer, keyerID string
		body                 func(user string) (body, contentType string)
	}{
		{"urlencoded form", "form username", bodyKeyerID, func(user string) (string, string) {
			return url.Values{"username": {user}, "password": {"hunter2 & more"}}.Encode(), "application/x-www-form-urlencoded"
		}},
		{"multipart form", "form username", bodyKeyerID, func(user string) (string, string) {
			return multipartBody(t, map[string]string{"username": user, "password": "hunter2"})
		}},
		{"JSON", "json user.name", bodyKeyerID, func(user string) (string, string) {
			return `{"user":{"name":` + strconv.Quote(user) + `},"password":"hunter2"}`, "application/json; charset=utf-8"
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			useFakeClock(t)
			s, o := loginSite(t, c.keyer)
			post := func(ip, user string) response {
				t.Helper()
				body, ctype := c.body(user)
				r := s.do(http.MethodPost, "/login", body, "X-Forwarded-For: "+ip, "Content-Type: "+ctype)
				if r.status == 200 {
					got, keyID := o.last(t)
					if string(got) != body {
						t.Errorf("the origin got body %q, want %q", got, body)
					}
					if want := keyIDOf(c.keyerID, user); keyID != want {
						t.Errorf("key id %s, want %s (the username's)", keyID, want)
					}
				}
				return r
			}
			for i, ip := range []string{"127.0.0.2", "127.0.0.3", "127.0.0.2"} {
				r := post(ip, "alice")
				if r.status != 200 || r.header.Get("X-RateLimit-Remaining") != strconv.Itoa(2-i) {
					t.Fatalf("alice's attempt %d from %s: %d, remaining %q; want 200, %d", i+1, ip, r.status, r.header.Get("X-RateLimit-Remaining"), 2-i)
				}
			}
			if r := post("127.0.0.3", "alice"); r.status != 429 {
				t.Errorf("alice's 4th attempt, from another IP: %d, want 429", r.status)
			}
			if r := post("127.0.0.3", "bob"); r.status != 200 {
				t.Errorf("bob from the same IP: %d, want 200: his own bucket", r.status)
			}
		})
	}
}

func TestBodyOverCapIsKeyedByIPAndFlowsWhole(t *testing.T) {
	useFakeClock(t)
	for _, c := range []struct{ keyer, ctype, body string }{
		{"form username", "application/x-www-form-urlencoded", "username=alice&pad=" + strings.Repeat("x", 200<<10)},
		{"json user.name", "application/json", `{"user":{"name":"alice"},"pad":"` + strings.Repeat("x", 200<<10) + `"}`},
	} {
		t.Run(c.keyer, func(t *testing.T) {
			s, o := loginSite(t, c.keyer)
			r := s.do(http.MethodPost, "/login", c.body, "X-Forwarded-For: 127.0.0.2", "Content-Type: "+c.ctype)
			if r.status != 200 {
				t.Fatalf("status %d", r.status)
			}
			got, keyID := o.last(t)
			if !bytes.Equal(got, []byte(c.body)) {
				t.Errorf("the origin got %d bytes, want the %d sent, unchanged", len(got), len(c.body))
			}
			if want := keyIDOf("ip/32/64", "127.0.0.2"); keyID != want {
				t.Errorf("key id %s, want the client IP's %s", keyID, want)
			}
		})
	}
}

// chunked hides a reader's length, so that the request has no Content-Length.
type chunked struct{ io.Reader }

func TestBodyKeyersYieldNothingForOtherBodiesAndLeaveThemIntact(t *testing.T) {
	t.Parallel()
	mp, mpType := multipartBody(t, map[string]string{"username": "alice"})
	bigForm := "username=alice&pad=" + strings.Repeat("y", maxKeyedBody)
	cases := []struct {
		name   string
		keyer  Keyer
		ctype  string
		body   io.Reader
		want   string
		wantOK bool
	}{
		{"form field", &FormKeyer{Field: "username"}, "application/x-www-form-urlencoded", strings.NewReader("a=1&username=al%20ice"), "al ice", true},
		{"form field, no length", &FormKeyer{Field: "username"}, "application/x-www-form-urlencoded", chunked{strings.NewReader("username=alice")}, "alice", true},
		{"multipart field", &FormKeyer{Field: "username"}, mpType, strings.NewReader(mp), "alice", true},
		{"form over 64 KiB, no length", &FormKeyer{Field: "username"}, "application/x-www-form-urlencoded", chunked{strings.NewReader(bigForm)}, "", false},
		{"form missing field", &FormKeyer{Field: "username"}, "application/x-www-form-urlencoded", strings.NewReader("user=alice"), "", false},
		{"form malformed", &FormKeyer{Field: "username"}, "application/x-www-form-urlencoded", strings.NewReader("username=%zz"), "", false},
		{"form as text", &FormKeyer{Field: "username"}, "text/plain", strings.NewReader("username=alice"), "", false},
		{"form as JSON", &FormKeyer{Field: "username"}, "application/json", strings.NewReader(`{"username":"alice"}`), "", false},
		{"multipart without boundary", &FormKeyer{Field: "username"}, "multipart/form-data", strings.NewReader(mp), "", false},
		{"multipart truncated", &FormKeyer{Field: "username"}, mpType, strings.NewReader(mp[:20]), "", false},
		{"multipart file part", &FormKeyer{Field: "f"}, "multipart/form-data; boundary=X", strings.NewReader("--X\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a\"\r\n\r\nalice\r\n--X--\r\n"), "", false},
		{"JSON string", &JSONKeyer{Path: "user.name"}, "application/json", strings.NewReader(`{"user":{"name":"alice"}}`), "alice", true},
		{"JSON number", &JSONKeyer{Path: "id"}, "application/json", strings.NewReader(`{"id":1e3}`), "1000", true},
		{"JSON big integer", &JSONKeyer{Path: "id"}, "application/json", strings.NewReader(`{"id":123456789012345678901}`), "123456789012345678901", true},
		{"JSON bool", &JSONKeyer{Path: "a"}, "application/json", strings.NewReader(`{"a":true}`), "true", true},
		{"JSON array index", &JSONKeyer{Path: "users.1.name"}, "application/json", strings.NewReader(`{"users":[{"name":"a"},{"name":"b"}]}`), "b", true},
		{"JSON object", &JSONKeyer{Path: "user"}, "application/json", strings.NewReader(`{"user":{"name":"alice"}}`), "", false},
		{"JSON null", &JSONKeyer{Path: "user"}, "application/json", strings.NewReader(`{"user":null}`), "", false},
		{"JSON malformed", &JSONKeyer{Path: "user"}, "application/json", strings.NewReader(`{"user":"alice"`), "", false},
		{"JSON trailing data", &JSONKeyer{Path: "user"}, "application/json", strings.NewReader(`{"user":"alice"} {"user":"bob"}`), "", false},
		{"JSON as form", &JSONKeyer{Path: "user"}, "application/x-www-form-urlencoded", strings.NewReader(`{"user":"alice"}`), "", false},
		{"JSON read error", &JSONKeyer{Path: "user"}, "application/json", io.MultiReader(strings.NewReader(`{"user":`), iotest.ErrReader(io.ErrUnexpectedEOF)), "", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.keyer.(interface {
				Provision(caddy.Context) error
			}).Provision(caddy.Context{}); err != nil {
				t.Fatal(err)
			}
			var sent bytes.Buffer
			r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/", io.TeeReader(c.body, &sent))
			if _, ok := c.body.(chunked); ok {
				r.ContentLength = -1
			}
			r.Header.Set("Content-Type", c.ctype)
			got, ok := c.keyer.Key(r, nil)
			if ok != c.wantOK || string(got) != c.want {
				t.Errorf("Key = %q, %v; want %q, %v", got, ok, c.want, c.wantOK)
			}
			rest, err := io.ReadAll(r.Body)
			if c.name == "JSON read error" {
				if err == nil {
					t.Error("the read error was swallowed")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(rest, sent.Bytes()) {
				t.Errorf("the body downstream differs from the body sent (%d bytes, want %d)", len(rest), sent.Len())
			}
		})
	}
}

func TestTwoBodyKeyersReadTheBodyOnce(t *testing.T) {
	t.Parallel()
	body := `{"user":{"name":"alice"}}`
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/", strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	form, js := &FormKeyer{Field: "username"}, &JSONKeyer{Path: "user.name"}
	form.Provision(caddy.Context{})
	js.Provision(caddy.Context{})
	if _, ok := form.Key(r, nil); ok {
		t.Error("the form keyer read a JSON body")
	}
	for range 2 {
		if v, ok := js.Key(r, nil); !ok || string(v) != "alice" {
			t.Errorf("json keyer: %q, %v", v, ok)
		}
	}
	if rest, _ := io.ReadAll(r.Body); string(rest) != body {
		t.Errorf("body downstream %q, want %q", rest, body)
	}
}

func TestBodyKeyersCloseTheOriginalBody(t *testing.T) {
	t.Parallel()
	closed := false
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/", nil)
	r.Body = closeFunc{strings.NewReader("username=a"), func() { closed = true }}
	r.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	(&FormKeyer{Field: "username"}).Key(r, nil)
	r.Body.Close()
	if !closed {
		t.Error("closing the replayed body did not close the original")
	}
}

type closeFunc struct {
	io.Reader
	f func()
}

func (c closeFunc) Close() error { c.f(); return nil }

func TestBodyKeyerCaddyfile(t *testing.T) {
	t.Parallel()
	cfg, err := adaptCaddyfile("http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey form username\n\t\tkey json user.name\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := `"keys":[{"field":"username","keyer":"form"},{"keyer":"json","path":"user.name"}]`; !strings.Contains(string(cfg), want) {
		t.Errorf("adapted config lacks %s:\n%s", want, cfg)
	}
	for _, c := range []struct{ key, want string }{
		{"form", "field name"},
		{"form a b", "field name"},
		{"json", "dot path"},
		{"json user..name", "dot path"},
	} {
		_, err := adaptCaddyfile("http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey " + c.key + "\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("key %s: error %v, want one containing %q", c.key, err, c.want)
		}
	}
}

const formType = "application/x-www-form-urlencoded"

// hostileLogin is a login for the user "victim" whose body a keyer cannot
// be sure of, so that keying it by IP would give a botnet a bucket per IP.
type hostileLogin struct {
	name, keyer, query, ctype, body string
	headers                         []string // more header lines
}

func hostileLogins(t testing.TB) []hostileLogin {
	mpTwice := "--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\nvictim\r\n--X--\r\n"
	mp, mpType := multipartBody(t, map[string]string{"user": "decoy"})
	return []hostileLogin{
		{"form with a malformed field elsewhere", "form user", "", formType, "user=victim&z=%zz", nil},
		{"form field also in the query", "form user", "?user=victim", formType, "user=decoy", nil},
		{"form field twice", "form user", "", formType, "user=decoy&user=victim", nil},
		{"form field twice in another case", "form user", "", formType, "user=decoy&USER=victim", nil},
		{"form over 64 KiB", "form user", "", formType, "user=victim&pad=" + strings.Repeat("x", maxKeyedBody), nil},
		{"form as text/plain", "form user", "", "text/plain", "user=victim", nil},
		{"multipart field twice", "form user", "", "multipart/form-data; boundary=X", mpTwice, nil},
		{"multipart field also in the query", "form user", "?user=victim", mpType, mp, nil},
		{"JSON key twice in another case", "json user", "", "application/json", `{"user":"decoy","USER":"victim"}`, nil},
		{"JSON key twice", "json user", "", "application/json", `{"user":"decoy","user":"victim"}`, nil},
		{"JSON over 64 KiB", "json user", "", "application/json", `{"user":"victim","pad":"` + strings.Repeat("x", maxKeyedBody) + `"}`, nil},
		// Regression cases for issue 32 item 4.
		{"form with two content types", "form user", "", formType, `{"user":"victim","x":"&user=decoy"}`, []string{"Content-Type: application/json"}},
		{"JSON with two content types", "json user", "", "application/json", `{"user":"decoy"}`, []string{"Content-Type: " + formType}},
		{"form with a content encoding", "form user", "", formType, "user=decoy", []string{"Content-Encoding: gzip"}},
		{"form in another charset", "form user", "", formType + "; charset=utf-16", "user=decoy", nil},
		{"JSON in another charset", "json user", "", "application/json; charset=utf-7", `{"user":"decoy"}`, nil},
		{"multipart field as an attachment", "form user", "", "multipart/form-data; boundary=X", part("victim", `Content-Disposition: attachment; name="user"`) + part("decoy", `Content-Disposition: form-data; name="user"`) + "--X--\r\n", nil},
		{"multipart field quoted-printable", "form user", "", "multipart/form-data; boundary=X", part("=76ictim", `Content-Disposition: form-data; name="user"`, "Content-Transfer-Encoding: quoted-printable") + "--X--\r\n", nil},
	}
}

func TestBodyKeyersNameNothingWhenOriginsCouldReadAnotherValue(t *testing.T) {
	t.Parallel()
	form := func(field string) Keyer { return &FormKeyer{Field: field} }
	js := func(path string) Keyer { return &JSONKeyer{Path: path} }
	cases := []struct {
		name         string
		keyer        Keyer
		query, ctype string
		body         string
		want         string // "": nothing
	}{
		{"form with a malformed field elsewhere", form("user"), "", formType, "user=victim&z=%zz", ""},
		{"form field also in the query", form("user"), "user=victim", formType, "user=decoy", ""},
		{"form field also in the query, empty", form("user"), "user=", formType, "user=decoy", ""},
		{"form field in the query in another case", form("user"), "USER=victim", formType, "user=decoy", ""},
		{"form with a malformed query", form("user"), "a=1;user=victim", formType, "user=decoy", ""},
		{"form field twice", form("user"), "", formType, "user=decoy&user=victim", ""},
		{"form field twice, once empty", form("user"), "", formType, "user=&user=victim", ""},
		{"form field twice in another case", form("user"), "", formType, "user=decoy&USER=victim", ""},
		{"form over 64 KiB", form("user"), "", formType, "user=victim&pad=" + strings.Repeat("x", maxKeyedBody), ""},
		{"form as text/plain", form("user"), "", "text/plain", "user=victim", ""},
		{"multipart field twice", form("user"), "", "multipart/form-data; boundary=X", "--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n--X\r\nContent-Disposition: form-data; name=\"USER\"\r\n\r\nvictim\r\n--X--\r\n", ""},
		{"multipart field and a file of that name", form("user"), "", "multipart/form-data; boundary=X", "--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n--X\r\nContent-Disposition: form-data; name=\"user\"; filename=\"a\"\r\n\r\nvictim\r\n--X--\r\n", ""},
		{"multipart field also in the query", form("user"), "user=victim", "multipart/form-data; boundary=X", "--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n--X--\r\n", ""},
		{"multipart unterminated after the field", form("user"), "", "multipart/form-data; boundary=X", "--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\nvictim\r\n--X\r\nContent-Disposition: form-data; name=\"pw\"\r\n\r\nsecret", ""},
		{"JSON key twice in another case", js("user"), "", "application/json", `{"user":"decoy","USER":"victim"}`, ""},
		{"JSON key only in another case", js("user"), "", "application/json", `{"User":"victim"}`, ""},
		{"JSON key twice", js("user"), "", "application/json", `{"user":"decoy","user":"victim"}`, ""},
		{"JSON outer key twice", js("user.name"), "", "application/json", `{"user":{"name":"decoy"},"user":{"name":"victim"}}`, ""},
		{"JSON outer key in another case", js("user.name"), "", "application/json", `{"user":{"name":"decoy"},"uSer":{"name":"victim"}}`, ""},
		{"JSON inner key in another case", js("user.name"), "", "application/json", `{"user":{"name":"decoy","NAME":"victim"}}`, ""},
		{"JSON key twice in an indexed element", js("users.0.name"), "", "application/json", `{"users":[{"name":"decoy","name":"victim"}]}`, ""},
		{"JSON malformed after the field", js("user"), "", "application/json", `{"user":"victim","x":[1,}`, ""},
		{"JSON over 64 KiB", js("user"), "", "application/json", `{"user":"victim","pad":"` + strings.Repeat("x", maxKeyedBody) + `"}`, ""},
		{"JSON as text/plain", js("user"), "", "text/plain", `{"user":"victim"}`, ""},
		{"form field in PHP's array syntax", form("user"), "", formType, "user[]=victim&user=decoy", ""},
		{"form field in PHP's spelling", form("user_name"), "", formType, "user.name=victim&user_name=decoy", ""},
		{"form field in the query in PHP's array syntax", form("user"), "user[0]=victim", formType, "user=decoy", ""},
		{"multipart field quoted-printable", form("user"), "", "multipart/form-data; boundary=X", part("=76ictim", `Content-Disposition: form-data; name="user"`, "Content-Transfer-Encoding: quoted-printable") + "--X--\r\n", ""},
		{"multipart field in another charset", form("user"), "", "multipart/form-data; boundary=X", part("victim", `Content-Disposition: form-data; name="user"`, "Content-Type: text/plain; charset=utf-16") + "--X--\r\n", ""},
		{"multipart field as an attachment", form("user"), "", "multipart/form-data; boundary=X", part("victim", `Content-Disposition: attachment; name="user"`) + part("decoy", `Content-Disposition: form-data; name="user"`) + "--X--\r\n", ""},
		{"multipart field with an escaped name", form("user"), "", "multipart/form-data; boundary=X", part("victim", `Content-Disposition: form-data; name="us\er"`) + part("decoy", `Content-Disposition: form-data; name="user"`) + "--X--\r\n", ""},
		{"multipart field with a stray parameter", form("user"), "", "multipart/form-data; boundary=X", part("decoy", `Content-Disposition: form-data; name="user"; x=1`) + "--X--\r\n", ""},
		{"multipart name hiding in a quoted filename", form("user"), "", "multipart/form-data; boundary=X", part("victim", `Content-Disposition: form-data; name="f"; filename="a; name=user"`) + part("decoy", `Content-Disposition: form-data; name="user"`) + "--X--\r\n", ""},
		{"multipart part with no disposition", form("user"), "", "multipart/form-data; boundary=X", part("victim", "Content-Type: text/plain") + part("decoy", `Content-Disposition: form-data; name="user"`) + "--X--\r\n", ""},
		{"multipart boundary after a bare LF", form("user"), "", "multipart/form-data; boundary=X", "--X\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx\n--X\r\nContent-Disposition: form-data; name=\"user\"\r\n\r\nvictim\r\n--X\r\n" + `Content-Disposition: form-data; name="user"` + "\r\n\r\ndecoy\r\n--X--\r\n", ""},
		{"multipart boundary line with trailing space", form("user"), "", "multipart/form-data; boundary=X", "--X \r\nContent-Disposition: form-data; name=\"user\"\r\n\r\ndecoy\r\n--X--\r\n", ""},
		// What stays unambiguous is still named.
		{"multipart field with an unquoted name", form("user"), "", "multipart/form-data; boundary=X", part("alice", `Content-Disposition: form-data; name=user`) + "--X--\r\n", "alice"},
		{"multipart field as text/plain", form("user"), "", "multipart/form-data; boundary=X", part("alice", `Content-Disposition: form-data; name="user"`, "Content-Type: text/plain; charset=UTF-8") + "--X--\r\n", "alice"},
		{"multipart field beside a file", form("user"), "", "multipart/form-data; boundary=X", part("alice", `Content-Disposition: form-data; name="user"`) + part("\x00\xff", "Content-Disposition: form-data; name=\"avatar\"; filename=\"r\u00e9sum\u00e9.png\"", "Content-Type: image/png", "Content-Transfer-Encoding: binary") + "--X--\r\n", "alice"},
		{"multipart field beside a user_name", form("user"), "", "multipart/form-data; boundary=X", part("alice", `Content-Disposition: form-data; name="user"`) + part("x", `Content-Disposition: form-data; name="username"`) + "--X--\r\n", "alice"},
		{"form other fields twice", form("user"), "next=/a", formType, "user=alice&x=1&x=2", "alice"},
		{"form field once in another case", form("user"), "", formType, "User=alice", "alice"},
		{"JSON keys twice off the path", js("user.name"), "", "application/json", `{"a":{"name":1,"name":2},"user":{"name":"alice","id":1,"ID":2}}`, "alice"},
		{"JSON key in another case off the path", js("user.name"), "", "application/json", `{"users":{"Name":"x"},"user":{"name":"alice"}}`, "alice"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := c.keyer.(caddy.Provisioner).Provision(caddy.Context{}); err != nil {
				t.Fatal(err)
			}
			r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/login?"+c.query, strings.NewReader(c.body))
			r.Header.Set("Content-Type", c.ctype)
			got, ok := c.keyer.Key(r, nil)
			if string(got) != c.want || ok != (c.want != "") {
				t.Errorf("Key = %q, %v; want %q", got, ok, c.want)
			}
			if rest, err := io.ReadAll(r.Body); err != nil || string(rest) != c.body {
				t.Errorf("the body downstream differs from the body sent (%d bytes, %v)", len(rest), err)
			}
		})
	}
}

func TestNoKeyDenyRefusesUnkeyableLoginsBeforeTheOrigin(t *testing.T) {
	useFakeClock(t)
	for _, c := range hostileLogins(t) {
		t.Run(c.name, func(t *testing.T) {
			s, o := loginSite(t, c.keyer, "no_key deny")
			r := s.do(http.MethodPost, "/login"+c.query, c.body, append([]string{"X-Forwarded-For: 127.0.0.2", "Content-Type: " + c.ctype}, c.headers...)...)
			if r.status != 400 || r.body != "400 denied" {
				t.Errorf("got %d %q, want 400 with the handle_errors page %q", r.status, r.body, "400 denied")
			}
			if n := o.seen(); n != 0 {
				t.Errorf("the origin saw %d requests, want none", n)
			}
		})
	}
}

func TestNoKeyDenyPassesKeyableLogins(t *testing.T) {
	useFakeClock(t)
	s, o := loginSite(t, "form user", "no_key deny")
	body := "user=alice&password=x"
	r := s.do(http.MethodPost, "/login", body, "X-Forwarded-For: 127.0.0.2", "Content-Type: "+formType)
	if r.status != 200 {
		t.Fatalf("status %d, want 200", r.status)
	}
	got, keyID := o.last(t)
	if string(got) != body || keyID != keyIDOf(bodyKeyerID, "alice") {
		t.Errorf("the origin got %q keyed %s, want %q keyed by the user", got, keyID, body)
	}
}

func TestNoKeyIPKeysUnkeyableLoginsByIP(t *testing.T) {
	useFakeClock(t)
	for _, c := range hostileLogins(t) {
		t.Run(c.name, func(t *testing.T) {
			for _, more := range []string{"", "no_key ip"} {
				s, o := loginSite(t, c.keyer, more)
				r := s.do(http.MethodPost, "/login"+c.query, c.body, append([]string{"X-Forwarded-For: 127.0.0.2", "Content-Type: " + c.ctype}, c.headers...)...)
				if r.status != 200 {
					t.Fatalf("%q: status %d, want 200", more, r.status)
				}
				got, keyID := o.last(t)
				if string(got) != c.body {
					t.Errorf("%q: the origin got %d bytes, want the %d sent, unchanged", more, len(got), len(c.body))
				}
				if want := keyIDOf("ip/32/64", "127.0.0.2"); keyID != want {
					t.Errorf("%q: key id %s, want the client IP's %s", more, keyID, want)
				}
			}
		})
	}
}

func TestLoginFloodFromManyIPsDrainsOneBucketWithNoKeyDeny(t *testing.T) {
	useFakeClock(t)
	s, o := loginSite(t, "form user", "no_key deny")
	attempts := []hostileLogin{{"plain", "form user", "", formType, "user=victim&password=guess", nil}}
	for _, c := range hostileLogins(t) {
		if c.keyer == "form user" {
			attempts = append(attempts, c)
		}
	}
	statuses := map[int]int{}
	for i := range 40 {
		c := attempts[i%len(attempts)]
		ip := fmt.Sprintf("127.0.%d.%d", i/200, 2+i%200)
		r := s.do(http.MethodPost, "/login"+c.query, c.body, append([]string{"X-Forwarded-For: " + ip, "Content-Type: " + c.ctype}, c.headers...)...)
		statuses[r.status]++
	}
	if n := o.seen(); n != 3 {
		t.Errorf("the origin saw %d attempts on victim from 40 IPs, want 3: one bucket", n)
	}
	if statuses[200] != 3 || statuses[200]+statuses[400]+statuses[429] != 40 {
		t.Errorf("statuses %v: want 3 passed, the rest 400 (unkeyable) or 429 (victim's bucket empty)", statuses)
	}
	if _, keyID := o.last(t); keyID != keyIDOf(bodyKeyerID, "victim") {
		t.Errorf("key id %s, want victim's", keyID)
	}
}

func TestNoKeyDenyInDryRunLetsThrough(t *testing.T) {
	useFakeClock(t)
	s, o := loginSite(t, "form user", "no_key deny", "dry_run")
	body := "user=decoy&user=victim"
	r := s.do(http.MethodPost, "/login", body, "X-Forwarded-For: 127.0.0.2", "Content-Type: "+formType)
	if r.status != 200 {
		t.Fatalf("status %d, want 200: a dry run never rejects", r.status)
	}
	if got, _ := o.last(t); string(got) != body {
		t.Errorf("the origin got %q, want %q", got, body)
	}
}

func TestNoKeyCaddyfile(t *testing.T) {
	t.Parallel()
	site := func(lines string) string {
		return "http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n" + lines + "\n\t}\n}\n"
	}
	cfg, err := adaptCaddyfile(site("\t\tkey form user\n\t\tno_key deny"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(cfg), `"no_key":"deny"`) {
		t.Errorf("adapted config lacks \"no_key\":\"deny\":\n%s", cfg)
	}
	for _, c := range []struct{ lines, want string }{
		{"\t\tkey form user\n\t\tno_key maybe", `no_key "maybe": want ip or deny`},
		{"\t\tkey form user\n\t\tno_key", "no_key: want exactly one value"},
		{"\t\tkey form user\n\t\tno_key deny ip", "no_key: want exactly one value"},
		{"\t\tkey form user\n\t\tno_key deny\n\t\tno_key ip", "no_key: given twice"},
		{"\t\tno_key deny", "no_key deny: give a key"},
	} {
		_, err := adaptCaddyfile(site(c.lines))
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "Caddyfile:") {
			t.Errorf("%q: error %v, want one naming the line and containing %q", c.lines, err, c.want)
		}
	}
}

// fuzzBodyKeyer runs a keyer on a body and checks that the body downstream
// is the body sent, and that a value comes only from a body within the cap.
func fuzzBodyKeyer(t *testing.T, k Keyer, ctype string, body []byte, noLength bool) ([]byte, bool) {
	var rd io.Reader = bytes.NewReader(body)
	if noLength {
		rd = chunked{rd}
	}
	r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/", rd)
	if noLength {
		r.ContentLength = -1
	}
	r.Header.Set("Content-Type", ctype)
	v, ok := k.Key(r, nil)
	rest, err := io.ReadAll(r.Body)
	if err != nil || !bytes.Equal(rest, body) {
		t.Fatalf("the body downstream (%d bytes, %v) differs from the body sent (%d bytes)", len(rest), err, len(body))
	}
	if ok && len(body) > maxKeyedBody {
		t.Fatalf("a value from a %d-byte body", len(body))
	}
	if ok && len(v) == 0 {
		t.Fatal("an empty value reported as found")
	}
	return v, ok
}

func FuzzFormKeyer(f *testing.F) {
	mp, mpType := multipartBody(f, map[string]string{"username": "alice"})
	f.Add("application/x-www-form-urlencoded", []byte("username=alice&password=x"), false)
	f.Add("application/x-www-form-urlencoded; charset=utf-8", []byte("username=%zz"), true)
	f.Add(mpType, []byte(mp), false)
	f.Add("text/plain", []byte("username=alice"), false)
	const mpX = "multipart/form-data; boundary=X"
	decoy := part("decoy", `Content-Disposition: form-data; name="username"`) + "--X--\r\n"
	for _, odd := range []string{`attachment; name="username"`, `form-data; name="username"; foo`, `form-data; name="other"; name="username"`, `form-data; name*=utf-8''username`, `form-data; name="f"; filename="a; name=username"`} {
		f.Add(mpX, []byte(part("victim", "Content-Disposition: "+odd)+decoy), false)
	}
	f.Add(mpX, []byte(part("=76ictim", `Content-Disposition: form-data; name="username"`, "Content-Transfer-Encoding: quoted-printable")+"--X--\r\n"), false)
	f.Add(mpX, []byte("--X\nContent-Disposition: form-data; name=\"username\"\n\nvictim\n--X--\n"), false)
	f.Add("application/x-www-form-urlencoded", []byte("username[]=victim&username=decoy"), false)
	f.Add(mpX, []byte("x--X\r\n"+cdUsername+"\r\n\r\nvictim\r\n"+decoy), false)
	f.Add(mpX, []byte(decoy+part("victim", cdUsername)+"--X--\r\n"), false)
	f.Add("multipart/form-data; boundary*=utf-8''Y; boundary=X", []byte(decoy), false)
	f.Add("multipart/form-data; xboundary=Y; boundary=X", []byte(decoy), false)
	f.Add(mpX, []byte(part("victim", `Content-Disposition: form-data; name='username'`)+decoy), false)
	f.Add("application/x-www-form-urlencoded; xcharset=utf-16be", []byte("username=alice"), false)
	f.Add("application/x-www-form-urlencoded", []byte(`{"user":{"name":"victim"},"x":"&username=decoy"}`), false)
	for _, name := range []string{"username%00", "username]", "[username]", "model.Username", "user[name"} {
		f.Add("application/x-www-form-urlencoded", []byte("username=decoy&"+name+"=victim"), false)
	}
	k := &FormKeyer{Field: "username"}
	k.Provision(caddy.Context{})
	f.Fuzz(func(t *testing.T, ctype string, body []byte, noLength bool) {
		v, ok := fuzzBodyKeyer(t, k, ctype, body, noLength)
		if mediaType, params, err := mime.ParseMediaType(ctype); ok && err == nil && mediaType == "multipart/form-data" {
			// Go's own reading of the form, which decodes and skips parts
			// more leniently, finds the field once, with that value, and
			// every part is form-data.
			mr := multipart.NewReader(bytes.NewReader(body), params["boundary"])
			var values []string
			for {
				p, err := mr.NextPart()
				if err != nil {
					break
				}
				if d, _, err := mime.ParseMediaType(p.Header.Get("Content-Disposition")); err != nil || d != "form-data" {
					t.Fatalf("value %q from a body with a part whose disposition is %q", v, p.Header.Get("Content-Disposition"))
				}
				if strings.EqualFold(p.FormName(), "username") {
					b, _ := io.ReadAll(p)
					values = append(values, string(b))
				}
			}
			if len(values) != 1 || values[0] != string(v) {
				t.Fatalf("value %q, but Go's multipart reader finds the field as %q", v, values)
			}
			// No preamble, where werkzeug could find a part.
			if !bytes.HasPrefix(body, []byte("--"+params["boundary"]+"\r\n")) {
				t.Fatalf("value %q from a multipart body that does not open with its boundary", v)
			}
		}
		if ok && strings.HasPrefix(ctype, "application/x-www-form-urlencoded") && json.Valid(body) {
			t.Fatalf("value %q from a form that is also a JSON document", v)
		}
		if ok && (strings.Contains(strings.ToLower(ctype), "xcharset") || strings.Contains(strings.ToLower(ctype), "xboundary")) {
			t.Fatalf("value %q from a Content-Type with a parameter that lenient parsers misread: %q", v, ctype)
		}
		if ok && strings.HasPrefix(ctype, "application/x-www-form-urlencoded") {
			form, err := url.ParseQuery(string(body))
			var values []string
			for name, vs := range form {
				if strings.EqualFold(name, "username") {
					values = append(values, vs...)
				}
			}
			if err != nil || len(values) != 1 || values[0] != string(v) {
				t.Fatalf("value %q, but the form parses as %v, %v: want the field once", v, form, err)
			}
		}
	})
}

func FuzzJSONKeyer(f *testing.F) {
	f.Add([]byte(`{"user":{"name":"alice"}}`), false)
	f.Add([]byte(`{"user":{"name":12e-1}}`), true)
	f.Add([]byte(`{"user":{"name":["a"]}}`), false)
	f.Add([]byte(`{"user":`), false)
	k := &JSONKeyer{Path: "user.name"}
	k.Provision(caddy.Context{})
	f.Fuzz(func(t *testing.T, body []byte, noLength bool) {
		v, ok := fuzzBodyKeyer(t, k, "application/json", body, noLength)
		if !ok {
			return
		}
		var doc map[string]any
		dec := json.NewDecoder(bytes.NewReader(body))
		dec.UseNumber()
		if err := dec.Decode(&doc); err != nil {
			t.Fatalf("value %q from a body that does not parse: %v", v, err)
		}
		if !json.Valid(body) {
			t.Fatalf("value %q from a body that is not one JSON document", v)
		}
		user, _ := doc["user"].(map[string]any)
		if s, _ := jsonScalar(user["name"]); s != string(v) {
			t.Fatalf("value %q, but user.name is %v", v, user["name"])
		}
		for _, c := range []struct {
			obj  map[string]any
			name string
		}{{doc, "user"}, {user, "name"}} {
			for key := range c.obj {
				if key != c.name && strings.EqualFold(key, c.name) {
					t.Fatalf("value %q, but the path's key %q is also given as %q", v, c.name, key)
				}
			}
		}
	})
}

// guess is one login attempt of an attack: its body and the headers that
// go with it, and a query string for /login, such as "?a=1".
type guess struct {
	ctype, body string
	headers     []string
	query       string
}

// guessSite is the login that issue 32's attack was tried on: 3 failed
// attempts an hour per account, no_key deny, count_status 401 and ban 15m,
// in front of an origin that refuses every guess with 401.
func guessSite(t *testing.T, keys ...string) (*testServer, *origin) {
	t.Helper()
	o := newOriginAnswering(t, http.StatusUnauthorized)
	s := serve(t, fmt.Sprintf(`
	rate_limit 3 1/h {
		key %s
		no_key deny
		count_status 401
		ban 15m
	}
	reverse_proxy %s`, strings.Join(keys, "\n\t\tkey "), strings.TrimPrefix(o.URL, "http://")))
	return s, o
}

// sendGuesses posts n guesses to /login, the i-th made by attempt(i) and
// sent from its own address, and returns how many reached the origin.
func sendGuesses(t *testing.T, s *testServer, o *origin, n int, attempt func(i int) guess) int {
	t.Helper()
	before := o.seen()
	for i := range n {
		g := attempt(i)
		headers := append([]string{fmt.Sprintf("X-Forwarded-For: 127.0.1.%d", 2+i)}, g.headers...)
		if g.ctype != "" {
			headers = append(headers, "Content-Type: "+g.ctype)
		}
		s.do(http.MethodPost, "/login"+g.query, g.body, headers...)
	}
	return o.seen() - before
}

// part is one part of a multipart body with the boundary X.
func part(value string, headers ...string) string {
	return "--X\r\n" + strings.Join(headers, "\r\n") + "\r\n\r\n" + value + "\r\n"
}

// Regression test for issue 32 item 1: werkzeug reads a part whose
// disposition Go's FormName skips.
func TestMultipartPartsTheKeyerCannotReadNameNobody(t *testing.T) {
	useFakeClock(t)
	for _, c := range []struct {
		name  string
		first []string // the headers of the part that holds the victim's name
	}{
		{"attachment", []string{`Content-Disposition: attachment; name="username"`}},
		{"inline", []string{`Content-Disposition: inline; name="username"`}},
		{"a stray parameter", []string{`Content-Disposition: form-data; name="username"; foo`}},
		{"an unterminated quote", []string{`Content-Disposition: form-data; name="username`}},
		{"the name parameter twice", []string{`Content-Disposition: form-data; name="other"; name="username"`}},
		{"an RFC 2231 name", []string{`Content-Disposition: form-data; name*=utf-8''username`}},
		{"two dispositions", []string{`Content-Disposition: form-data; name="other"`, `Content-Disposition: form-data; name="username"`}},
		{"a name with a trailing space", []string{`Content-Disposition: form-data; name="username "`}},
		{"a percent-encoded name", []string{`Content-Disposition: form-data; name="user%6eame"`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s, o := guessSite(t, "form username")
			got := sendGuesses(t, s, o, 10, func(i int) guess {
				body := part("victim", c.first...) + part(fmt.Sprintf("decoy%d", i), `Content-Disposition: form-data; name="username"`) + "--X--\r\n"
				return guess{ctype: "multipart/form-data; boundary=X", body: body}
			})
			if got > 3 {
				t.Errorf("%d of 10 guesses on victim reached the origin, want at most the bucket's 3", got)
			}
		})
	}
}

// Regression test for issue 32 item 5.
func TestNormalizeGivesEachUsernameOneBucket(t *testing.T) {
	useFakeClock(t)
	type sender func(v string) guess
	form := func(v string) guess {
		return guess{ctype: formType, body: url.Values{"username": {v}, "password": {"guess"}}.Encode()}
	}
	js := func(v string) guess {
		return guess{ctype: "application/json", body: `{"user":{"name":` + strconv.Quote(v) + `}}`}
	}
	header := func(v string) guess { return guess{headers: []string{"X-User: " + v}} }
	cookie := func(v string) guess { return guess{headers: []string{"Cookie: user=" + v}} }
	dave := []string{"dave", "Dave", "DAVE", " dave ", "\uff44\uff41\uff56\uff45"}
	jose := []string{"jos\u00e9", "jose\u0301", "JOS\u00c9", "\uff2a\uff4f\uff53\u00e9"}
	for _, c := range []struct {
		key      string
		send     sender
		variants [][]string
		rejected string
	}{
		{"form username normalize", form, [][]string{dave, jose}, "da ve"},
		{"json user.name normalize", js, [][]string{dave, jose}, "da ve"},
		{"header X-User normalize", header, [][]string{dave, jose}, "da ve"},
		{"cookie user normalize", cookie, [][]string{{"dave", "Dave", "DAVE", `"dAvE"`}}, ""}, // a cookie holds no space
	} {
		t.Run(c.key, func(t *testing.T) {
			s, o := guessSite(t, c.key)
			for _, names := range c.variants {
				if got := sendGuesses(t, s, o, len(names), func(i int) guess { return c.send(names[i]) }); got != 3 {
					t.Errorf("%d of the %d spellings %q reached the origin, want the one bucket's 3", got, len(names), names)
				}
			}
			if c.rejected == "" {
				return
			}
			if got := sendGuesses(t, s, o, 1, func(int) guess { return c.send(c.rejected) }); got != 0 {
				t.Errorf("%q, which the profile rejects, reached the origin: it must name nobody, so that no_key deny refuses it", c.rejected)
			}
		})
	}
	cfg, err := adaptCaddyfile("http://127.0.0.1:1 {\n\trate_limit 10 1/s {\n\t\tkey form username normalize\n\t}\n}\n")
	if err != nil || !strings.Contains(string(cfg), `{"field":"username","keyer":"form","normalize":true}`) {
		t.Errorf("adapted: %v\n%s", err, cfg)
	}
}

// Regression test for issue 31 item 2: the body keyers name a user in one
// namespace, whatever the body's encoding.
func TestFormAndJSONAttemptsOnOneUserShareOneBucket(t *testing.T) {
	useFakeClock(t)
	s, o := guessSite(t, "form username", "json user.name")
	attempts := []guess{
		{ctype: formType, body: "username=alice&password=1"},
		{ctype: "application/json", body: `{"user":{"name":"alice"},"password":"2"}`},
		{ctype: "multipart/form-data; boundary=X", body: part("alice", `Content-Disposition: form-data; name="username"`) + "--X--\r\n"},
		{ctype: "application/json", body: `{"user":{"name":"alice"},"password":"4"}`},
		{ctype: formType, body: "username=alice&password=5"},
	}
	if got := sendGuesses(t, s, o, len(attempts), func(i int) guess { return attempts[i] }); got != 3 {
		t.Errorf("%d of 5 attempts on alice, in form and JSON bodies, reached the origin; want the one bucket's 3", got)
	}
}

// loginRecipe is docs/logins.md's login form recipe, the block that counts
// failures, with the site and the origin replaced by the test's.
func loginRecipe(t *testing.T, port int, origin string) string {
	t.Helper()
	for _, b := range caddyfileBlocks(t, filepath.Join("docs", "logins.md")) {
		if strings.Contains(b.text, "count_status 401") && strings.Contains(b.text, "login_by_user") {
			site := strings.Replace(b.text, "http://127.0.0.1:8080", fmt.Sprintf("http://127.0.0.1:%d", port), 1)
			return "{\n\tadmin off\n\tskip_install_trust\n}\n" + strings.ReplaceAll(site, "127.0.0.1:9000", origin)
		}
	}
	t.Fatal("docs/logins.md has no login form recipe with count_status 401")
	return ""
}

// Regression test for issue 32 item 6: origins route these paths to their
// login handler (Express folds case and a trailing slash, Spring drops ;
// parameters and suffixes, Tomcat resolves /..;/), so the recipe must
// limit them all.
func TestLoginRecipeLimitsEveryPathTheOriginRoutesToItsLogin(t *testing.T) {
	useFakeClock(t)
	o := newOriginAnswering(t, http.StatusUnauthorized)
	port := freePort(t)
	s := serveCaddyfile(t, port, loginRecipe(t, port, strings.TrimPrefix(o.URL, "http://")))
	paths := []string{
		"/login", "/LOGIN", "/Login/", "/login/", "/login;x", "/login;jsessionid=1", "/login.",
		"/login.json", "/login%2f", "/login%2F", "/login%20", "/login%5c", "/login%3b", "//login",
		"/./login", "/a/../login", "/x/..;/login", "/;x/login", "/x/.;/login",
	}
	for i, p := range paths {
		r := s.do(http.MethodPost, p, "username=alice&password=guess", "Content-Type: "+formType)
		if r.status != http.StatusUnauthorized && r.status != http.StatusTooManyRequests {
			t.Errorf("attempt %d, %s: %d, want 401 from the origin or 429 from the limiter", i+1, p, r.status)
		}
	}
	if got := o.seen(); got != 5 {
		t.Errorf("%d of %d attempts on alice reached the origin, want the recipe's 5", got, len(paths))
	}
	// Paths that are not the login pass unlimited.
	for _, p := range []string{"/", "/logins", "/login-help", "/loginx", "/static/login.css"} {
		if r := s.do(http.MethodGet, p, ""); r.status != http.StatusUnauthorized {
			t.Errorf("GET %s: %d, want the origin's 401: not the login", p, r.status)
		}
	}
}

// attack is a way to send one account's name to an origin parser while a
// keyer reads a decoy: attempt(i) names victim to that parser and decoy<i>
// to the keyer, so a keyer that reads it names a fresh bucket each time.
type attack struct {
	name    string // what the origin parser does with it
	keys    []string
	attempt func(i int) guess
}

// expectOneBucket sends each attack's 10 guesses to guessSite and checks
// that at most its bucket's 3 reach the origin.
func expectOneBucket(t *testing.T, attacks []attack) {
	t.Helper()
	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) {
			s, o := guessSite(t, a.keys...)
			if got := sendGuesses(t, s, o, 10, a.attempt); got > 3 {
				t.Errorf("%d of 10 guesses on victim reached the origin, want at most the bucket's 3", got)
			}
		})
	}
}

const cdUsername = `Content-Disposition: form-data; name="username"`

// Multipart parsers differ on where parts begin and end and on what the
// boundary is: werkzeug (Flask) starts a part at a delimiter anywhere in
// the preamble, even mid-line; PHP reads on past the closing delimiter and
// takes its boundary from the first "boundary" in the Content-Type, in any
// parameter; werkzeug and Rack take the plain boundary parameter where Go
// takes its RFC 2231 form; PHP unquotes a name in single quotes.
func TestMultipartBodiesThatOriginsSplitAnotherWayNameNobody(t *testing.T) {
	useFakeClock(t)
	decoy := func(i int) string { return part(fmt.Sprintf("decoy%d", i), cdUsername) }
	mp := "multipart/form-data; boundary=X"
	expectOneBucket(t, []attack{
		{"werkzeug starts a part at a delimiter inside the preamble", []string{"form username"}, func(i int) guess {
			return guess{ctype: mp, body: "x--X\r\n" + cdUsername + "\r\n\r\nvictim\r\n" + decoy(i) + "--X--\r\n"}
		}},
		{"PHP reads parts after the closing delimiter, the last name winning", []string{"form username"}, func(i int) guess {
			return guess{ctype: mp, body: decoy(i) + "--X--\r\n" + part("victim", cdUsername) + "--X--\r\n"}
		}},
		{"werkzeug takes the plain boundary where Go takes boundary*", []string{"form username"}, func(i int) guess {
			y := strings.ReplaceAll(decoy(i), "--X", "--Y") + "--Y--\r\n"
			return guess{ctype: "multipart/form-data; boundary*=utf-8''Y; boundary=X", body: part("victim", cdUsername) + "--X--\r\n" + y}
		}},
		{"PHP takes the boundary of the first parameter that holds the word", []string{"form username"}, func(i int) guess {
			y := strings.ReplaceAll(part("victim", cdUsername), "--X", "--Y") + "--Y--\r\n"
			return guess{ctype: "multipart/form-data; xboundary=Y; boundary=X", body: y + decoy(i) + "--X--\r\n"}
		}},
		{"PHP unquotes a name in single quotes, the last name winning", []string{"form username"}, func(i int) guess {
			return guess{ctype: mp, body: decoy(i) + part("victim", `Content-Disposition: form-data; name='username'`) + "--X--\r\n"}
		}},
	})
}

// Frameworks read other names as the field: PHP ends a name at a NUL byte
// and reads "user[name" as user_name; Rack 2 (Rails before Rack 3) drops
// brackets around a name; ASP.NET Core binds model.Username to the
// property Username of an action's parameter named model (its login
// template's), before a bare Username. Each takes that value over the
// plain field's. PHP's $_REQUEST, where no php.ini sets request_order (as
// in the official Docker images), merges the cookies over the body.
func TestFormFieldNamesThatOriginsReadAsTheFieldNameNobody(t *testing.T) {
	useFakeClock(t)
	form := func(other string) func(i int) guess {
		return func(i int) guess {
			return guess{ctype: formType, body: fmt.Sprintf("username=decoy%d&%s=victim", i, other)}
		}
	}
	expectOneBucket(t, []attack{
		{"PHP ends a name at a NUL byte", []string{"form username"}, form("username%00")},
		{"Rack 2 drops a bracket after a name", []string{"form username"}, form("username]")},
		{"Rack 2 drops brackets around a name", []string{"form username"}, form("[username]")},
		{"ASP.NET Core binds a prefixed name first", []string{"form username"}, form("model.Username")},
		{"PHP reads user[name as user_name", []string{"form user_name"}, func(i int) guess {
			return guess{ctype: formType, body: fmt.Sprintf("user_name=decoy%d&user[name=victim", i)}
		}},
		{"PHP's $_REQUEST, with no php.ini, takes a cookie over the body", []string{"form username"}, func(i int) guess {
			return guess{ctype: formType, body: fmt.Sprintf("username=decoy%d", i), headers: []string{"Cookie: username=victim"}}
		}},
	})
}

// Rails merges the query string over the body, JSON or form, top-level
// keys of the query winning: params[:user][:name] is the query's.
func TestAJSONFieldAlsoInTheQueryNamesNobody(t *testing.T) {
	useFakeClock(t)
	expectOneBucket(t, []attack{
		{"Rails reads the query's user[name] over the JSON body's", []string{"json user.name"}, func(i int) guess {
			return guess{ctype: "application/json", query: "?user%5Bname%5D=victim", body: fmt.Sprintf(`{"user":{"name":"decoy%d"}}`, i)}
		}},
	})
}

// Origins that parse JSON whatever the Content-Type says (Flask's
// request.get_json(force=True), Express's express.json({type: "*/*"}))
// read a urlencoded body that is also a JSON document as JSON.
func TestAFormBodyThatIsAlsoJSONNamesNobody(t *testing.T) {
	useFakeClock(t)
	expectOneBucket(t, []attack{
		{"an origin that parses every body as JSON", []string{"form username", "json user.name"}, func(i int) guess {
			return guess{ctype: formType, body: fmt.Sprintf(`{"user":{"name":"victim"},"x":"&username=decoy%d"}`, i)}
		}},
	})
}

// Rails and PHP forms nest a login's fields: user[name] and
// user[password]. The keyer of user[name] must name the user of such a
// form, not refuse it because user[password] shares the prefix.
func TestANestedFormFieldNamesTheUserBesideItsSiblings(t *testing.T) {
	useFakeClock(t)
	s, o := guessSite(t, "form user[name]")
	got := sendGuesses(t, s, o, 10, func(i int) guess {
		return guess{ctype: formType, body: fmt.Sprintf("user%%5Bname%%5D=alice&user%%5Bpassword%%5D=guess%d", i)}
	})
	if got != 3 {
		t.Errorf("%d of 10 attempts on alice from a Rails login form reached the origin, want the one bucket's 3", got)
	}
}

// MySQL's and MariaDB's default collations (utf8mb4_0900_ai_ci,
// utf8mb4_general_ci) ignore accents, so an origin that looks a username up
// in them finds dave for each of these; normalize must not give each its
// own bucket.
func TestNormalizeGivesAccentedSpellingsOfOneUsernameOneBucket(t *testing.T) {
	useFakeClock(t)
	spellings := []string{"dave", "d\u00e0ve", "d\u00e1ve", "d\u00e2ve", "d\u00e4ve", "d\u00e3ve", "d\u00e5ve", "dav\u00e9", "dav\u00e8", "dave\u0301\u0301"}
	expectOneBucket(t, []attack{
		{"an origin whose database ignores accents", []string{"form username normalize"}, func(i int) guess {
			return guess{ctype: formType, body: url.Values{"username": {spellings[i]}, "password": {"guess"}}.Encode()}
		}},
	})
}

// Attacks that the body keyers already read as origins do, or refuse: each
// sends victim beside a decoy in a spelling some parser reads as the field.
func TestBodySpellingsThatOriginsReadAlikeGiveNoFreshBuckets(t *testing.T) {
	useFakeClock(t)
	body := func(ctype, format string) func(i int) guess {
		return func(i int) guess { return guess{ctype: ctype, body: fmt.Sprintf(format, i)} }
	}
	mp := "multipart/form-data; boundary=X"
	decoyPart := func(i int) string { return part(fmt.Sprintf("decoy%d", i), cdUsername) }
	multipart := func(tail string) func(i int) guess {
		return func(i int) guess { return guess{ctype: mp, body: decoyPart(i) + tail} }
	}
	expectOneBucket(t, []attack{
		{"a JSON key spelled with a unicode escape", []string{"json username"}, body("application/json", `{"username":"decoy%d","\u0075sername":"victim"}`)},
		{"a JSON body after a byte order mark", []string{"json username"}, body("application/json", "\ufeff{\"username\":\"decoy%d\"}")},
		{"JSON with a comment", []string{"json username"}, body("application/json", `{"username":"decoy%d" /* , "username":"victim" */}`)},
		{"JSON with NaN", []string{"json username"}, body("application/json", `{"username":"decoy%d","n":NaN}`)},
		{"a form name percent-encoded", []string{"form username"}, body(formType, "username=decoy%d&user%%6eame=victim")},
		{"a form name with a space before it", []string{"form username"}, body(formType, "username=decoy%d&+username=victim")},
		{"a form name with a space after it", []string{"form username"}, body(formType, "username=decoy%d&username%%20=victim")},
		{"a form with ; between fields", []string{"form username"}, body(formType, "username=decoy%d;username=victim")},
		{"a form field as an array", []string{"form username"}, body(formType, "username=decoy%d&username[0]=victim")},
		{"multipart boundary lines ending in LF", []string{"form username"}, func(i int) guess {
			return guess{ctype: mp, body: fmt.Sprintf("--X\n%s\n\ndecoy%d\n--X\n%s\n\nvictim\n--X--\n", cdUsername, i, cdUsername)}
		}},
		{"a multipart name folded onto a second line", []string{"form username"}, multipart(part("victim", "Content-Disposition: form-data;\r\n name=\"username\"") + "--X--\r\n")},
		{"a multipart name in filename*", []string{"form username"}, multipart(part("victim", `Content-Disposition: form-data; name="username"; filename*=utf-8''a`) + "--X--\r\n")},
		{"a multipart part in Latin-1", []string{"form username"}, multipart(part("victim", cdUsername, "Content-Type: text/plain; charset=iso-8859-1") + "--X--\r\n")},
		{"a nested multipart/mixed part", []string{"form username"}, multipart(part("--Z\r\n"+cdUsername+"\r\n\r\nvictim\r\n--Z--", cdUsername, "Content-Type: multipart/mixed; boundary=Z") + "--X--\r\n")},
		{"a multipart part header given twice", []string{"form username"}, multipart(part("victim", cdUsername, "Content-Type: text/plain", "Content-Type: application/json") + "--X--\r\n")},
	})
}

// More spellings of the login's path, which Caddy decodes and cleans before
// the recipe's matcher reads them, and another method: each is limited.
func TestLoginRecipeLimitsMoreSpellingsOfItsPath(t *testing.T) {
	useFakeClock(t)
	o := newOriginAnswering(t, http.StatusUnauthorized)
	port := freePort(t)
	s := serveCaddyfile(t, port, loginRecipe(t, port, strings.TrimPrefix(o.URL, "http://")))
	attempts := []struct{ method, path string }{
		{"POST", "/%6Cogin"}, {"POST", "/LoGiN;JSESSIONID=1"}, {"POST", "/login%00"}, {"POST", "/login/."},
		{"POST", "/api/../login"}, {"POST", "/api/..%2Flogin"}, {"POST", "/x/%2e%2e;/login"}, {"POST", "/login%252f"},
		{"POST", "/login?next=/"}, {"PUT", "/login"}, {"PATCH", "/Login/"},
	}
	for i, a := range attempts {
		r := s.do(a.method, a.path, "username=alice&password=guess", "Content-Type: "+formType)
		if r.status != http.StatusUnauthorized && r.status != http.StatusTooManyRequests {
			t.Errorf("attempt %d, %s %s: %d, want 401 from the origin or 429 from the limiter", i+1, a.method, a.path, r.status)
		}
	}
	if got := o.seen(); got != 5 {
		t.Errorf("%d of %d attempts on alice reached the origin, want the recipe's 5", got, len(attempts))
	}
}

// utf16Form writes s as UTF-16BE bytes, percent-encoded: a servlet
// container that reads the form in UTF-16 decodes it to s.
func utf16Form(s string) string {
	var b strings.Builder
	for _, c := range s {
		fmt.Fprintf(&b, "%%00%c", c)
	}
	return b.String()
}

// Servlet containers take a form's charset from the first "charset=" in
// the Content-Type, in whatever parameter it stands (Tomcat's
// getCharsetFromContentType), and decode the fields in it.
func TestAFormInTheCharsetOfAnotherParameterNamesNobody(t *testing.T) {
	useFakeClock(t)
	expectOneBucket(t, []attack{
		{"Tomcat decodes the form in the charset of xcharset", []string{"form username"}, func(i int) guess {
			return guess{ctype: formType + "; xcharset=utf-16be", body: fmt.Sprintf("%s=%s&username=decoy%d", utf16Form("username"), utf16Form("victim"), i)}
		}},
	})
}

// The login forms that frameworks and clients send, with their siblings,
// cookies and Content-Types, still name their user: the rules that make
// lookalike names and odd bodies name nobody leave them alone.
func TestLoginFormsOfCommonFrameworksStillNameTheirUser(t *testing.T) {
	t.Parallel()
	mp, mpType := multipartBody(t, map[string]string{"username": "alice", "password": "x", "remember": "on"})
	const quotedBoundary = "multipart/form-data; charset=utf-8; boundary=\"b-1.2_3\""
	for _, c := range []struct {
		name, key, query, ctype, body string
		cookies                       string
	}{
		{"Rails", "form user[email]", "", formType, "authenticity_token=t0k&user%5Bemail%5D=alice&user%5Bpassword%5D=x&user%5Bremember_me%5D=0&commit=Log+in", "_app_session=abc"},
		{"ASP.NET Core Identity", "form Input.Email", "ReturnUrl=%2F", formType, "Input.Email=alice&Input.Password=x&Input.RememberMe=false&__RequestVerificationToken=t0k", ".AspNetCore.Antiforgery.x1=t0k; .AspNetCore.Session=s"},
		{"Django", "form username", "next=/", formType, "csrfmiddlewaretoken=t0k&username=alice&password=x", "csrftoken=t0k; sessionid=s"},
		{"Laravel", "form email", "", formType + "; charset=UTF-8", "_token=t0k&email=alice&password=x&remember=on", "XSRF-TOKEN=t0k; laravel_session=s"},
		{"PHP with a remembered username", "form username", "", formType, "username=alice&password=x&remember[]=1", "PHPSESSID=s; username=alice"},
		{"a multipart form", "form username", "", mpType, mp, ""},
		{"a multipart form with a quoted boundary", "form username", "", quotedBoundary, "--b-1.2_3\r\n" + cdUsername + "\r\n\r\nalice\r\n--b-1.2_3--\r\n", ""},
		{"a JSON login", "json user.name", "next=/home", "application/json; charset=utf-8", `{"user":{"name":"alice","password":"x"}}`, "session=s"},
	} {
		t.Run(c.name, func(t *testing.T) {
			kind, field, _ := strings.Cut(c.key, " ")
			var k Keyer = &FormKeyer{Field: field}
			if kind == "json" {
				k = &JSONKeyer{Path: field}
			}
			if err := k.(caddy.Provisioner).Provision(caddy.Context{}); err != nil {
				t.Fatal(err)
			}
			r := httptest.NewRequest(http.MethodPost, "http://127.0.0.1/login?"+c.query, strings.NewReader(c.body))
			r.Header.Set("Content-Type", c.ctype)
			if c.cookies != "" {
				r.Header.Set("Cookie", c.cookies)
			}
			if got, ok := k.Key(r, nil); !ok || string(got) != "alice" {
				t.Errorf("Key = %q, %v; want alice", got, ok)
			}
		})
	}
}
