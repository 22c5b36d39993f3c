package ratelimit

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode"
	"unsafe"

	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/redis/go-redis/v9"
	"github.com/yuin/goldmark"
	gast "github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"
	"github.com/yuin/goldmark/text"
	"go.uber.org/zap"
)

// The documentation is README.md and docs/*.md. These tests keep it one
// that a Caddy user finds their way in: a short README, links that land,
// and a whole Caddyfile on every page (TestReadmeExamplesAdapt adapts them).

// docFiles are README.md and the pages of docs/.
func docFiles(t *testing.T) []string {
	t.Helper()
	pages, err := filepath.Glob("docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs/*.md: %v", err)
	}
	return append([]string{"README.md"}, pages...)
}

func TestDocsReadmeIsShort(t *testing.T) {
	t.Parallel()
	data, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(data), "\n"); n >= 300 {
		t.Errorf("README.md has %d lines; keep it under 300 and move the rest to docs/", n)
	}
}

// TestDocsLinksLand checks every relative link of README.md, docs/*.md and
// bench/README.md, as the code host reads them: the file exists in the
// repository, and the anchor is a heading of the target.
func TestDocsLinksLand(t *testing.T) {
	t.Parallel()
	checked := 0
	for _, file := range append(docFiles(t), "bench/README.md") {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range markdownLinks(string(data)) {
			if err := checkLinkIn(file, string(data), l.target); err != nil {
				t.Errorf("%s:%d: [%s](%s): %v", file, l.line, l.text, l.target, err)
			}
			checked++
		}
	}
	if checked < 50 {
		t.Errorf("only %d relative links found; the parser may have broken", checked)
	}
}

// TestDocsLinkCheckerFindsBrokenLinks makes sure the checker above is not
// vacuous: each form a broken link can take is caught, and the same forms
// that land pass.
func TestDocsLinkCheckerFindsBrokenLinks(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		target string
		ok     bool
	}{
		{"docs/fleet.md", true},
		{"docs/fleet.md#sharing-limits-across-edge-nodes", true},
		{"docs/caddyfile.md#no_key", true},
		{"docs/caddyfile.md#capacity-refill", true},
		{"docs/caddyfile.md#max_wait-and-max_waiting", true},
		{"docs/metering-and-quotas.md#sell-api-plans-per-second-limits-and-a-monthly-quota", true},
		{"docs/metering-and-quotas.md#across-a-fleet-with-redis", true},
		{"bench/README.md", true},
		{"docs/no-such-page.md", false},
		{"docs/fleet.md#no-such-heading", false},
		{"docs/fleet.md#Sizing", false},
		{"../main/README.md", false}, // outside the repository, wherever it is checked out
		{"#an-example", true},
		{"#no-such-heading", false},
	} {
		if err := checkLink("README.md", tt.target); (err == nil) != tt.ok {
			t.Errorf("%s: error %v, want ok %v", tt.target, err, tt.ok)
		}
	}

	// Each document has one link, in a form a line-by-line pattern misses;
	// the first of each pair is broken, the second lands.
	for _, tt := range []struct{ form, broken, lands string }{
		{"reference",
			"See [the fleet page][fleet].\n\n[fleet]: docs/no-such-page.md\n",
			"See [the fleet page][fleet].\n\n[fleet]: docs/fleet.md\n"},
		{"title in single quotes",
			"See [the fleet page](docs/no-such-page.md 'a title').\n",
			"See [the fleet page](docs/fleet.md 'a title').\n"},
		{"title in parentheses",
			"See [the fleet page](docs/no-such-page.md (a title)).\n",
			"See [the fleet page](docs/fleet.md (a title)).\n"},
		{"text across lines",
			"See [Share limits across\na fleet](docs/no-such-page.md).\n",
			"See [Share limits across\na fleet](docs/fleet.md).\n"},
		{"brackets in the text",
			"See [the [fleet] page](docs/no-such-page.md).\n",
			"See [the [fleet] page](docs/fleet.md).\n"},
		{"a heading in a ~~~ fence",
			"~~~\n## Hidden heading\n~~~\nSee [here](#hidden-heading).\n",
			"~~~\n## Hidden heading\n~~~\n## Hidden heading\nSee [here](#hidden-heading).\n"},
		{"a heading in an indented code block",
			"Some code:\n\n    ## Indented heading\n\nSee [here](#indented-heading).\n",
			"Some code:\n\n## Indented heading\n\nSee [here](#indented-heading).\n"},
		{"a path out of the repository",
			"See [the main README](../main/README.md).\n",
			"See [the main README](docs/../README.md).\n"},
		{"a combining mark",
			"## Cafe\u0301 hours\n\nSee [here](#cafe-hours).\n",
			"## Cafe\u0301 hours\n\nSee [here](#cafe\u0301-hours).\n"},
	} {
		for doc, ok := range map[string]bool{tt.broken: false, tt.lands: true} {
			links := markdownLinks(doc)
			if len(links) != 1 {
				t.Errorf("%s: %d links found in %q, want 1", tt.form, len(links), doc)
				continue
			}
			if err := checkLinkIn("README.md", doc, links[0].target); (err == nil) != ok {
				t.Errorf("%s: %q: error %v, want ok %v", tt.form, doc, err, ok)
			}
		}
	}

	slugs := headingSlugs("# Seeing it\n## Seeing it\n```sh\n# Seeing it\n```\n### `no_key` and *ban*: [here](x.md)\nSet up\n---\n")
	for _, want := range []string{"seeing-it", "seeing-it-1", "no_key-and-ban-here", "set-up"} {
		if !slugs[want] {
			t.Errorf("slug %q missing from %v", want, slugs)
		}
	}
	if slugs["seeing-it-2"] {
		t.Errorf("a heading in a code block made a slug: %v", slugs)
	}
}

