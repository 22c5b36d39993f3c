package ratelimit

import (
	"bytes"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	gast "github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/text"
)

// TestReadmeExamplesAdapt adapts every Caddyfile snippet of README.md and
// docs/*.md as a reader would paste it, so that the documentation cannot
// drift from the parser: each ```caddyfile block, and each inline code span
// that is a line of a rate_limit or tier block, such as
// `cost {http.request.header.X-Batch}`. A whole Caddyfile adapts as it is; a
// bare rate_limit directive (or handle block) goes into a site; a bare
// subdirective goes into the rate_limit block the page showed last, or a
// minimal one; a tier's condition into a tier of that block. Syntax
// summaries (<placeholders>; inline, also a|b and ...) are skipped, and the
// mistakes the docs name must be refused.
// Regression test for issue 30 item 4.
func TestReadmeExamplesAdapt(t *testing.T) {
	t.Parallel()
	mistakes := map[string]bool{}
	for _, m := range docMistakes {
		mistakes[m] = false
	}
	blocks, spans := 0, 0
	for _, file := range docFiles(t) {
		page := ""
		for _, s := range caddyfileSnippets(t, file) {
			if strings.Contains(s.text, "<") || s.inline && (strings.Contains(s.text, "|") || strings.Contains(s.text, "...") || strings.Contains(s.text, "…")) {
				continue
			}
			text := s.text
			if s.inline {
				text = ownLines(text)
			}
			cfg := pasted(text, page)
			_, err := adaptCaddyfile(cfg)
			if _, ok := mistakes[s.text]; ok {
				mistakes[s.text] = true
				if err == nil {
					t.Errorf("%s:%d: the docs show `%s` as a mistake, but it adapts:\n%s", file, s.line, s.text, cfg)
				}
				continue
			}
			if err != nil {
				t.Errorf("%s:%d: the example does not adapt as pasted: %v\n%s", file, s.line, err, cfg)
			}
			if s.inline {
				spans++
			} else {
				blocks++
				if blockOf(s.text, "rate_limit") >= 0 {
					page = s.text
				}
			}
		}
	}
	for m, seen := range mistakes {
		if !seen {
			t.Errorf("no page shows the mistake `%s` any more; drop it from docMistakes", m)
		}
	}
	if blocks < 45 || spans < 20 {
		t.Errorf("only %d blocks and %d inline snippets found in README.md and docs/; the pattern may have broken", blocks, spans)
	}
}

// docMistakes are the inline snippets the docs show as mistakes, which
// must fail `caddy adapt`.
var docMistakes = []string{"quota 0/day", "quota 5/fortnight", "max_wait 0", "max_waiting 0", "concurrency 0", "match {}"}

// tierConditions are the lines only a tier block takes: a reader pastes
// them into a tier.
var tierConditions = []string{"capacity", "refill", "match", "claim", "keyer", "unlimited", "deny"}

// ownLines puts the block of an inline snippet on lines of its own, as
// Caddy wants it: prose writes `store redis { address ... }` on one.
func ownLines(snippet string) string {
	if f := codeFields(snippet); len(f) > 2 && f[len(f)-1] == "}" {
		if open, ok := strings.CutSuffix(snippet, " }"); ok {
			return strings.Replace(open, " { ", " {\n", 1) + "\n}"
		}
	}
	return snippet
}

// needs are the lines a line needs beside it, which the parser asks for
// when the block lacks them: `no_key deny` wants a key to try first.
var needs = map[string]string{"no_key": "key header X-Key"}

// pasted is the whole Caddyfile a reader gets from a snippet: page is the
// last ```caddyfile block of the page that holds a rate_limit directive
// ("" before any).
func pasted(snippet, page string) string {
	site := func(body string) string { return "http://127.0.0.1:9 {\n" + body + "\n}\n" }
	first := strings.Fields(snippet)[0]
	switch {
	case wholeCaddyfile(snippet):
		return snippet
	case first == "rate_limit" || first == "handle":
		return site(snippet)
	case slices.Contains(tierConditions, first):
		snippet = "tier snippet 100 10/s {\n" + snippet + "\n}"
	}
	if page == "" {
		page = "rate_limit 100 10/s {\n}"
	}
	if need, ok := needs[first]; ok && blockOf(page, strings.Fields(need)[0]) < 0 {
		snippet = need + "\n" + snippet
	}
	cfg := intoRateLimit(page, snippet)
	if !wholeCaddyfile(cfg) {
		cfg = site(cfg)
	}
	return cfg
}

