package ratelimit

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
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

// TestDocsLinksLand checks every relative link of README.md and docs/*.md,
// [text](path), [text](path#anchor) and [text](#anchor): the file exists,
// and the anchor is a heading of the target, as the code host makes them.
func TestDocsLinksLand(t *testing.T) {
	checked := 0
	for _, file := range docFiles(t) {
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range markdownLinks(string(data)) {
			if err := checkLink(file, l.target); err != nil {
				t.Errorf("%s:%d: [%s](%s): %v", file, l.line, l.text, l.target, err)
			}
			checked++
		}
	}
	if checked < 50 {
		t.Errorf("only %d relative links found; the pattern may have broken", checked)
	}
}

// TestDocsLinkCheckerFindsBrokenLinks makes sure the checker above is not
// vacuous: a missing file, a missing anchor and a second heading's slug.
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
		{"docs/no-such-page.md", false},
		{"docs/fleet.md#no-such-heading", false},
		{"docs/fleet.md#Sizing", false},
		{"#an-example", true},
		{"#no-such-heading", false},
	} {
		if err := checkLink("README.md", tt.target); (err == nil) != tt.ok {
			t.Errorf("%s: error %v, want ok %v", tt.target, err, tt.ok)
		}
	}
	slugs := headingSlugs("# Seeing it\n## Seeing it\n```sh\n# Seeing it\n```\n### `no_key` and *ban*: [here](x.md)\n")
	for _, want := range []string{"seeing-it", "seeing-it-1", "no_key-and-ban-here"} {
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

// link is a relative Markdown link.
type link struct {
	line         int
	text, target string
}

var (
	markdownLink = regexp.MustCompile(`!?\[([^\]]*)\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeSpan     = regexp.MustCompile("`[^`\n]*`")
	externalLink = regexp.MustCompile(`^[a-z][a-z0-9+.-]*:`)
)

// markdownLinks are the relative links outside code blocks and code spans.
func markdownLinks(doc string) []link {
	var links []link
	for i, line := range proseLines(doc) {
		line = codeSpan.ReplaceAllStringFunc(line, func(s string) string {
			return strings.Repeat("`", len(s)) // keeps [`text`](x) a link, empties `[a](b)`
		})
		for _, m := range markdownLink.FindAllStringSubmatch(line, -1) {
			if !externalLink.MatchString(m[2]) {
				links = append(links, link{i + 1, m[1], m[2]})
			}
		}
	}
	return links
}

// proseLines are the lines of doc, with those inside fenced code blocks
// blanked, so that line numbers stay right.
func proseLines(doc string) []string {
	lines := strings.Split(doc, "\n")
	fenced := false
	for i, line := range lines {
		if strings.HasPrefix(strings.TrimLeft(line, " "), "```") {
			fenced = !fenced
			lines[i] = ""
		} else if fenced {
			lines[i] = ""
		}
	}
	return lines
}

// checkLink resolves a link target written in file.
func checkLink(file, target string) error {
	path, anchor, _ := strings.Cut(target, "#")
	resolved := file
	if path != "" {
		resolved = filepath.Join(filepath.Dir(file), path)
		if _, err := os.Stat(resolved); err != nil {
			return fmt.Errorf("no file %s", resolved)
		}
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
	if !headingSlugs(string(data))[anchor] {
		return fmt.Errorf("%s has no heading whose anchor is #%s", resolved, anchor)
	}
	return nil
}

var (
	atxHeading  = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
	headingLink = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)
)

// headingSlugs are the anchors GitHub makes for a document's headings: the
// heading's text, lowercased, with every character but letters, digits,
// spaces, - and _ removed and spaces made -; a repeated slug gets -1, -2...
func headingSlugs(doc string) map[string]bool {
	slugs := map[string]bool{}
	seen := map[string]int{}
	for _, line := range proseLines(doc) {
		m := atxHeading.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		text := headingLink.ReplaceAllString(m[1], "$1")
		var sb strings.Builder
		for _, r := range strings.ToLower(text) {
			switch {
			case unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_':
				sb.WriteRune(r)
			case r == ' ':
				sb.WriteRune('-')
			}
		}
		slug := sb.String()
		if n := seen[slug]; n > 0 {
			slugs[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			slugs[slug] = true
		}
		seen[slug]++
	}
	return slugs
}
