package ratelimit

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/yuin/goldmark"
	gast "github.com/yuin/goldmark/ast"
	"github.com/yuin/goldmark/extension"
	"github.com/yuin/goldmark/text"
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
