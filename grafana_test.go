package ratelimit

import (
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
)

// The Grafana dashboard in contrib/grafana may query only metrics that a
// running Caddy exports, and must show every one it exports.

const dashboardFile = "contrib/grafana/caddy-ratelimit.json"

// grafanaDashboard is the part of Grafana's dashboard JSON the tests read.
type grafanaDashboard struct {
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []grafanaVariable `json:"list"`
	} `json:"templating"`
}

type grafanaPanel struct {
	ID         int                `json:"id"`
	Title      string             `json:"title"`
	Type       string             `json:"type"`
	Datasource *grafanaDatasource `json:"datasource"`
	Targets    []struct {
		Expr       string             `json:"expr"`
		Datasource *grafanaDatasource `json:"datasource"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row holds its panels
}

type grafanaDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaVariable struct {
	Name       string             `json:"name"`
	Type       string             `json:"type"`
	Query      json.RawMessage    `json:"query"` // a string, or {"query": ...}
	Datasource *grafanaDatasource `json:"datasource"`
}

// query is the variable's query, in either of Grafana's two forms.
func (v grafanaVariable) query() string {
	var s string
	if json.Unmarshal(v.Query, &s) == nil {
		return s
	}
	var q struct {
		Query string `json:"query"`
	}
	_ = json.Unmarshal(v.Query, &q)
	return q.Query
}

func loadDashboard(t *testing.T) grafanaDashboard {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// allPanels lists every panel, rows and the panels inside collapsed rows too.
func allPanels(panels []grafanaPanel) []grafanaPanel {
	var all []grafanaPanel
	for _, p := range panels {
		all = append(all, p)
		all = append(all, allPanels(p.Panels)...)
	}
	return all
}

// dashboardQuery is one PromQL expression and where the dashboard has it.
type dashboardQuery struct{ where, expr string }

func dashboardQueries(d grafanaDashboard) []dashboardQuery {
	var qs []dashboardQuery
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			qs = append(qs, dashboardQuery{"panel " + p.Title, tg.Expr})
		}
	}
	for _, v := range d.Templating.List {
		if v.Type == "query" {
			qs = append(qs, dashboardQuery{"variable " + v.Name, v.query()})
		}
	}
	return qs
}

var metricNameRE = regexp.MustCompile(`\bcaddy_http_rate_limit_[a-zA-Z0-9_]+`)

// exportedFamilies reads Prometheus' text format: the type of each family,
// and how many samples each has.
func exportedFamilies(metrics string) (types map[string]string, samples map[string]int) {
	types, samples = make(map[string]string), make(map[string]int)
	var names []string
	for _, line := range strings.Split(metrics, "\n") {
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			if name, typ, ok := strings.Cut(rest, " "); ok {
				types[name] = typ
			}
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			names = append(names, line[:i])
		}
	}
	for _, n := range names {
		samples[familyOf(n, types)]++
	}
	return types, samples
}

// familyOf maps a series name to its family: a histogram's _bucket, _sum
// and _count series belong to the histogram.
func familyOf(name string, types map[string]string) string {
	if _, ok := types[name]; ok {
		return name
	}
	for _, suffix := range []string{"_bucket", "_sum", "_count"} {
		if stem, ok := strings.CutSuffix(name, suffix); ok && types[stem] == "histogram" {
			return stem
		}
	}
	return name
}

func TestGrafanaDashboardUsesItsDatasourceVariable(t *testing.T) {
	t.Parallel()
	d := loadDashboard(t)
	const uid = "${datasource}"

	vars := make(map[string]grafanaVariable)
	for _, v := range d.Templating.List {
		vars[v.Name] = v
	}
	if ds, ok := vars["datasource"]; !ok || ds.Type != "datasource" || ds.query() != "prometheus" {
		t.Errorf("want a variable datasource of type datasource, query prometheus; got %+v (query %q)", ds, ds.query())
	}
	policy, ok := vars["policy"]
	if !ok || policy.Type != "query" || policy.query() != "label_values(caddy_http_rate_limit_requests_total, policy)" {
		t.Errorf("want a variable policy: label_values(caddy_http_rate_limit_requests_total, policy); got %+v (query %q)", policy, policy.query())
	}
	if policy.Datasource == nil || policy.Datasource.UID != uid {
		t.Errorf("variable policy: datasource %+v, want uid %s", policy.Datasource, uid)
	}

	ids := make(map[int]string)
	for _, p := range allPanels(d.Panels) {
		if other, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", other, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.Type != "prometheus" || p.Datasource.UID != uid {
			t.Errorf("panel %q: datasource %+v, want prometheus %s", p.Title, p.Datasource, uid)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q queries nothing", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource == nil || tg.Datasource.UID != uid {
				t.Errorf("panel %q: a target's datasource is %+v, want uid %s", p.Title, tg.Datasource, uid)
			}
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q: a target has no expr", p.Title)
			}
		}
	}
}

var grafanaRuns atomic.Int64

func TestGrafanaDashboardQueriesOnlyMetricsCaddyExports(t *testing.T) {
	redis := startRedis(t)
	// Every family needs a sample: a local policy that denies and bans, a
	// Redis policy that leases (10% of 100: leases of one token would be
	// strict mode, with no lease calls) and measures its round trip, and a
	// Redis nobody listens on.
	// The counters outlive configs, so each run has policies of its own.
	run := grafanaRuns.Add(1)
	s, admin := serveWithAdmin(t, fmt.Sprintf(`
	rate_limit /local 2 1/h {
		name grafana_local%[1]d
		ban 1h
	}
	rate_limit /shared 100 1/h {
		name grafana_shared%[1]d
		store redis {
			address %[2]s
			lease 10%%
		}
	}
	rate_limit /unreachable 10 1/h {
		name grafana_unreachable%[1]d
		store redis {
			address redis://127.0.0.1:%[3]d
			timeout 100ms
		}
		on_store_error allow
	}
	respond "ok"`, run, redis.url(), freePort(t)))
	s.expectSteps([]step{
		{from: "127.0.0.2", path: "/local", want: 200},
		{from: "127.0.0.2", path: "/local", want: 200},
		{from: "127.0.0.2", path: "/local", want: 429},
		{from: "127.0.0.2", path: "/shared", want: 200},
		// Lease calls of two more clients: a call during another
		// connection's handshake measures no round trip.
		{from: "127.0.0.3", path: "/shared", want: 200},
		{from: "127.0.0.4", path: "/shared", want: 200},
		{from: "127.0.0.2", path: "/unreachable", want: 200},
	})

	types, samples := exportedFamilies(scrape(t, admin))
	shown := make(map[string]bool)
	for _, q := range dashboardQueries(loadDashboard(t)) {
		names := metricNameRE.FindAllString(q.expr, -1)
		if len(names) == 0 {
			t.Errorf("%s: %q queries no caddy_http_rate_limit_ metric", q.where, q.expr)
		}
		for _, n := range names {
			family := familyOf(n, types)
			shown[family] = true
			if samples[family] == 0 {
				t.Errorf("%s queries %s, which Caddy does not export", q.where, n)
			}
		}
	}
	var exported []string
	for family := range samples {
		if strings.HasPrefix(family, "caddy_http_rate_limit_") {
			exported = append(exported, family)
		}
	}
	slices.Sort(exported)
	for _, family := range exported {
		if !shown[family] {
			t.Errorf("Caddy exports %s, which no panel shows", family)
		}
	}
	if len(exported) < 11 {
		t.Errorf("Caddy exported only %d rate limit families, want all 11: %v", len(exported), exported)
	}
}
