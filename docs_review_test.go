package ratelimit

// An adversarial review of the documentation (issue 26): each test here
// checks one claim the docs make against the code, and fails, naming the
// file and the line, where the two disagree.

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unsafe"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"github.com/yuin/goldmark"
	gast "github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"
	"github.com/yuin/goldmark/text"
	"go.uber.org/zap"
)

// reviewSubdirective is one subdirective the Caddyfile parser accepts, in
// the block it belongs to.
type reviewSubdirective struct {
	block string // "rate_limit", "tier", "jwt", "store redis", "tls", "store local", "key"
	name  string
	flag  bool // takes no value, so its default is "off"
}

// parserSubdirectives reads the subdirectives from the parser's source: the
// string case labels of every switch on the dispenser's current token
// (`switch d.Val()`, `switch sub := d.Val(); sub`) in the functions that
// read each block. Nothing is listed by hand, so a subdirective added to
// the parser is checked here at once. The keyers are the guest modules
// registered in http.handlers.rate_limit.keys.
func parserSubdirectives(t *testing.T) []reviewSubdirective {
	t.Helper()
	blocks := map[string][]string{ // "file:func" -> blocks
		"caddyfile.go:parseSetting":       {"rate_limit"},
		"caddyfile.go:parseTier":          {"tier"},
		"caddyfile.go:parseLimitLine":     {"tier", "rate_limit"},
		"caddyfile.go:parseJWT":           {"jwt"},
		"store_redis.go:unmarshalSetting": {"store redis"},
		"store_redis.go:unmarshalTLS":     {"tls"},
		"stores.go:UnmarshalCaddyfile":    {"store local"},
	}
	var subs []reviewSubdirective
	fset := token.NewFileSet()
	found := map[string]bool{}
	for _, file := range []string{"caddyfile.go", "store_redis.go", "stores.go"} {
		f, err := parser.ParseFile(fset, file, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok {
				continue
			}
			inBlocks, ok := blocks[file+":"+fn.Name.Name]
			if !ok {
				continue
			}
			found[file+":"+fn.Name.Name] = true
			ast.Inspect(fn.Body, func(n ast.Node) bool {
				sw, ok := n.(*ast.SwitchStmt)
				if !ok || !switchesOnVal(sw) {
					return true
				}
				for _, stmt := range sw.Body.List {
					for _, e := range stmt.(*ast.CaseClause).List {
						lit, ok := e.(*ast.BasicLit)
						if !ok || lit.Kind != token.STRING {
							continue
						}
						name, _ := strconv.Unquote(lit.Value)
						for _, block := range inBlocks {
							subs = append(subs, reviewSubdirective{block: block, name: name, flag: isFlagCase(stmt.(*ast.CaseClause))})
						}
					}
				}
				return true
			})
		}
	}
	for k := range blocks {
		if !found[k] {
			t.Fatalf("the parser function %s is gone; update this test", k)
		}
	}
	for _, m := range caddy.GetModules(keyerModulePrefix[:len(keyerModulePrefix)-1]) {
		subs = append(subs, reviewSubdirective{block: "key", name: m.ID.Name()})
	}
	if len(subs) < 50 {
		t.Fatalf("only %d subdirectives found in the parser; the pattern may have broken", len(subs))
	}
	return subs
}

// switchesOnVal reports whether sw switches on a dispenser's Val().
func switchesOnVal(sw *ast.SwitchStmt) bool {
	isVal := func(e ast.Expr) bool {
		call, ok := e.(*ast.CallExpr)
		if !ok {
			return false
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		return ok && sel.Sel.Name == "Val"
	}
	if isVal(sw.Tag) {
		return true
	}
	if as, ok := sw.Init.(*ast.AssignStmt); ok && len(as.Rhs) == 1 && isVal(as.Rhs[0]) {
		return true
	}
	return false
}

// isFlagCase reports whether a case reads a flag: flag(d, ...) or sets a
// bool to true.
func isFlagCase(cc *ast.CaseClause) bool {
	flag := false
	ast.Inspect(cc, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.CallExpr:
			if id, ok := n.Fun.(*ast.Ident); ok && id.Name == "flag" {
				flag = true
			}
		case *ast.AssignStmt:
			if id, ok := n.Rhs[0].(*ast.Ident); ok && id.Name == "true" {
				flag = true
			}
		}
		return true
	})
	return flag
}