// TestDocsPagesHaveAWholeCaddyfile: every page of docs/ but the index shows
// at least one whole Caddyfile (a site, not a fragment).
func TestDocsPagesHaveAWholeCaddyfile(t *testing.T) {
	t.Parallel()
	for _, file := range docFiles(t) {
		if file == "README.md" || file == filepath.Join("docs", "README.md") {
			continue
		}
		if !slices.ContainsFunc(caddyfileBlocks(t, file), func(b caddyBlock) bool {
			return !strings.Contains(b.text, "<") && wholeCaddyfile(b.text)
		}) {
			t.Errorf("%s has no whole Caddyfile (a site block) among its examples", file)
		}
	}
}

// TestDocsCaddyfilesPassCaddyFmt: every Caddyfile of README.md and
// docs/*.md, whole or a fragment, and example.Caddyfile, is as `caddy fmt`
// writes it, so that one saved and run logs no "input is not formatted".
// Syntax summaries (<placeholders>) are no Caddyfile: their comments stay
// aligned.
// Regression test for issue 31 item 4.
func TestDocsCaddyfilesPassCaddyFmt(t *testing.T) {
	t.Parallel()
	blocks := 0
	for _, file := range docFiles(t) {
		for _, b := range fencedBlocks(t, file, "caddyfile") {
			if strings.Contains(b.text, "<") {
				continue
			}
			blocks++
			if got := string(caddyfile.Format([]byte(b.text))); got != b.text {
				t.Errorf("%s:%d: caddy fmt changes the Caddyfile:\n%s", file, b.line, lineDiff(b.text, got))
			}
		}
	}
	src, err := os.ReadFile("example.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	if got := caddyfile.Format(src); !bytes.Equal(got, src) {
		t.Errorf("example.Caddyfile: caddy fmt changes it:\n%s", lineDiff(string(src), string(got)))
	}
	if blocks < 45 {
		t.Errorf("only %d Caddyfiles found in README.md and docs/; the pattern may have broken", blocks)
	}
}

