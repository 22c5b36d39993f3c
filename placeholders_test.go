package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The {http.rate_limit.*} placeholders (placeholders.go).

// With three rate_limit handlers stacked on a route, the placeholders
// answer the last one the request went through: the third when all allow,
// the one that refused when one does (the handlers after it never run);
// a route with one handler answers its own.
// Regression test for 3cb8e39.
func TestPlaceholdersAnswerTheLastOfThreeStackedHandlers(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	route /three {
		rate_limit 10 1/h {
			name first
		}
		rate_limit 5 1/h {
			name second
		}
		rate_limit 2 1/h {
			name third
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining} {http.rate_limit.decision}"
	}
	route /one {
		rate_limit 7 1/h {
			name alone
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining}"
	}
	handle_errors 429 {
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.decision} {http.rate_limit.retry_after}" 429
	}`)
	for i, want := range []string{"third 2 1 allowed", "third 2 0 allowed"} {
		if r := s.get("/three"); r.status != 200 || r.body != want {
			t.Fatalf("request %d: %d %q, want 200 %q", i+1, r.status, r.body, want)
		}
	}
	if r := s.get("/three"); r.status != 429 || r.body != "third 2 denied 3600" {
		t.Errorf("refused by the third: %d %q, want 429 %q", r.status, r.body, "third 2 denied 3600")
	}
	if r := s.get("/one"); r.status != 200 || r.body != "alone 7 6" {
		t.Errorf("a lone handler: %d %q, want 200 %q", r.status, r.body, "alone 7 6")
	}
}

// docs/caddyfile.md's problem+json body of a 429 (its "Shaping the
// rejection") under two stacked rate_limit handlers, as docs/logins.md
// stacks them: when the first allows and the second refuses, the body
// names the second's policy, limit and retry time, as Retry-After does.
// Regression test for a74481c.
func TestTheProblemBodyOfStackedHandlersNamesTheOneThatRefused(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	route /login {
		rate_limit 5 1/h {
			name login_by_user
			key header X-User
		}
		rate_limit 1 1/m {
			name login_by_ip
		}
		respond "ok"
	}
	handle_errors 429 {
		header Content-Type application/problem+json
		respond `+"`"+`{"type": "about:blank", "title": "Too Many Requests", "status": 429, "policy": "{http.rate_limit.policy}", "tier": "{http.rate_limit.tier}", "limit": {http.rate_limit.limit}, "retry_after": {http.rate_limit.retry_after}}`+"`"+` 429
	}`)
	if r := s.get("/login", "X-User: ann"); r.status != 200 {
		t.Fatalf("first attempt: %d, want 200", r.status)
	}
	r := s.get("/login", "X-User: bob")
	if r.status != 429 {
		t.Fatalf("second attempt from the same address: %d, want 429 from login_by_ip", r.status)
	}
	var body struct {
		Policy     string `json:"policy"`
		Limit      int    `json:"limit"`
		RetryAfter int    `json:"retry_after"`
	}
	if err := json.Unmarshal([]byte(r.body), &body); err != nil {
		t.Fatalf("the problem body is not JSON: %v\n%s", err, r.body)
	}
	if ra := r.header.Get("Retry-After"); strconv.Itoa(body.RetryAfter) != ra || body.Policy != "login_by_ip" || body.Limit != 1 {
		t.Errorf("refused by login_by_ip (limit 1, Retry-After %s), the problem body says policy %q, limit %d, retry_after %d: the placeholders are the first handler's\n%s",
			ra, body.Policy, body.Limit, body.RetryAfter, r.body)
	}
}

// When Redis cannot count a concurrency tier's requests in flight and
// on_store_error is deny, the 503's {http.rate_limit.limit} and
// {http.rate_limit.retry_after} are empty, as docs/caddyfile.md ("Shaping
// the rejection") says of a failed store. Redis is an address nothing
// listens on, so no redis-server is needed.
// Regression test for 3cb8e39.
func TestAFailedSlotStoreLeavesTheLimitAndRetryPlaceholdersEmpty(t *testing.T) {
	useFakeClock(t)
	s := serve(t, fmt.Sprintf(`
	rate_limit {
		tier all {
			concurrency 2
		}
		store redis {
			address redis://127.0.0.1:%d
			timeout 50ms
		}
		on_store_error deny
	}
	respond "ok"
	handle_errors 503 {
		respond "limit=[{http.rate_limit.limit}] retry_after=[{http.rate_limit.retry_after}]" 503
	}`, freePort(t)))
	r := s.get("/")
	if r.status != 503 {
		t.Fatalf("with Redis down and on_store_error deny: %d %q, want 503", r.status, r.body)
	}
	if want := "limit=[] retry_after=[]"; r.body != want {
		t.Errorf("503 with Retry-After %q: the placeholders read %q; docs/caddyfile.md says a failed store leaves them empty (%q)", r.header.Get("Retry-After"), r.body, want)
	}
}