// referenceLine is one line of docs/caddyfile.md.
type referenceLine struct {
	n        int
	text     string
	inBlock  bool // in a ```caddyfile block
	concrete bool // in a block with no <placeholders>: an example that adapts
	section  string
}

func readReference(t *testing.T) []referenceLine {
	t.Helper()
	data, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(data), "\n")
	var out []referenceLine
	section := ""
	for i := 0; i < len(lines); i++ {
		line := lines[i]
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "```caddyfile") {
			start := i
			var block []string
			for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
				block = append(block, lines[i])
			}
			concrete := !strings.Contains(strings.Join(block, "\n"), "<")
			for j, b := range block {
				out = append(out, referenceLine{n: start + 2 + j, text: b, inBlock: true, concrete: concrete, section: section})
			}
			continue
		}
		if strings.HasPrefix(trimmed, "```") {
			for i++; i < len(lines) && strings.TrimSpace(lines[i]) != "```"; i++ {
			}
			continue
		}
		if strings.HasPrefix(line, "#") {
			section = line
		}
		out = append(out, referenceLine{n: i + 1, text: line, section: section})
	}
	return out
}

// words is the line's first two fields.
func firstFields(s string) (string, string) {
	f := strings.Fields(s)
	switch len(f) {
	case 0:
		return "", ""
	case 1:
		return f[0], ""
	}
	return f[0], f[1]
}

// mentions reports whether a reference line names the subdirective: as the
// first word of a Caddyfile line, or in backticks in prose.
func (s reviewSubdirective) mentionedBy(l referenceLine) bool {
	first, second := firstFields(l.text)
	if s.block == "key" {
		if l.inBlock {
			return first == "key" && second == s.name
		}
		return strings.Contains(l.text, "`key "+s.name)
	}
	if l.inBlock {
		return first == s.name || strings.Contains(l.text, "{ "+s.name+" ") || strings.Contains(l.text, "  "+s.name+" ")
	}
	return regexp.MustCompile("`" + regexp.QuoteMeta(s.name) + "[` ]").MatchString(l.text)
}

// statesDefault reports whether a line that names a subdirective says
// what holds without it: a default, or that it is required, one of
// several, or in place of another.
func statesDefault(line string) bool {
	l := strings.ToLower(line)
	for _, w := range []string{"default", "without it", "at least one", "instead of", "required", "override"} {
		if strings.Contains(l, w) {
			return true
		}
	}
	return false
}

// exampleElsewhere names a concrete example of s on another page, if any.
func exampleElsewhere(t *testing.T, s reviewSubdirective) string {
	for _, file := range docFiles(t) {
		if file == filepath.Join("docs", "caddyfile.md") {
			continue
		}
		for _, b := range caddyfileBlocks(t, file) {
			if strings.Contains(b.text, "<") {
				continue
			}
			for i, line := range strings.Split(b.text, "\n") {
				first, second := firstFields(line)
				if first == s.name || s.block == "key" && first == "key" && second == s.name {
					return fmt.Sprintf(" (%s:%d has one)", file, b.line+1+i)
				}
			}
		}
	}
	return ""
}

// TestDocsReviewEverySubdirectiveHasItsDefaultAndAnExample checks issue
// 26's claim that docs/caddyfile.md holds EVERY subdirective, its default
// and an example. For each subdirective the parser accepts:
//   - documented: named in the reference;
//   - an example: a line that starts with it in a ```caddyfile block with
//     no <placeholders> (one that TestReadmeExamplesAdapt adapts), not only
//     in a syntax summary;
//   - a default: a line that names it says what holds without it (see
//     statesDefault), or its own section does. Spared: flags, whose default
//     is off; keyers, which have none; and a tier's conditions (match,
//     claim, keyer), since the tier section says a tier without conditions
//     applies to everyone.
func TestDocsReviewEverySubdirectiveHasItsDefaultAndAnExample(t *testing.T) {
	ref := readReference(t)
	for _, s := range parserSubdirectives(t) {
		var documented, example, dflt bool
		for i, l := range ref {
			if !s.mentionedBy(l) {
				continue
			}
			documented = true
			first, second := firstFields(l.text)
			if l.concrete && (first == s.name || s.block == "key" && first == "key" && second == s.name) {
				example = true
			}
			// Prose wraps: the line before may hold the rest of the sentence.
			if statesDefault(l.text) || !l.inBlock && i > 0 && !ref[i-1].inBlock && statesDefault(ref[i-1].text) {
				dflt = true
			}
		}
		if !dflt && s.block != "key" {
			for _, l := range ref {
				if strings.Contains(l.section, "`"+s.name+"`") && statesDefault(l.text) {
					dflt = true
				}
			}
		}
		spared := s.flag || s.block == "key" || s.block == "tier" && (s.name == "match" || s.name == "claim" || s.name == "keyer")
		where := s.block + " { " + s.name + " }"
		if s.block == "key" {
			where = "key " + s.name
		}
		switch {
		case !documented:
			t.Errorf("%s: not in docs/caddyfile.md at all", where)
		case !example:
			t.Errorf("%s: docs/caddyfile.md has no example of it, only the syntax summary%s", where, exampleElsewhere(t, s))
		}
		if documented && !dflt && !spared {
			t.Errorf("%s: docs/caddyfile.md states no default for it", where)
		}
	}
}

