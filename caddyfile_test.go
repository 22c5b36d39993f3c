package ratelimit

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// adaptSite adapts a one-site Caddyfile whose site body is directives.
func adaptSite(directives string) ([]byte, error) {
	return adaptCaddyfile("http://127.0.0.1:9 {\n" + directives + "\n}\n")
}

// handlerJSON digs the first rate_limit handler's JSON out of an adapted
// config.
func handlerJSON(t *testing.T, cfg []byte) map[string]any {
	t.Helper()
	found := rateLimitHandlers(t, cfg)
	if len(found) == 0 {
		t.Fatalf("no rate_limit handler in %s", cfg)
	}
	return found[0]
}

// rateLimitHandlers finds every rate_limit handler's JSON in an adapted
// config, in order.
func rateLimitHandlers(t testing.TB, cfg []byte) []map[string]any {
	t.Helper()
	var found []map[string]any
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "rate_limit" {
				found = append(found, v)
			}
			for _, e := range v {
				walk(e)
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	var root any
	if err := json.Unmarshal(cfg, &root); err != nil {
		t.Fatal(err)
	}
	walk(root)
	return found
}

func TestCaddyfileFillsTheJSONConfig(t *testing.T) {
	t.Parallel()
	cfg, err := adaptSite(`
	rate_limit /api/* 100 10/s {
		name api
		key header X-API-Key
		key ip /24 /48
		tier bots 2 1/m {
			match {
				header User-Agent *bot*
			}
		}
		tier gold {
			capacity 1000
			refill 100/s
			cost 2
			keyer header
		}
		tier staff {
			match {
				remote_ip 127.0.0.0/8
			}
			unlimited
		}
		store local {
			max_keys 5000
		}
		on_store_error deny
		headers both
		upstream_headers
		status 503
		dry_run
	}
	respond "ok"`)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := json.Marshal(handlerJSON(t, cfg))
	want := `{"dry_run":true,"handler":"rate_limit","headers":"both","keys":[{"field":"X-API-Key","keyer":"header"},{"ipv4_prefix":24,"ipv6_prefix":48,"keyer":"ip"}],"name":"api","on_store_error":"deny","status":503,"store":{"max_keys":5000,"store":"local"},"tiers":[{"capacity":2,"match":[{"header":{"User-Agent":["*bot*"]}}],"name":"bots","refill":"1/m"},{"capacity":1000,"cost":2,"keyer":"header","name":"gold","refill":"100/s"},{"match":[{"remote_ip":{"ranges":["127.0.0.0/8"]}}],"name":"staff","unlimited":true},{"capacity":100,"name":"default","refill":"10/s"}],"upstream_headers":true}`
	if string(got) != want {
		t.Errorf("adapted handler:\n got %s\nwant %s", got, want)
	}
	if !strings.Contains(string(cfg), `"path":["/api/*"]`) {
		t.Errorf("the matcher before the limits was lost: %s", cfg)
	}
}

func TestCaddyfileMistakesFailAtAdapt(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name       string
		directives string
		want       []string // substrings of the error
	}{
		{"no catch-all tier", `rate_limit {
			tier bots 1 1/s {
				match {
					header User-Agent *bot*
				}
			}
		}`, []string{"no catch-all tier", "Caddyfile:"}},
		{"no tier at all", `rate_limit`, []string{"no tier"}},
		{"capacity 0", `rate_limit 0 1/s`, []string{"capacity 0", "at least 1"}},
		{"negative capacity", `rate_limit -5 1/s`, []string{"capacity -5"}},
		{"capacity not a number", `rate_limit lots 1/s`, []string{`capacity "lots"`}},
		{"refill fast", `rate_limit 10 fast`, []string{`refill "fast"`, "Caddyfile:2"}},
		{"negative refill", `rate_limit 10 -1/s`, []string{`refill "-1/s"`}},
		{"refill with a bad unit", `rate_limit 10 5/fortnight`, []string{`"5/fortnight"`}},
		{"cost 0", `rate_limit {
			tier free 5 1/s {
				cost 0
			}
		}`, []string{"cost 0", "at least 1", "placeholder", "Caddyfile:4"}},
		{"negative cost", `rate_limit {
			tier free 5 1/s {
				cost -2
			}
		}`, []string{"cost -2", "at least 1"}},
		{"cost above capacity", `rate_limit 10 1/s {
			tier heavy 5 1/s {
				cost 6
			}
		}`, []string{"cost 6", "capacity, 5", `tier "heavy"`}},
		{"unknown subdirective", `rate_limit 10 1/s {
			burst 5
		}`, []string{`unknown subdirective "burst"`, "Caddyfile:3"}},
		{"unknown tier subdirective", `rate_limit 10 1/s {
			tier a 1 1/s {
				weight 3
			}
		}`, []string{`"weight"`, `tier "a"`}},
		{"duplicate tier", `rate_limit 10 1/s {
			tier a 1 1/s {
				keyer header
			}
			tier a 2 1/s {
				keyer cookie
			}
		}`, []string{`tier "a" is defined twice`}},
		{"tier after a catch-all", `rate_limit 10 1/s {
			tier everyone 1 1/s
			tier later 2 1/s {
				keyer header
			}
		}`, []string{`tier "everyone" has no conditions`}},
		{"headers mode", `rate_limit 10 1/s {
			headers draft
		}`, []string{`headers "draft"`}},
		{"on_store_error mode", `rate_limit 10 1/s {
			on_store_error panic
		}`, []string{`on_store_error "panic"`}},
		{"status not an error", `rate_limit 10 1/s {
			status 200
		}`, []string{"status 200"}},
		{"unknown keyer", `rate_limit 10 1/s {
			key fingerprint
		}`, []string{`keyer "fingerprint"`}},
		{"header keyer without field", `rate_limit 10 1/s {
			key header
		}`, []string{"key header"}},
		{"ip prefix too long", `rate_limit 10 1/s {
			key ip /33
		}`, []string{"prefix 33"}},
		{"placeholder without placeholder", `rate_limit 10 1/s {
			key placeholder constant
		}`, []string{`"constant" holds no placeholder`}},
		{"tier keyer unknown", `rate_limit 10 1/s {
			tier a 1 1/s {
				keyer mac
			}
		}`, []string{`keyer "mac"`}},
		{"tier without refill", `rate_limit 10 1/s {
			tier a {
				capacity 5
				keyer header
			}
		}`, []string{`tier "a": a refill rate is required`}},
		{"unlimited with capacity", `rate_limit 10 1/s {
			tier a 5 1/s {
				keyer header
				unlimited
			}
		}`, []string{"takes no capacity"}},
		{"store twice", `rate_limit 10 1/s {
			store local
			store local
		}`, []string{"store: given twice"}},
		{"unknown store", `rate_limit 10 1/s {
			store memcached
		}`, []string{`store "memcached"`}},
		{"max_keys 0", `rate_limit 10 1/s {
			store local {
				max_keys 0
			}
		}`, []string{"max_keys 0"}},
		{"one value on the first line", `rate_limit 10`, []string{"<capacity> <refill>"}},
		{"flag with a value", `rate_limit 10 1/s {
			dry_run yes
		}`, []string{`dry_run takes no value`}},
		{"name twice", `rate_limit 10 1/s {
			name a
			name b
		}`, []string{"name: given twice", "Caddyfile:4"}},
		{"on_store_error twice", `rate_limit 10 1/s {
			on_store_error deny
			on_store_error allow
		}`, []string{"on_store_error: given twice", "Caddyfile:4"}},
		{"tier capacity twice", `rate_limit 10 1/s {
			tier a 1 1/s {
				keyer header
				capacity 5
				capacity 6
			}
		}`, []string{"capacity: given twice", "Caddyfile:6"}},
		{"empty match", `rate_limit 10 1/s {
			tier a 1 1/s {
				match {
				}
			}
		}`, []string{`tier "a": match: an empty block`, "Caddyfile:4"}},
		{"tier name not ASCII", `rate_limit 10 1/s {
			tier gold€ 1 1/s {
				keyer header
			}
		}`, []string{"printable ASCII", "RateLimit-Policy"}},
		{"tier name with a control character", "rate_limit 10 1/s {\n\t\t\ttier \"a\tb\" 1 1/s {\n\t\t\t\tkeyer header\n\t\t\t}\n\t\t}", []string{"printable ASCII", "0x09"}},
		{"claim without value", `rate_limit 10 1/s {
			tier a 1 1/s {
				claim plan
			}
		}`, []string{"claim: want <claim> <value...>"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := adaptSite(tt.directives)
			if err == nil {
				t.Fatalf("adapted without error; want one containing %q", tt.want)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
		})
	}
}

func TestJSONMistakesFailAtProvision(t *testing.T) {
	for _, tt := range []struct {
		handler string
		want    string
	}{
		{`{"handler":"rate_limit","tiers":[{"name":"default","capacity":0,"refill":"1/s"}]}`, "capacity 0"},
		{`{"handler":"rate_limit","tiers":[{"name":"default","capacity":5,"refill":"fast"}]}`, `refill "fast"`},
		{`{"handler":"rate_limit","tiers":[{"name":"default","capacity":5,"refill":"1/s","cost":9}]}`, "cost 9"},
		{`{"handler":"rate_limit","tiers":[{"name":"a","capacity":5,"refill":"1/s","keyer":"header"}]}`, "no catch-all tier"},
		{`{"handler":"rate_limit","tiers":[{"name":"default","capacity":5,"refill":"1/s","claims":{"plan":["gold"]}},{"name":"x","capacity":1,"refill":"1/s"}]}`, "a claim condition needs a jwt block"},
		{`{"handler":"rate_limit","keys":[{"keyer":"header"}],"tiers":[{"name":"default","capacity":5,"refill":"1/s"}]}`, "a field name is required"},
		{`{"handler":"rate_limit","tiers":[{"name":"a","capacity":5,"refill":"1/s","match":[{}]},{"name":"default","capacity":5,"refill":"1/s"}]}`, "an empty matcher set would match every request"},
		{`{"handler":"rate_limit","tiers":[{"name":"gold\n","capacity":5,"refill":"1/s"}]}`, "printable ASCII"},
	} {
		port := freePort(t)
		cfg := `{"admin":{"disabled":true},"apps":{"http":{"servers":{"s":{"listen":["127.0.0.1:` + strconv.Itoa(port) + `"],"routes":[{"handle":[` + tt.handler + `]}]}}}}}`
		err := caddy.Load([]byte(cfg), true)
		if err == nil {
			_ = caddy.Stop()
			t.Errorf("%s: loaded; want an error containing %q", tt.handler, tt.want)
			continue
		}
		if !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %q does not contain %q", tt.handler, err, tt.want)
		}
	}
}

