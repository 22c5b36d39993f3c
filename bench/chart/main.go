// Command chart draws the measured figures of bench/results as Mermaid
// charts in docs/fleet.md, so that the picture is redrawn from the figures,
// never edited by hand. Run it from the repository's root after changing a
// results file:
//
//	go run ./bench/chart          # rewrite docs/fleet.md's chart
//	go run ./bench/chart -check   # only report whether it is current
//
// It replaces what lies between the lines <!-- chart:begin --> and
// <!-- chart:end --> with two xychart-beta bar charts, each followed by a
// table of the figures behind it:
//   - bench/results/latency.tsv: the median answer time of allowed requests
//     with Redis 20 ms away, per mode; a bar is the median over runs.
//   - bench/results/throughput.tsv: requests a second per round of
//     bench/run.sh; a bar is the median over rounds of a setup's figure
//     divided by its baseline's in the same round.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

const (
	beginMarker = "<!-- chart:begin -->"
	endMarker   = "<!-- chart:end -->"
	docPath     = "docs/fleet.md"
)

func main() {
	root := flag.String("root", ".", "the repository's root")
	check := flag.Bool("check", false, "report whether the chart is current; change nothing")
	flag.Parse()
	if err := run(*root, *check); err != nil {
		fmt.Fprintln(os.Stderr, "chart:", err)
		os.Exit(1)
	}
}

func run(root string, check bool) error {
	block, err := render(root)
	if err != nil {
		return err
	}
	path := filepath.Join(root, docPath)
	doc, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	updated, err := splice(doc, block)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if bytes.Equal(doc, updated) {
		return nil
	}
	if check {
		return fmt.Errorf("%s: the chart differs from bench/results; run go run ./bench/chart", path)
	}
	return os.WriteFile(path, updated, 0o644)
}

// render is the text that belongs between the markers.
func render(root string) (string, error) {
	latency, err := readTable(filepath.Join(root, "bench/results/latency.tsv"), 3)
	if err != nil {
		return "", err
	}
	throughput, err := readTable(filepath.Join(root, "bench/results/throughput.tsv"), 5)
	if err != nil {
		return "", err
	}
	lat, err := latencyChart(latency)
	if err != nil {
		return "", fmt.Errorf("latency.tsv: %w", err)
	}
	thr, err := throughputChart(throughput)
	if err != nil {
		return "", fmt.Errorf("throughput.tsv: %w", err)
	}
	return "<!-- Drawn by go run ./bench/chart from bench/results: edit those, not this. -->\n\n" + lat + "\n" + thr, nil
}

// splice puts block between the markers of doc.
func splice(doc []byte, block string) ([]byte, error) {
	s := string(doc)
	begin := strings.Index(s, beginMarker+"\n")
	end := strings.Index(s, endMarker)
	if begin < 0 || end < begin {
		return nil, errors.New("no " + beginMarker + " line followed by " + endMarker)
	}
	begin += len(beginMarker) + 1
	return []byte(s[:begin] + block + s[end:]), nil
}

// readTable reads a tab-separated file with cols columns, leaving out
// blank lines and # comments.
func readTable(path string, cols int) ([][]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var rows [][]string
	for i, line := range strings.Split(string(data), "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		row := strings.Split(line, "\t")
		if len(row) != cols {
			return nil, fmt.Errorf("%s:%d: %d columns, want %d", path, i+1, len(row), cols)
		}
		rows = append(rows, row)
	}
	if len(rows) == 0 {
		return nil, fmt.Errorf("%s: no rows", path)
	}
	return rows, nil
}

// bar is one bar of a chart and the figures behind it.
type bar struct {
	label   string
	figures []float64 // one per run or round
	value   float64   // what the bar shows
}