// metricNames are the metric names the package and its store register:
// every Name: "..." of a collector under Namespace caddy and Subsystem
// http_rate_limit, and every prometheus.NewDesc name.
func metricNames(t *testing.T) []string {
	t.Helper()
	var names []string
	nameField := regexp.MustCompile(`Namespace:\s*"caddy",\s*Subsystem:\s*"http_rate_limit",\s*Name:\s*"([a-z_]+)"`)
	desc := regexp.MustCompile(`NewDesc\(\s*"([a-z_]+)"`)
	files, _ := filepath.Glob("*.go")
	more, _ := filepath.Glob("internal/*/*.go")
	for _, f := range append(files, more...) {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range nameField.FindAllStringSubmatch(string(data), -1) {
			names = append(names, "caddy_http_rate_limit_"+m[1])
		}
		for _, m := range desc.FindAllStringSubmatch(string(data), -1) {
			names = append(names, m[1])
		}
	}
	if len(names) < 10 {
		t.Fatalf("only %d metrics found; the pattern may have broken: %v", len(names), names)
	}
	return names
}

func TestDocsReviewEveryMetricIsInOperating(t *testing.T) {
	data, err := os.ReadFile("docs/operating.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range metricNames(t) {
		if !strings.Contains(string(data), "`"+name+"`") {
			t.Errorf("metric %s is registered but not in docs/operating.md's table", name)
		}
	}
}

// TestDocsReviewEveryPlaceholderIsDocumented: every name the handler's
// placeholder function answers (the case labels of decision.placeholder,
// and the claim. prefix) is in docs/caddyfile.md's table.
func TestDocsReviewEveryPlaceholderIsDocumented(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "placeholders.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Name.Name != "placeholder" {
			continue
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			if cc, ok := n.(*ast.CaseClause); ok {
				for _, e := range cc.List {
					if lit, ok := e.(*ast.BasicLit); ok && lit.Kind == token.STRING {
						s, _ := strconv.Unquote(lit.Value)
						names = append(names, s)
					}
				}
			}
			return true
		})
	}
	names = append(names, "claim.<name>")
	if len(names) < 9 {
		t.Fatalf("only %d placeholders found: %v", len(names), names)
	}
	ref, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if !strings.Contains(string(ref), "`{"+placeholderPrefix+n+"}`") {
			t.Errorf("placeholder {%s%s} is set by the handler but not in docs/caddyfile.md's table", placeholderPrefix, n)
		}
	}
}

