package ratelimit

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeExamplesAdapt adapts every Caddyfile example in README.md, so
// that the documentation cannot drift from the parser. Syntax summaries
// (with <placeholders>) are skipped; fragments are wrapped in a site, and
// subdirectives in a rate_limit block.
func TestReadmeExamplesAdapt(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := regexp.MustCompile("(?s)```caddyfile\n(.*?)```").FindAllStringSubmatch(string(readme), -1)
	tested := 0
	for _, m := range blocks {
		block := m[1]
		if strings.Contains(block, "<") {
			continue
		}
		first := strings.Fields(block)[0]
		var cfg string
		switch {
		case strings.Contains(first, ".") || strings.Contains(first, ":"):
			cfg = block
		case first == "rate_limit" || first == "handle":
			cfg = "http://127.0.0.1:9 {\n" + block + "\n}\n"
		default:
			cfg = "http://127.0.0.1:9 {\nrate_limit 10 1/s {\n" + block + "\n}\n}\n"
		}
		if _, err := adaptCaddyfile(cfg); err != nil {
			t.Errorf("README example does not adapt: %v\n%s", err, block)
		}
		tested++
	}
	if tested < 10 {
		t.Errorf("only %d README examples found; the pattern may have broken", tested)
	}
}

// TestCodeMapNamesEveryFile checks the README's code map against the
// package: every source file is in it, and every file it names exists.
func TestCodeMapNamesEveryFile(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, codeMap, ok := strings.Cut(string(readme), "## Code map")
	if !ok {
		t.Fatal("README.md has no Code map section")
	}
	codeMap, _, _ = strings.Cut(codeMap, "\nTests sit beside")
	named := map[string]bool{}
	for _, m := range regexp.MustCompile("`([a-z_/]+\\.go)`").FindAllStringSubmatch(codeMap, -1) {
		named[m[1]] = true
		if _, err := os.Stat(m[1]); err != nil {
			t.Errorf("the code map names %s, which does not exist", m[1])
		}
	}
	files, _ := filepath.Glob("*.go")
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") && !named[f] {
			t.Errorf("%s is not in the README's code map", f)
		}
	}
}