// latencyChart draws one bar per mode: the median of its runs, in ms.
// Rows are: run, mode, median_ms.
func latencyChart(rows [][]string) (string, error) {
	var bars []*bar
	for _, row := range rows {
		v, err := strconv.ParseFloat(row[2], 64)
		if err != nil {
			return "", fmt.Errorf("run %s, %s: %w", row[0], row[1], err)
		}
		i := slices.IndexFunc(bars, func(b *bar) bool { return b.label == row[1] })
		if i < 0 {
			bars = append(bars, &bar{label: row[1]})
			i = len(bars) - 1
		}
		bars[i].figures = append(bars[i].figures, v)
	}
	for _, b := range bars {
		b.value = median(b.figures)
	}
	var sb strings.Builder
	writeChart(&sb, "Allowed requests' median latency, Redis 20 ms away (ms)", "ms", bars)
	sb.WriteString("\n| mode | median of each run (ms) | bar (ms) |\n| --- | --- | ---: |\n")
	for _, b := range bars {
		fmt.Fprintf(&sb, "| %s | %s | %s |\n", b.label, joinFigures(b.figures, 3), format(b.value))
	}
	return sb.String(), nil
}

// throughputChart draws one bar per setup that has a baseline: the median
// over rounds of its req/s divided by the baseline's in the same round.
// Rows are: run, setup, baseline, label, req/s in each round.
func throughputChart(rows [][]string) (string, error) {
	type setup struct {
		label  string
		rounds []float64
	}
	setups := map[string]setup{}
	for _, row := range rows {
		var rounds []float64
		for _, f := range strings.Fields(row[4]) {
			v, err := strconv.ParseFloat(f, 64)
			if err != nil || v <= 0 {
				return "", fmt.Errorf("%s (%s): round %q is not a positive number", row[1], row[0], f)
			}
			rounds = append(rounds, v)
		}
		setups[row[0]+"/"+row[1]] = setup{row[3], rounds}
	}
	var bars []*bar
	var sb strings.Builder
	table := "\n| bar | against | run in bench/README.md | each round's ratio | bar |\n| --- | --- | --- | --- | ---: |\n"
	for _, row := range rows {
		if row[2] == "-" {
			continue
		}
		s, base := setups[row[0]+"/"+row[1]], setups[row[0]+"/"+row[2]]
		if base.rounds == nil {
			return "", fmt.Errorf("%s (%s): no baseline %s in the same run", row[1], row[0], row[2])
		}
		if len(base.rounds) != len(s.rounds) {
			return "", fmt.Errorf("%s (%s): %d rounds, its baseline %d", row[1], row[0], len(s.rounds), len(base.rounds))
		}
		b := &bar{label: s.label}
		for i := range s.rounds {
			b.figures = append(b.figures, s.rounds[i]/base.rounds[i])
		}
		b.value = median(b.figures)
		bars = append(bars, b)
		table += fmt.Sprintf("| %s (%s) | %s (%s) | %s | %s | %s |\n",
			b.label, row[1], base.label, row[2], row[0], joinFigures(b.figures, 2), strconv.FormatFloat(b.value, 'f', 2, 64))
	}
	if len(bars) == 0 {
		return "", errors.New("no row has a baseline")
	}
	writeChart(&sb, "Throughput against plain Caddy (paired ratio)", "ratio", bars)
	sb.WriteString(table)
	return sb.String(), nil
}

// writeChart writes a Mermaid xychart-beta bar chart of bars.
func writeChart(sb *strings.Builder, title, unit string, bars []*bar) {
	labels := make([]string, len(bars))
	values := make([]string, len(bars))
	top := 0.0
	for i, b := range bars {
		labels[i] = strconv.Quote(b.label)
		values[i] = format(b.value)
		top = max(top, b.value)
	}
	fmt.Fprintf(sb, "```mermaid\nxychart-beta\n    title %q\n    x-axis [%s]\n    y-axis %q 0 --> %s\n    bar [%s]\n```\n",
		title, strings.Join(labels, ", "), unit, strconv.FormatFloat(axisTop(top), 'f', -1, 64), strings.Join(values, ", "))
}

// axisTop is a round figure above v by a tenth at least, so that the
// tallest bar does not touch the frame.
func axisTop(v float64) float64 {
	v *= 1.1
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8} {
		if m*p >= v {
			return m * p
		}
	}
	return 10 * p
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// format writes a figure with two significant decimals at most, so that
// 47.61 and 0.49 both read well.
func format(v float64) string {
	if v >= 10 {
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return strconv.FormatFloat(v, 'f', 2, 64)
}

func joinFigures(xs []float64, decimals int) string {
	s := make([]string, len(xs))
	for i, x := range xs {
		s[i] = strconv.FormatFloat(x, 'f', decimals, 64)
	}
	return strings.Join(s, ", ")
}