// TestDocsReviewEveryNamedTestExists: every Test... or Fuzz... the docs
// name in backticks (docs/guarantees.md's table above all) is a function
// of some _test.go file of the repository.
func TestDocsReviewEveryNamedTestExists(t *testing.T) {
	defined := map[string]bool{}
	decl := regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Za-z0-9_]*)\(`)
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && strings.HasPrefix(d.Name(), ".") && path != "." {
			return filepath.SkipDir
		}
		if strings.HasSuffix(path, "_test.go") {
			data, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range decl.FindAllStringSubmatch(string(data), -1) {
				defined[m[1]] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	named := regexp.MustCompile("`((?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*)`")
	checked := 0
	for _, file := range append(docFiles(t), "bench/README.md") {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(data), "\n") {
			for _, m := range named.FindAllStringSubmatch(line, -1) {
				checked++
				if !defined[m[1]] {
					t.Errorf("%s:%d names %s, which no _test.go file defines", file, i+1, m[1])
				}
			}
		}
	}
	if checked < 80 {
		t.Errorf("only %d test names found in the docs; the pattern may have broken", checked)
	}
}

// TestDocsReviewStatedDefaultsMatchTheCode reads the defaults the
// reference states and compares each with the constant the code applies.
func TestDocsReviewStatedDefaultsMatchTheCode(t *testing.T) {
	data, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	for _, tt := range []struct {
		pattern string // one group: the stated default
		code    string
	}{
		{`timeout <duration>\s+# per decision, default (\S+)`, redisbucket.DefaultTimeout.String()},
		{`breaker_failures <n>\s+# default (\S+)`, strconv.Itoa(redisbucket.DefaultBreakerFailures)},
		{`breaker_cooldown <duration>\s+# default (\S+)`, redisbucket.DefaultBreakerCooldown.String()},
		{`deny_cache_size <n>\s+# default (\S+)`, strconv.Itoa(redisbucket.DefaultDenyCacheSize)},
		{`lease_ttl <duration>\s+# default (\S+)`, redisbucket.DefaultLeaseTTL.String()},
		{`slot_ttl <duration>\s+# default (\S+)`, redisbucket.DefaultSlotTTL.String()},
		{`prefix <string>\s+# default "([^"]+)"`, redisbucket.DefaultPrefix},
		{`Default ` + "`" + `redis://127.0.0.1:6379` + "`", ""},
		{`max_keys` + "`" + ` bounds memory \(default (\d+) buckets`, strconv.Itoa(defaultMaxKeys)},
		{`Default 10000\.`, ""},
		{`The status of a rejection, default (\d+)`, "429"},
		{`jwks_refresh <duration>\s+# how often the key set is read again; default (\S+),`, "5m0s"},
	} {
		m := regexp.MustCompile(tt.pattern).FindStringSubmatch(doc)
		if m == nil {
			t.Errorf("docs/caddyfile.md no longer says %q", tt.pattern)
			continue
		}
		if len(m) < 2 {
			continue
		}
		got := m[1]
		if d, err := time.ParseDuration(got); err == nil {
			got = d.String()
		}
		if got != tt.code {
			t.Errorf("docs/caddyfile.md: %q states %s; the code's default is %s", m[0], m[1], tt.code)
		}
	}
	if defaultMaxWaiting != 10000 {
		t.Errorf("max_waiting: the docs say 10000, the code %d", defaultMaxWaiting)
	}
	if redisbucket.DefaultAddress != "redis://127.0.0.1:6379" {
		t.Errorf("address: the docs say redis://127.0.0.1:6379, the code %s", redisbucket.DefaultAddress)
	}
}

// TestDocsReviewPoolSizeDefaultOfACluster: docs/caddyfile.md said of
// pool_size "connections per Redis node; default 10 per CPU", for every
// deployment. With several addresses (a Cluster) the store hands
// pool_size 0 to go-redis's ClusterOptions, whose default is 5 per CPU.
// The reference now states both, the Cluster's as "and 5 per CPU on each
// node of a Cluster"; each is checked against the client read out of a
// connection the store's own code makes.
func TestDocsReviewPoolSizeDefaultOfACluster(t *testing.T) {
	ref, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile("\\| `pool_size` \\| connections per Redis node; default (\\d+) per CPU(?:, and (\\d+) per CPU on each node of a Cluster)?").FindSubmatch(ref)
	if m == nil {
		t.Fatal("docs/caddyfile.md no longer states pool_size's default as n per CPU")
	}
	single, _ := strconv.Atoi(string(m[1]))
	cluster := single // unless the reference gives a Cluster its own
	if m[2] != nil {
		cluster, _ = strconv.Atoi(string(m[2]))
	}
	for _, tt := range []struct {
		name      string
		addresses []string
	}{
		{"one node", []string{"redis://127.0.0.1:1"}},
		{"a Cluster", []string{"redis://127.0.0.1:1", "redis://127.0.0.1:2"}},
	} {
		plan, err := redisbucket.NewPlan(redisbucket.Options{Addresses: tt.addresses})
		if err != nil {
			t.Fatal(err)
		}
		conn := plan.Connect(zap.NewNop())
		// conn.cur.Load().client, the client in use.
		unexported := func(v reflect.Value, name string) reflect.Value {
			f := v.FieldByName(name)
			return reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem()
		}
		set := unexported(reflect.ValueOf(conn).Elem(), "cur").Addr().MethodByName("Load").Call(nil)[0]
		client := unexported(set.Elem(), "client").Interface()
		var got int
		switch c := client.(type) {
		case *redis.Client:
			got = c.Options().PoolSize
		case *redis.ClusterClient:
			got = c.Options().PoolSize
		default:
			t.Fatalf("%s: client %T", tt.name, client)
		}
		conn.Close()
		perCPU := single
		if len(tt.addresses) > 1 {
			perCPU = cluster
		}
		if want := perCPU * runtime.GOMAXPROCS(0); got != want {
			t.Errorf("%s: pool_size defaults to %d connections a node (%d per CPU); docs/caddyfile.md says %d per CPU", tt.name, got, got/runtime.GOMAXPROCS(0), perCPU)
		}
	}
}