// fencedBlocks are the fenced code blocks of a language in a Markdown
// file as the code host shows them, and a reader copies them: without the
// indentation of a list item they are in.
func fencedBlocks(t *testing.T, file, lang string) []caddyBlock {
	t.Helper()
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []caddyBlock
	_ = gast.Walk(markdown.Parser().Parse(text.NewReader(src)), func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		fb, ok := n.(*gast.FencedCodeBlock)
		if !ok || !entering || string(fb.Language(src)) != lang {
			return gast.WalkContinue, nil
		}
		var sb strings.Builder
		lines := fb.Lines()
		for i := range lines.Len() {
			seg := lines.At(i)
			sb.WriteString(strings.Repeat(" ", seg.Padding))
			sb.Write(seg.Value(src))
		}
		line := 1
		if lines.Len() > 0 {
			line = bytes.Count(src[:lines.At(0).Start], []byte("\n"))
		}
		blocks = append(blocks, caddyBlock{line: line, text: sb.String()})
		return gast.WalkSkipChildren, nil
	})
	return blocks
}

// lineDiff shows the first line where two texts differ, as it is and as
// it should be.
func lineDiff(have, want string) string {
	h, w := strings.Split(have, "\n"), strings.Split(want, "\n")
	for i := range max(len(h), len(w)) {
		var a, b string
		if i < len(h) {
			a = h[i]
		}
		if i < len(w) {
			b = w[i]
		}
		if a != b {
			return fmt.Sprintf("line %d is  %q\nfmt writes %q", i+1, a, b)
		}
	}
	return "(no line differs)"
}

// TestDocsDrawTheirPictures: the pictures render on the code host from
// Mermaid blocks; the chart's block is drawn by bench/chart, whose test
// checks it against bench/results.
func TestDocsDrawTheirPictures(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ file, picture string }{
		{"README.md", "flowchart"},
		{"docs/how-it-works.md", "flowchart"},
		{"docs/fleet.md", "sequenceDiagram"},
		{"docs/fleet.md", "xychart-beta"},
	} {
		data, err := os.ReadFile(tt.file)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(data), "```mermaid\n"+tt.picture) {
			t.Errorf("%s has no Mermaid %s", tt.file, tt.picture)
		}
	}
}

// markdown reads a document as the code host renders it: CommonMark, with
// GitHub's tables.
var markdown = goldmark.New(goldmark.WithExtensions(extension.Table))

// link is a relative Markdown link.
type link struct {
	line         int
	text, target string
}

var externalLink = regexp.MustCompile(`^[a-z][a-z0-9+.-]*:`)

// markdownLinks are the relative links and images of doc: inline or by
// reference, with or without a title, their text on one line or several;
// none in code.
func markdownLinks(doc string) []link {
	src := []byte(doc)
	var links []link
	_ = gast.Walk(markdown.Parser().Parse(text.NewReader(src)), func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		var target string
		switch n := n.(type) {
		case *gast.Link:
			target = string(n.Destination)
		case *gast.Image:
			target = string(n.Destination)
		default:
			return gast.WalkContinue, nil
		}
		if entering && !externalLink.MatchString(target) {
			line := 1 + bytes.Count(src[:max(n.Pos(), 0)], []byte("\n"))
			links = append(links, link{line, inlineText(n, src), target})
		}
		return gast.WalkContinue, nil
	})
	return links
}

// checkLink resolves a link target written in file, as it is on disk.
func checkLink(file, target string) error {
	data, err := os.ReadFile(file)
	if err != nil {
		return err
	}
	return checkLinkIn(file, string(data), target)
}

// checkLinkIn resolves a link target written in file, whose text is doc:
// the path stays in the repository and exists, and the anchor is a
// heading's, of doc itself when the path is empty.
func checkLinkIn(file, doc, target string) error {
	path, anchor, _ := strings.Cut(target, "#")
	resolved := file
	if path != "" {
		resolved = filepath.Join(filepath.Dir(file), path)
		if !filepath.IsLocal(resolved) {
			return fmt.Errorf("%s is outside the repository", resolved)
		}
		if _, err := os.Stat(resolved); err != nil {
			return fmt.Errorf("no file %s", resolved)
		}
		if anchor == "" {
			return nil
		}
		if !strings.HasSuffix(resolved, ".md") {
			return fmt.Errorf("an anchor into %s, which is not Markdown", resolved)
		}
		data, err := os.ReadFile(resolved)
		if err != nil {
			return err
		}
		doc = string(data)
	}
	if anchor != "" && !headingSlugs(doc)[anchor] {
		return fmt.Errorf("%s has no heading whose anchor is #%s", resolved, anchor)
	}
	return nil
}