// intoRateLimit pastes the lines of a rate_limit block into the first
// rate_limit directive of page: in place of the block's own lines of the
// same name, as a reader who pastes `headers ietf` replaces `headers both`.
// Lines that may repeat (key, limit, quota, a tier of another name) are
// added.
func intoRateLimit(page, lines string) string {
	pl := strings.Split(strings.TrimRight(page, "\n"), "\n")
	at := blockOf(page, "rate_limit")
	if f := codeFields(pl[at]); f[len(f)-1] != "{" {
		pl[at] += " {"
		pl = slices.Insert(pl, at+1, "}")
	}
	end := at + 1 + blockLen(pl[at+1:])
	pasting := map[string]bool{}
	for _, e := range entries(strings.Split(lines, "\n")) {
		pasting[e.name] = true
	}
	var body []string
	for _, e := range entries(pl[at+1 : end]) {
		if e.name == "" || !pasting[e.name] {
			body = append(body, e.lines...)
		}
	}
	body = append(body, lines)
	out := slices.Concat(pl[:at+1], body, pl[end:])
	return strings.Join(out, "\n") + "\n"
}

// blockOf is the index of the first line of s that is a directive of that
// name, -1 when none is.
func blockOf(s, directive string) int {
	for i, l := range strings.Split(s, "\n") {
		if f := codeFields(l); len(f) > 0 && f[0] == directive {
			return i
		}
	}
	return -1
}

// blockLen is how many of lines come before the one that closes the block
// they are in.
func blockLen(lines []string) int {
	depth := 0
	for i, l := range lines {
		depth += braces(l)
		if depth < 0 {
			return i
		}
	}
	return len(lines)
}

// braces is a line's opening braces less its closing ones, counting only
// those that stand alone, as Caddyfile blocks do, not placeholders.
func braces(line string) int {
	n := 0
	for _, f := range codeFields(line) {
		switch f {
		case "{":
			n++
		case "}":
			n--
		}
	}
	return n
}

// codeFields are a Caddyfile line's tokens, without its comment.
func codeFields(line string) []string {
	f := strings.Fields(line)
	for i, w := range f {
		if strings.HasPrefix(w, "#") {
			return f[:i]
		}
	}
	return f
}

// entry is one line of a block with the lines of its own block, if any.
type entry struct {
	name  string // what a pasted line replaces; "" for lines that add
	lines []string
}

func entries(lines []string) []entry {
	var out []entry
	depth := 0
	for _, l := range lines {
		f := codeFields(l)
		if depth == 0 && len(f) > 0 {
			name := f[0]
			switch {
			case name == "tier" && len(f) > 1:
				name += " " + f[1]
			case name == "key" || name == "limit" || name == "quota":
				name = ""
			}
			out = append(out, entry{name: name})
		}
		if len(out) > 0 {
			out[len(out)-1].lines = append(out[len(out)-1].lines, l)
		}
		depth += braces(l)
	}
	return out
}