// TestDocsReviewProblemBodyWithStackedLimits: docs/caddyfile.md "Shaping
// the rejection" gives a handle_errors 429 whose problem+json body names
// the tier and the retry time from {http.rate_limit.*}; docs/logins.md
// (and `name`, and "Why a per-IP limit should stay underneath") stack two
// rate_limit handlers on one route. When the first allows and the second
// refuses, the placeholders answer the first handler's decision (Caddy's
// replacer asks its providers in the order they were added), so the body
// says retry_after 0 and the wrong policy while Retry-After says 60.
func TestDocsReviewProblemBodyWithStackedLimits(t *testing.T) {
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

// TestDocsReviewPlaceholdersOfAFailedSlotStore: docs/caddyfile.md
// ("Shaping the rejection") says that for a failed store
// {http.rate_limit.limit} and {http.rate_limit.retry_after} are empty. When
// Redis cannot count a concurrency tier's requests in flight and
// on_store_error is deny, the 503 has Retry-After: 1 but the placeholders
// give the tier's limit and a retry_after of 0: the decision keeps the
// allowed result (decision.go: d.result = res in acquireSlot), so a body
// built from them tells the client to retry in 0 seconds. Redis is an
// address nothing listens on, so no redis-server is needed.
func TestDocsReviewPlaceholdersOfAFailedSlotStore(t *testing.T) {
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

// goldmarkLinks are the link destinations of a Markdown document as a
// CommonMark parser (with GitHub's tables) sees them, relative ones only.
func goldmarkLinks(src []byte) []string {
	md := goldmark.New(goldmark.WithExtensions(extension.Table))
	doc := md.Parser().Parse(text.NewReader(src))
	var out []string
	_ = gast.Walk(doc, func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		if !entering {
			return gast.WalkContinue, nil
		}
		var dest string
		switch n := n.(type) {
		case *gast.Link:
			dest = string(n.Destination)
		case *gast.Image:
			dest = string(n.Destination)
		default:
			return gast.WalkContinue, nil
		}
		if !externalLink.MatchString(dest) {
			out = append(out, dest)
		}
		return gast.WalkContinue, nil
	})
	return out
}

// githubSlugs are the anchors GitHub makes for a document's headings, from
// the headings a CommonMark parser finds (so none in any code block, ``` or
// ~~~), as its TOC filter does: lowercased, every character but \p{Word}
// (letters, marks, decimal digits, connector punctuation such as _), - and
// space removed, spaces made -; a repeated slug numbered -1, -2...
func githubSlugs(src []byte) map[string]bool {
	md := goldmark.New(goldmark.WithExtensions(extension.Table))
	doc := md.Parser().Parse(text.NewReader(src))
	slugs := map[string]bool{}
	seen := map[string]int{}
	_ = gast.Walk(doc, func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		h, ok := n.(*gast.Heading)
		if !ok || !entering {
			return gast.WalkContinue, nil
		}
		var sb strings.Builder
		for _, r := range strings.ToLower(nodeText(h, src)) {
			switch {
			case unicode.IsLetter(r) || unicode.IsMark(r) || unicode.IsDigit(r) || unicode.In(r, unicode.Pc) || r == '-':
				sb.WriteRune(r)
			case r == ' ':
				sb.WriteRune('-')
			}
		}
		slug := sb.String()
		if k := seen[slug]; k > 0 {
			slugs[slug+"-"+strconv.Itoa(k)] = true
		} else {
			slugs[slug] = true
		}
		seen[slug]++
		return gast.WalkSkipChildren, nil
	})
	return slugs
}

