package main

import (
	"os"
	"strings"
	"testing"
)

// TestCommittedChartIsDrawnFromTheResults fails when docs/fleet.md's chart
// is not what this program draws from the committed bench/results, so that
// the picture cannot drift from the figures: run go run ./bench/chart.
func TestCommittedChartIsDrawnFromTheResults(t *testing.T) {
	if err := run("../..", true); err != nil {
		t.Fatal(err)
	}
}

func TestBarsAreMediansOfRunsAndOfPairedRounds(t *testing.T) {
	lat, err := latencyChart([][]string{{"1", "strict", "40"}, {"1", "lease", "1"}, {"2", "strict", "44"}, {"2", "lease", "3"}, {"3", "strict", "41"}, {"3", "lease", "2"}})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(lat, `x-axis ["strict", "lease"]`) || !strings.Contains(lat, "bar [41.0, 2.00]") || !strings.Contains(lat, `y-axis "ms" 0 --> 50`) {
		t.Errorf("latency chart:\n%s\nwant bars strict 41.0 and lease 2.00 (medians of runs), axis to 50", lat)
	}
	// Paired: each round's ratio (0.5, 3, 0.5), then their median, 0.5; the
	// ratio of the medians would be 20/10 = 2.
	thr, err := throughputChart([][]string{
		{"r", "a", "-", "plain", "10 10 40"},
		{"r", "b", "a", "setup", "5 30 20"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(thr, "bar [0.50]") {
		t.Errorf("throughput chart:\n%s\nwant the median of the paired ratios 0.5, 3, 0.5: 0.50", thr)
	}
	if _, err := throughputChart([][]string{{"r", "b", "a", "setup", "5 30"}}); err == nil {
		t.Error("a bar whose baseline is missing was drawn")
	}
}

func TestSpliceReplacesOnlyBetweenTheMarkers(t *testing.T) {
	doc := "before\n" + beginMarker + "\nold\n" + endMarker + "\nafter\n"
	got, err := splice([]byte(doc), "new\n")
	if err != nil {
		t.Fatal(err)
	}
	if want := "before\n" + beginMarker + "\nnew\n" + endMarker + "\nafter\n"; string(got) != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if _, err := splice([]byte("no markers\n"), "new\n"); err == nil {
		t.Error("a document without markers was spliced")
	}
}

func TestCheckReportsAStaleChart(t *testing.T) {
	root := t.TempDir()
	for _, dir := range []string{"docs", "bench/results"} {
		if err := os.MkdirAll(root+"/"+dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"bench/results/latency.tsv", "bench/results/throughput.tsv"} {
		data, err := os.ReadFile("../../" + f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(root+"/"+f, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stale := "# Fleet\n" + beginMarker + "\nan old chart\n" + endMarker + "\n"
	if err := os.WriteFile(root+"/"+docPath, []byte(stale), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := run(root, true); err == nil {
		t.Fatal("-check passed a stale chart")
	}
	if err := run(root, false); err != nil {
		t.Fatal(err)
	}
	if err := run(root, true); err != nil {
		t.Errorf("-check after a redraw: %v", err)
	}
}
