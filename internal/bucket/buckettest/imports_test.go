package buckettest

import (
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const importPath = "github.com/bramsley/caddy-ratelimit/internal/bucket/buckettest"

// productionImporters lists the Go files under root, tests aside, that
// import this package: a model in the production build would be code no
// request runs, and its steps could drift into the engines'.
func productionImporters(t *testing.T, root string) []string {
	t.Helper()
	var found []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		name := d.Name()
		if d.IsDir() {
			if path != root && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "vendor") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		for _, imp := range f.Imports {
			if p, _ := strconv.Unquote(imp.Path.Value); p == importPath {
				found = append(found, path)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// Only tests import the models: no file of the module's production build
// does, whatever its build tags.
func TestOnlyTestsImportBuckettest(t *testing.T) {
	t.Parallel()
	root := filepath.Join("..", "..", "..")
	if _, err := os.Stat(filepath.Join(root, "go.mod")); err != nil {
		t.Fatalf("the module's root is not at %s: %v", root, err)
	}
	if found := productionImporters(t, root); len(found) > 0 {
		t.Errorf("production files import %s, which only tests may: %v", importPath, found)
	}
	// The mutation: a production file that imports it is caught, beside a
	// test file that may.
	dir := t.TempDir()
	for name, src := range map[string]string{
		"engine.go":      "package engine\n\nimport _ \"" + importPath + "\"\n",
		"engine_test.go": "package engine\n\nimport _ \"" + importPath + "\"\n",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if found := productionImporters(t, dir); len(found) != 1 || filepath.Base(found[0]) != "engine.go" {
		t.Errorf("a production file that imports the models: found %v, want engine.go alone", found)
	}
}