// A vars directive whose name is the client's (a query value) cannot take
// the request variable the stacked handlers share: a client who names it
// neither breaks the request nor turns the placeholders to the first
// handler's.
func TestAClientNamedVarNeitherBreaksNorRedirectsStackedPlaceholders(t *testing.T) {
	useFakeClock(t)
	s := serve(t, `
	route /stacked {
		vars {query.a} x
		rate_limit 10 1/h {
			name first
		}
		vars {query.b} y
		rate_limit 5 1/h {
			name second
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining}"
	}`)
	const name = "%00rate_limit.decision"
	for _, q := range []string{"a=" + name, "b=" + name, "a=" + name + "&b=" + name, "a=z"} {
		if r := s.get("/stacked?" + q); r.status != 200 || !strings.HasPrefix(r.body, "second 5 ") {
			t.Errorf("?%s: %d %q, want 200 from the second handler's placeholders", q, r.status, r.body)
		}
	}
}

// Stacked handlers in nested routes and a handle block, with a vars
// handler that sets the handlers' shared variable to a string before the
// first and between the second and third (a config can name it in JSON;
// a client through a query): the placeholders answer the last handler,
// the one that refused once one does, and the response never fails.
func TestNestedStackedHandlersAnswerTheLastWhateverTheVarsHold(t *testing.T) {
	useFakeClock(t)
	port := freePort(t)
	caddyfile := siteCaddyfile("admin off", port, `
	route /nested {
		vars RLDECISION before
		vars {query.a} x
		rate_limit 10 1/h {
			name nested_first
		}
		route {
			rate_limit 5 1/h {
				name nested_second
			}
			vars RLDECISION between
			vars {query.b} y
			handle /nested {
				rate_limit 3 1/h {
					name nested_third
				}
			}
		}
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.remaining} {vars.RLDECISION}"
	}
	handle_errors 429 {
		respond "{http.rate_limit.policy} {http.rate_limit.limit} {http.rate_limit.decision}" 429
	}`)
	cfg, err := adaptCaddyfile(caddyfile)
	if err != nil {
		t.Fatal(err)
	}
	quoted, _ := json.Marshal(decisionVar)
	named := strings.ReplaceAll(string(cfg), `"RLDECISION"`, string(quoted))
	if named == string(cfg) {
		t.Fatalf("the adapted config names no RLDECISION variable:\n%s", cfg)
	}
	for _, c := range []struct {
		name string
		cfg  string
	}{
		{"vars naming another variable", string(cfg)},
		{"vars naming the handlers' variable", named},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := serveConfig(t, port, []byte(c.cfg))
			const q = "%00rate_limit.decision"
			queries := []string{"", "a=" + q, "b=" + q, "a=" + q + "&b=" + q}
			for i, query := range queries {
				r := s.get("/nested?" + query)
				want := fmt.Sprintf("nested_third 3 %d ", 2-i)
				if i >= 3 {
					if r.status != 429 || r.body != "nested_third 3 denied" {
						t.Errorf("?%s: %d %q, want the third's refusal", query, r.status, r.body)
					}
					continue
				}
				if r.status != 200 || !strings.HasPrefix(r.body, want) {
					t.Errorf("?%s: %d %q, want 200 from the third handler: %q", query, r.status, r.body, want)
				}
			}
		})
	}
}

// Two handlers stacked on a request that came through no Caddy server,
// with a replacer and no vars map, answer from the second; a request with
// neither is limited and answers nothing, without a panic.
func TestStackedHandlersWithoutVarsAnswerTheLast(t *testing.T) {
	t.Parallel()
	first, done1 := provisionedHandler(t, `{"name":"novars_first","tiers":[{"name":"default","capacity":10,"refill":"1/h"}]}`)
	defer done1()
	second, done2 := provisionedHandler(t, `{"name":"novars_second","tiers":[{"name":"default","capacity":4,"refill":"1/h"}]}`)
	defer done2()
	for i, withReplacer := range []bool{true, true, false} {
		ctx := context.Background()
		if withReplacer {
			ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewReplacer())
		}
		r, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://127.0.0.1/", nil)
		if err != nil {
			t.Fatal(err)
		}
		r.RemoteAddr = "192.0.2.90:1234"
		var answered string
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
				answered = repl.ReplaceAll("{http.rate_limit.policy} {http.rate_limit.remaining}", "-")
			}
			return nil
		})
		w, err := serveOne(first, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			return second.ServeHTTP(w, r, next)
		}))
		if err != nil || w.Code != 200 {
			t.Fatalf("request %d: %d, %v", i+1, w.Code, err)
		}
		want := ""
		if withReplacer {
			want = fmt.Sprintf("novars_second %d", 3-i)
		}
		if answered != want {
			t.Errorf("request %d: placeholders %q, want %q", i+1, answered, want)
		}
	}
}