// findHandlers decodes every rate_limit handler in an adapted config.
func findHandlers(t *testing.T, cfg []byte) []*Handler {
	t.Helper()
	var out []*Handler
	for _, v := range rateLimitHandlers(t, cfg) {
		raw, _ := json.Marshal(v)
		h := new(Handler)
		if err := json.Unmarshal(raw, h); err != nil {
			t.Fatalf("decoding %s: %v", raw, err)
		}
		out = append(out, h)
	}
	return out
}

// Validation reads and provisioning writes: the adapted JSON of the
// shortest config holds what the Caddyfile says and no default.
func TestAdaptShowsOnlyWhatWasWritten(t *testing.T) {
	t.Parallel()
	cfg, err := adaptSite("rate_limit 10 1/s")
	if err != nil {
		t.Fatal(err)
	}
	got := handlerJSON(t, cfg)
	for _, field := range []string{"name", "headers", "on_store_error", "status", "no_key", "store"} {
		if v, ok := got[field]; ok {
			t.Errorf("adapted JSON holds %q: %v, which the Caddyfile does not say", field, v)
		}
	}
	if tiers, ok := got["tiers"].([]any); !ok || len(tiers) != 1 {
		t.Fatalf("adapted JSON %v: want the one tier", got)
	}
}

// The rate_limit block takes, for the catch-all tier, every line a tier
// block takes for its own limits, read by the same code; with no
// <capacity> <refill> on the first line, such lines alone make the tier.
// Regression test for issue 30 items 1 to 3.
func TestCaddyfileRateLimitBlockTakesTheCatchAllTiersLimitLines(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ directives, tiers string }{
		{"rate_limit 100 10/s {\n cost 5\n }", `[{"capacity":100,"cost":5,"name":"default","refill":"10/s"}]`},
		{"rate_limit 100 10/s {\n cost {http.request.header.X-Batch}\n }", `[{"capacity":100,"cost_placeholder":"{http.request.header.X-Batch}","name":"default","refill":"10/s"}]`},
		{"rate_limit 100 10/s {\n cost_from_response X-Tokens-Used\n }", `[{"capacity":100,"cost_from_response":"X-Tokens-Used","name":"default","refill":"10/s"}]`},
		{"rate_limit 100 10/s {\n quota 1000/day\n quota 20000/month\n }", `[{"capacity":100,"name":"default","quotas":["1000/day","20000/month"],"refill":"10/s"}]`},
		{"rate_limit 100 10/s {\n concurrency 10\n }", `[{"capacity":100,"concurrency":10,"name":"default","refill":"10/s"}]`},
		{"rate_limit {\n limit 10 1/s\n cost 2\n }", `[{"cost":2,"limits":[{"capacity":10,"refill":"1/s"}],"name":"default"}]`},
		{"rate_limit {\n concurrency 10\n }", `[{"concurrency":10,"name":"default"}]`},
		{"rate_limit {\n quota 10000/month\n }", `[{"name":"default","quotas":["10000/month"]}]`},
		{"rate_limit {\n quota 10000/month\n concurrency 3\n cost 2\n }", `[{"concurrency":3,"cost":2,"name":"default","quotas":["10000/month"]}]`},
		{"rate_limit 10 1/s {\n tier free {\n match header X-Plan free\n quota 1000/day\n }\n }", `[{"match":[{"header":{"X-Plan":["free"]}}],"name":"free","quotas":["1000/day"]},{"capacity":10,"name":"default","refill":"1/s"}]`},
		{"rate_limit {\n quota 5/day\n tier free {\n quota 1000/day\n match header X-Plan free\n }\n }", `[{"match":[{"header":{"X-Plan":["free"]}}],"name":"free","quotas":["1000/day"]},{"name":"default","quotas":["5/day"]}]`},
	} {
		cfg, err := adaptSite(tt.directives)
		if err != nil {
			t.Errorf("%q: %v", tt.directives, err)
			continue
		}
		if got, _ := json.Marshal(handlerJSON(t, cfg)["tiers"]); string(got) != tt.tiers {
			t.Errorf("%q adapted to tiers\n %s\nwant %s", tt.directives, got, tt.tiers)
		}
	}
	for _, tt := range []struct {
		directives string
		want       []string
	}{
		{"rate_limit 100 10/s {\n cost 2\n cost 3\n }", []string{"cost: given twice", "Caddyfile:4"}},
		{"rate_limit 100 10/s {\n concurrency 2\n concurrency 3\n }", []string{"concurrency: given twice"}},
		{"rate_limit 100 10/s {\n cost_from_response A\n cost_from_response B\n }", []string{"cost_from_response: given twice"}},
		{"rate_limit 100 10/s {\n quota 5/day\n quota 9/day\n }", []string{`tier "default"`, "a second quota per day"}},
		{"rate_limit 100 10/s {\n concurrency 0\n }", []string{"concurrency 0: must be at least 1"}},
		{"rate_limit 100 10/s {\n cost 200\n }", []string{`tier "default"`, "cost 200"}},
		{"rate_limit 100 10/s {\n quota 0/day\n }", []string{`quota "0/day"`}},
		{"rate_limit {\n cost 2\n }", []string{`tier "default"`, "no rate limit"}},
	} {
		_, err := adaptSite(tt.directives)
		for _, w := range tt.want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Errorf("%q: %v, want an error containing %q", tt.directives, err, w)
			}
		}
	}
}
