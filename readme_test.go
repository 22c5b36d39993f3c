package ratelimit

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeExamplesAdapt adapts every Caddyfile example in README.md and
// docs/*.md, so that the documentation cannot drift from the parser.
// Syntax summaries (with <placeholders>) are skipped; whole Caddyfiles
// (a site address or global options first) adapt as they are; fragments
// are wrapped in a site, and subdirectives in a rate_limit block.
func TestReadmeExamplesAdapt(t *testing.T) {
	tested := 0
	for _, file := range docFiles(t) {
		for _, b := range caddyfileBlocks(t, file) {
			if strings.Contains(b.text, "<") {
				continue
			}
			first := strings.Fields(b.text)[0]
			var cfg string
			switch {
			case wholeCaddyfile(b.text):
				cfg = b.text
			case first == "rate_limit" || first == "handle":
				cfg = "http://127.0.0.1:9 {\n" + b.text + "\n}\n"
			default:
				cfg = "http://127.0.0.1:9 {\nrate_limit 10 1/s {\n" + b.text + "\n}\n}\n"
			}
			if _, err := adaptCaddyfile(cfg); err != nil {
				t.Errorf("%s:%d: the example does not adapt: %v\n%s", file, b.line, err, b.text)
			}
			tested++
		}
	}
	if tested < 45 {
		t.Errorf("only %d examples found in README.md and docs/; the pattern may have broken", tested)
	}
}

// TestCodeMapNamesEveryFile checks docs/code-map.md against the package:
// every source file of the root is in it, and every file it names, under
// internal/ too, exists.
func TestCodeMapNamesEveryFile(t *testing.T) {
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
	line int // of its opening fence
	text string
}

var caddyfileFence = regexp.MustCompile("(?s)```caddyfile\n(.*?)```")

func caddyfileBlocks(t *testing.T, file string) []caddyBlock {
	t.Helper()
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var blocks []caddyBlock
	for _, m := range caddyfileFence.FindAllSubmatchIndex(data, -1) {
		line := 1 + strings.Count(string(data[:m[0]]), "\n")
		blocks = append(blocks, caddyBlock{line, string(data[m[2]:m[3]])})
	}
	return blocks
}

// wholeCaddyfile reports whether an example is a whole Caddyfile: it
// starts with global options or a site address.
func wholeCaddyfile(block string) bool {
	first := strings.Fields(block)[0]
	return first == "{" || strings.Contains(first, ".") || strings.Contains(first, ":")
}