// headingSlugs are the anchors GitHub makes for a document's headings (ATX
// or setext, none in code): the heading's text, lowercased, with every
// character but letters, marks, digits, connector punctuation such as _,
// spaces and - removed, and spaces made -; a repeated slug gets -1, -2...
func headingSlugs(doc string) map[string]bool {
	src := []byte(doc)
	slugs := map[string]bool{}
	seen := map[string]int{}
	_ = gast.Walk(markdown.Parser().Parse(text.NewReader(src)), func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		if _, ok := n.(*gast.Heading); !ok || !entering {
			return gast.WalkContinue, nil
		}
		var sb strings.Builder
		for _, r := range strings.ToLower(inlineText(n, src)) {
			switch {
			case unicode.In(r, unicode.L, unicode.M, unicode.Nd, unicode.Pc) || r == '-':
				sb.WriteRune(r)
			case r == ' ':
				sb.WriteRune('-')
			}
		}
		slug := sb.String()
		if k := seen[slug]; k > 0 {
			slugs[fmt.Sprintf("%s-%d", slug, k)] = true
		} else {
			slugs[slug] = true
		}
		seen[slug]++
		return gast.WalkSkipChildren, nil
	})
	return slugs
}

// inlineText is the text n shows: that of its text, code spans, emphasis
// and links, without markup, images or raw HTML tags.
func inlineText(n gast.Node, src []byte) string {
	var sb strings.Builder
	_ = gast.Walk(n, func(c gast.Node, entering bool) (gast.WalkStatus, error) {
		if !entering {
			return gast.WalkContinue, nil
		}
		switch c := c.(type) {
		case *gast.Image:
			return gast.WalkSkipChildren, nil
		case *gast.Text:
			sb.Write(c.Segment.Value(src))
			if c.SoftLineBreak() || c.HardLineBreak() {
				sb.WriteByte(' ')
			}
		case *gast.String:
			sb.Write(c.Value)
		case *gast.AutoLink:
			sb.Write(c.Label(src))
		}
		return gast.WalkContinue, nil
	})
	return sb.String()
}

// subdirective is one subdirective the Caddyfile parser accepts, in
// the block it belongs to.
type subdirective struct {
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
func parserSubdirectives(t *testing.T) []subdirective {
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
	var subs []subdirective
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
							subs = append(subs, subdirective{block: block, name: name, flag: isFlagCase(stmt.(*ast.CaseClause))})
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
		subs = append(subs, subdirective{block: "key", name: m.ID.Name()})
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

// readReference reads docs/caddyfile.md's lines, as markdown parses it:
// the lines of its ```caddyfile blocks, and the others outside code.
func readReference(t *testing.T) []referenceLine {
	t.Helper()
	src, err := os.ReadFile("docs/caddyfile.md")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(src), "\n")
	lineOf := func(offset int) int { return bytes.Count(src[:offset], []byte("\n")) }
	skip := make([]bool, len(lines)) // a fence, or a line of another block than a Caddyfile
	block := make([]int, len(lines)) // 1 + the index of the Caddyfile the line is in; 0 outside
	heading := make([]bool, len(lines))
	var concrete []bool // by Caddyfile
	_ = gast.Walk(markdown.Parser().Parse(text.NewReader(src)), func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		if !entering {
			return gast.WalkContinue, nil
		}
		switch n := n.(type) {
		case *gast.FencedCodeBlock:
			ls := n.Lines()
			if ls.Len() == 0 {
				return gast.WalkSkipChildren, nil
			}
			first, last := lineOf(ls.At(0).Start), lineOf(ls.At(ls.Len()-1).Start)
			skip[first-1] = true
			if last+1 < len(lines) {
				skip[last+1] = true
			}
			caddy := string(n.Language(src)) == "caddyfile"
			if caddy {
				concrete = append(concrete, !strings.Contains(strings.Join(lines[first:last+1], "\n"), "<"))
			}
			for i := first; i <= last; i++ {
				if caddy {
					block[i] = len(concrete)
				} else {
					skip[i] = true
				}
			}
			return gast.WalkSkipChildren, nil
		case *gast.Heading:
			if ls := n.Lines(); ls.Len() > 0 {
				heading[lineOf(ls.At(0).Start)] = true
			}
		}
		return gast.WalkContinue, nil
	})
	var out []referenceLine
	section := ""
	for i, line := range lines {
		switch {
		case skip[i]:
		case block[i] > 0:
			out = append(out, referenceLine{n: i + 1, text: line, inBlock: true, concrete: concrete[block[i]-1], section: section})
		default:
			if heading[i] {
				section = line
			}
			out = append(out, referenceLine{n: i + 1, text: line, section: section})
		}
	}
	return out
}