// nodeText is the plain text of n's inline children: text, strings and
// code spans, with links and emphasis reduced to their text.
func nodeText(n gast.Node, src []byte) string {
	var sb strings.Builder
	_ = gast.Walk(n, func(c gast.Node, entering bool) (gast.WalkStatus, error) {
		if !entering {
			return gast.WalkContinue, nil
		}
		switch c := c.(type) {
		case *gast.Text:
			sb.Write(c.Segment.Value(src))
			if c.SoftLineBreak() {
				sb.WriteByte(' ')
			}
		case *gast.String:
			sb.Write(c.Value)
		}
		return gast.WalkContinue, nil
	})
	return sb.String()
}

// githubResolve is how GitHub resolves a relative link written in file,
// whose text is src: the file exists in the repository, and the anchor is
// one of its headings'.
func githubResolve(file string, src []byte, target string) error {
	path, anchor, _ := strings.Cut(target, "#")
	if path != "" {
		resolved := filepath.Join(filepath.Dir(file), path)
		if strings.HasPrefix(resolved, "..") {
			return fmt.Errorf("%s is outside the repository", resolved)
		}
		if _, err := os.Stat(resolved); err != nil {
			return err
		}
		if anchor == "" {
			return nil
		}
		var err error
		if src, err = os.ReadFile(resolved); err != nil {
			return err
		}
	}
	if anchor != "" && !githubSlugs(src)[anchor] {
		return fmt.Errorf("no heading makes #%s", anchor)
	}
	return nil
}

// checkerAccepts is docs_test.go's verdict on a document written as file:
// the links its pattern finds all land, by its own slugs.
func checkerAccepts(file, doc string) bool {
	for _, l := range markdownLinks(doc) {
		path, anchor, _ := strings.Cut(l.target, "#")
		if path == "" {
			if !headingSlugs(doc)[anchor] {
				return false
			}
			continue
		}
		if checkLink(file, l.target) != nil {
			return false
		}
	}
	return true
}

// TestDocsReviewLinkCheckerSeesEveryLink: TestDocsLinksLand checks the
// links its regular expression finds, one line at a time, against headings
// found outside ``` fences. A CommonMark parser (what GitHub renders) finds
// links it does not: reference-style links ([text][ref] with [ref]: path),
// titles in single quotes or parentheses, link text that wraps onto the
// next line, text with brackets; and headings it takes for real that are
// code (~~~ fences, indented blocks). Each document below has a link that
// is broken on GitHub, and passes docs_test.go's checker. The real docs
// are then checked the same way: every relative link goldmark finds in
// README.md and docs/*.md must be one the checker sees, and land; those of
// bench/README.md, which the checker never reads, must land.
func TestDocsReviewLinkCheckerSeesEveryLink(t *testing.T) {
	for _, doc := range []string{
		"See [the fleet page][fleet].\n\n[fleet]: docs/no-such-page.md\n",
		"See [the fleet page](docs/no-such-page.md 'a title').\n",
		"See [the fleet page](docs/no-such-page.md (a title)).\n",
		"See [Share limits across\na fleet](docs/no-such-page.md).\n",
		"See [the [fleet] page](docs/no-such-page.md).\n",
		"~~~\n## Hidden heading\n~~~\nSee [here](#hidden-heading).\n",
		"Some code:\n\n    ## Indented heading\n\nSee [here](#indented-heading).\n",
		"See [the main README](../main/README.md).\n",
		"## Cafe\u0301 hours\n\nSee [here](#cafe-hours).\n",
	} {
		var broken []string
		for _, dest := range goldmarkLinks([]byte(doc)) {
			if err := githubResolve("README.md", []byte(doc), dest); err != nil {
				broken = append(broken, dest+": "+err.Error())
			}
		}
		if len(broken) == 0 {
			t.Errorf("no link of %q is broken on GitHub; the case is wrong", doc)
			continue
		}
		if checkerAccepts("README.md", doc) {
			t.Errorf("docs_test.go's checker accepts %q, whose link is broken on GitHub: %v", doc, broken)
		}
	}

	for _, file := range append(docFiles(t), "bench/README.md") {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, l := range markdownLinks(string(data)) {
			seen[l.target] = true
		}
		for _, dest := range goldmarkLinks(data) {
			if err := githubResolve(file, data, dest); err != nil {
				t.Errorf("%s: link %s: %v", file, dest, err)
			}
			if file != "bench/README.md" && !seen[dest] {
				t.Errorf("%s: link %s is not seen by docs_test.go's checker", file, dest)
			}
		}
	}
}