// TestReadmeExamplesAdaptPastesAsAReaderWould checks the pasting above on
// a page of the reference's shape.
func TestReadmeExamplesAdaptPastesAsAReaderWould(t *testing.T) {
	t.Parallel()
	page := "rate_limit {\n\tkey header X-API-Key\n\ttier pro {\n\t\tlimit 100 100/s\n\t}\n\tlimit 10 10/s\n\theaders both\n}\n"
	for _, tt := range []struct{ snippet, page, want string }{
		{"cost {http.request.header.X-Batch}", page, "http://127.0.0.1:9 {\nrate_limit {\n\tkey header X-API-Key\n\ttier pro {\n\t\tlimit 100 100/s\n\t}\n\tlimit 10 10/s\n\theaders both\ncost {http.request.header.X-Batch}\n}\n\n}\n"},
		{"headers ietf", page, "http://127.0.0.1:9 {\nrate_limit {\n\tkey header X-API-Key\n\ttier pro {\n\t\tlimit 100 100/s\n\t}\n\tlimit 10 10/s\nheaders ietf\n}\n\n}\n"},
		{"quota 5/month", page, "http://127.0.0.1:9 {\nrate_limit {\n\tkey header X-API-Key\n\ttier pro {\n\t\tlimit 100 100/s\n\t}\n\tlimit 10 10/s\n\theaders both\nquota 5/month\n}\n\n}\n"},
		{"quota 5/month", "", "http://127.0.0.1:9 {\nrate_limit 100 10/s {\nquota 5/month\n}\n\n}\n"},
		{"max_wait 1s", "http://127.0.0.1:9 {\n\trate_limit 60 1/s\n\trespond ok\n}", "http://127.0.0.1:9 {\n\trate_limit 60 1/s {\nmax_wait 1s\n}\n\trespond ok\n}\n"},
		{"claim plan pro", "", "http://127.0.0.1:9 {\nrate_limit 100 10/s {\ntier snippet 100 10/s {\nclaim plan pro\n}\n}\n\n}\n"},
		{"rate_limit 200 50/s", page, "http://127.0.0.1:9 {\nrate_limit 200 50/s\n}\n"},
	} {
		if got := pasted(tt.snippet, tt.page); got != tt.want {
			t.Errorf("%q pasted:\n%s\nwant:\n%s", tt.snippet, got, tt.want)
		}
	}
}

// TestCodeMapNamesEveryFile checks docs/code-map.md against the package:
// every source file of the root is in it, and every file it names, under
// internal/ too, exists.
func TestCodeMapNamesEveryFile(t *testing.T) {
	t.Parallel()
	codeMap, err := os.ReadFile("docs/code-map.md")
	if err != nil {
		t.Fatal(err)
	}
	named := map[string]bool{}
	for _, m := range regexp.MustCompile("`([a-z_/]+\\.go)`").FindAllStringSubmatch(string(codeMap), -1) {
		named[m[1]] = true
		if _, err := os.Stat(m[1]); err != nil {
			t.Errorf("the code map names %s, which does not exist", m[1])
		}
	}
	files, _ := filepath.Glob("*.go")
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") && !named[f] {
			t.Errorf("%s is not in docs/code-map.md", f)
		}
	}
}

// caddyBlock is one ```caddyfile block of a Markdown file.
type caddyBlock struct {
	line   int // of its opening fence
	text   string
	inline bool // a code span in the text, not a block
}

// caddyfileBlocks are a Markdown file's ```caddyfile blocks, as a reader
// copies them (fencedBlocks).
func caddyfileBlocks(t *testing.T, file string) []caddyBlock {
	t.Helper()
	return fencedBlocks(t, file, "caddyfile")
}

// caddyfileSnippets are a Markdown file's ```caddyfile blocks and the
// inline code spans that are lines of a rate_limit or tier block (their
// first word a subdirective the parser takes, and a value after it), in
// the order of the page. `key jwt` alone names a keyer: not a line.
func caddyfileSnippets(t *testing.T, file string) []caddyBlock {
	t.Helper()
	lineNames := map[string]bool{"rate_limit": true}
	for _, s := range parserSubdirectives(t) {
		if s.block == "rate_limit" || s.block == "tier" {
			lineNames[s.name] = true
		}
	}
	src, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	snippets := caddyfileBlocks(t, file)
	_ = gast.Walk(markdown.Parser().Parse(text.NewReader(src)), func(n gast.Node, entering bool) (gast.WalkStatus, error) {
		span, ok := n.(*gast.CodeSpan)
		if !ok || !entering {
			return gast.WalkContinue, nil
		}
		s := inlineText(span, src)
		if f := strings.Fields(s); len(f) > 1 && lineNames[f[0]] && !(len(f) == 2 && f[0] == "key") {
			line := 1 + bytes.Count(src[:span.FirstChild().(*gast.Text).Segment.Start], []byte("\n"))
			snippets = append(snippets, caddyBlock{line: line, text: s, inline: true})
		}
		return gast.WalkSkipChildren, nil
	})
	slices.SortStableFunc(snippets, func(a, b caddyBlock) int { return a.line - b.line })
	return snippets
}

// wholeCaddyfile reports whether an example is a whole Caddyfile: it
// starts with global options or a site address.
func wholeCaddyfile(block string) bool {
	first := strings.Fields(block)[0]
	return first == "{" || strings.Contains(first, ".") || strings.Contains(first, ":")
}