// firstFields are the line's first two fields.
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

// mentionedBy reports whether a reference line names the subdirective: as the
// first word of a Caddyfile line, or in backticks in prose.
func (s subdirective) mentionedBy(l referenceLine) bool {
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
func exampleElsewhere(t *testing.T, s subdirective) string {
	for _, file := range docFiles(t) {
		if file == filepath.Join("docs", "caddyfile.md") {
			continue
		}
		for _, b := range fencedBlocks(t, file, "caddyfile") {
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

// TestDocsCaddyfileGivesEverySubdirectiveADefaultAndAnExample:
// docs/caddyfile.md holds every subdirective, its default and an example. For each subdirective the parser accepts:
//   - documented: named in the reference;
//   - an example: a line that starts with it in a ```caddyfile block with
//     no <placeholders> (one that TestReadmeExamplesAdapt adapts), not only
//     in a syntax summary;
//   - a default: a line that names it says what holds without it (see
//     statesDefault), or its own section does. Spared: flags, whose default
//     is off; keyers, which have none; and a tier's conditions (match,
//     claim, keyer), since the tier section says a tier without conditions
//     applies to everyone.
func TestDocsCaddyfileGivesEverySubdirectiveADefaultAndAnExample(t *testing.T) {
	t.Parallel()
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

// TestDocsOperatingListsEveryMetric: every metric the package and its
// store register is in docs/operating.md's table.
func TestDocsOperatingListsEveryMetric(t *testing.T) {
	t.Parallel()
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

// TestDocsCaddyfileListsEveryPlaceholder: every name the handler's
// placeholder function answers (the case labels of decision.placeholder,
// and the claim. prefix) is in docs/caddyfile.md's table.
func TestDocsCaddyfileListsEveryPlaceholder(t *testing.T) {
	t.Parallel()
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

// TestDocsEveryNamedTestExists: every Test... or Fuzz... the docs
// name in backticks (docs/guarantees.md's table above all) is a function
// of some _test.go file of the repository.
func TestDocsEveryNamedTestExists(t *testing.T) {
	t.Parallel()
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

// TestDocsStatedDefaultsMatchTheCode reads the defaults the
// reference states and compares each with the constant the code applies.
func TestDocsStatedDefaultsMatchTheCode(t *testing.T) {
	t.Parallel()
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

// TestDocsPoolSizeDefaultsAreTheClientsOfOneNodeAndOfACluster:
// docs/caddyfile.md states pool_size's default per CPU for one node and
// for each node of a Cluster (go-redis's ClusterOptions default differs);
// each is checked against the client read out of a connection the
// store's own code makes.
// Regression test for a74481c.
func TestDocsPoolSizeDefaultsAreTheClientsOfOneNodeAndOfACluster(t *testing.T) {
	t.Parallel()
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
