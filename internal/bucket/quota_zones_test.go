package bucket_test

import (
	"archive/zip"
	"hash/crc32"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/bramsley/caddy-ratelimit/internal/bucket"
)

// Every zone of the tz database, 2005 to 2030: around each of its
// transitions (a second and an hour either side, and the midnights of
// the days around it), the period of each kind that Bounds gives holds
// the instant, names itself, and meets its neighbours: Bounds(t) = [s, e)
// with s <= t < e, Bounds(s) = [s, e), Bounds(e) starts at e and
// Bounds(s-1) ends at s. A period starts at a midnight of its first day,
// or where the zone's clock jumped past one.
// Regression test for issue 30 item 3.
func TestQuotaPeriodsHoldEveryInstantInEveryZone(t *testing.T) {
	t.Parallel()
	zones := tzdataZones(t)
	from, to := time.Date(2005, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(2031, 1, 1, 0, 0, 0, 0, time.UTC)
	failures := 0
	report := func(format string, args ...any) {
		if failures++; failures <= 30 {
			t.Errorf(format, args...)
		}
	}
	checked := 0
	for i, name := range zones {
		if testing.Short() && i%6 != 0 {
			continue // a sixth of the zones, in the inner loop
		}
		loc, err := time.LoadLocation(name)
		if err != nil {
			t.Fatalf("zone %s: %v", name, err)
		}
		for tr := range zoneTransitions(loc, from, to) {
			for _, at := range aroundTransition(tr, loc) {
				for p := bucket.Day; p <= bucket.Year; p++ {
					q := bucket.Quota{N: 1, Period: p, Loc: loc}
					if bad := periodFault(q, q.Bounds, at.UnixMicro()); bad != "" {
						report("%s, %s, at %s (%d µs): %s", name, p, at.In(loc).Format("2006-01-02 15:04:05 MST"), at.UnixMicro(), bad)
					}
					checked++
				}
			}
		}
	}
	if failures > 30 {
		t.Errorf("and %d more", failures-30)
	}
	t.Logf("%d zones, %d instants and periods checked", len(zones), checked)
	// The mutation the check must catch: a day from the midnight of the
	// date the clock shows, as time.Date resolves it.
	byDate := func(q bucket.Quota) func(int64) (int64, int64) {
		return func(t int64) (int64, int64) {
			y, m, d := time.UnixMicro(t).In(q.Loc).Date()
			return time.Date(y, m, d, 0, 0, 0, 0, q.Loc).UnixMicro(), time.Date(y, m, d+1, 0, 0, 0, 0, q.Loc).UnixMicro()
		}
	}
	for _, tt := range []struct {
		zone string
		at   time.Time // UTC
	}{
		{"America/St_Johns", time.Date(2006, 10, 29, 2, 45, 0, 0, time.UTC)}, // 23:15 NST, after the 29th began
		{"Asia/Amman", time.Date(2015, 10, 29, 21, 30, 0, 0, time.UTC)},      // 00:30 EEST, the first of two
		{"Antarctica/Casey", time.Date(2019, 3, 16, 13, 30, 0, 0, time.UTC)}, // 00:30 +11, the first of two
	} {
		q := bucket.Quota{N: 1, Period: bucket.Day, Loc: mustZone(t, tt.zone)}
		if periodFault(q, q.Bounds, tt.at.UnixMicro()) != "" || periodFault(q, byDate(q), tt.at.UnixMicro()) == "" {
			t.Errorf("%s at %s: the check passes a day from the midnight of the date shown, or fails Bounds", tt.zone, tt.at)
		}
	}
}

// periodFault describes how the period of q around t, by bounds, fails
// to be one of a partition of time into periods ("" when it does not).
func periodFault(q bucket.Quota, bounds func(int64) (int64, int64), t int64) string {
	s, e := bounds(t)
	switch s2, e2 := bounds(s); {
	case !(s <= t && t < e):
		return "the period " + span(q, s, e) + " does not hold it"
	case s2 != s || e2 != e:
		return "the period " + span(q, s, e) + ", from its start, is " + span(q, s2, e2)
	}
	if s3, _ := bounds(e); s3 != e {
		return "the period " + span(q, s, e) + " is followed by one starting at " + stamp(q, s3)
	}
	if _, e4 := bounds(s - 1); e4 != s {
		return "the period " + span(q, s, e) + " follows one ending at " + stamp(q, e4)
	}
	at := time.UnixMicro(s).In(q.Loc)
	if at.Hour()+at.Minute()+at.Second() != 0 {
		if zs, _ := at.ZoneBounds(); !zs.Equal(at) {
			return "the period " + span(q, s, e) + " starts neither at a midnight nor where the clock jumped"
		}
		return ""
	}
	_, m, d := at.Date()
	if q.Period == bucket.Week && at.Weekday() != time.Monday || q.Period == bucket.Month && d != 1 || q.Period == bucket.Year && (m != 1 || d != 1) {
		return "the period " + span(q, s, e) + " starts on another day than its first"
	}
	return ""
}

func span(q bucket.Quota, s, e int64) string { return "[" + stamp(q, s) + ", " + stamp(q, e) + ")" }

func stamp(q bucket.Quota, t int64) string {
	return time.UnixMicro(t).In(q.Loc).Format("2006-01-02 15:04:05 MST")
}

// zoneTransitions yields the moments loc changes its offset or name
// between from and to.
func zoneTransitions(loc *time.Location, from, to time.Time) func(func(time.Time) bool) {
	return func(yield func(time.Time) bool) {
		for t := from; t.Before(to); {
			_, end := t.In(loc).ZoneBounds()
			if end.IsZero() || !end.Before(to) || !yield(end) {
				return
			}
			t = end
		}
	}
}

// aroundTransition is the instants a test of periods looks at around a
// zone's transition tr: a second and an hour either side, and the
// midnights (as time.Date resolves them) of the days around it, with a
// second either side of each.
func aroundTransition(tr time.Time, loc *time.Location) []time.Time {
	ts := []time.Time{tr.Add(-time.Hour), tr.Add(-time.Second), tr, tr.Add(time.Second), tr.Add(time.Hour)}
	y, m, d := tr.Add(-time.Hour).In(loc).Date()
	for i := -1; i <= 2; i++ {
		mid := time.Date(y, m, d+i, 0, 0, 0, 0, loc)
		ts = append(ts, mid.Add(-time.Second), mid, mid.Add(time.Second))
	}
	return ts
}

// tzdataZones lists the zones of the tz database: the names in Go's
// zoneinfo.zip (in `go env GOROOT`), else those under /usr/share/zoneinfo;
// a zone that is a copy of one listed already (a link) is left out.
func tzdataZones(t *testing.T) []string {
	t.Helper()
	var zones []string
	seen := map[[2]uint32]bool{}
	add := func(name string, sum, size uint32) {
		if !seen[[2]uint32{sum, size}] {
			seen[[2]uint32{sum, size}] = true
			zones = append(zones, name)
		}
	}
	if goroot, err := exec.Command("go", "env", "GOROOT").Output(); err == nil {
		if zr, err := zip.OpenReader(filepath.Join(strings.TrimSpace(string(goroot)), "lib", "time", "zoneinfo.zip")); err == nil {
			defer zr.Close()
			for _, f := range zr.File {
				add(f.Name, f.CRC32, uint32(f.UncompressedSize64))
			}
			return zones
		}
	}
	const dir = "/usr/share/zoneinfo"
	_ = filepath.WalkDir(dir, func(path string, e fs.DirEntry, err error) error {
		if err != nil || e.IsDir() {
			if e != nil && e.IsDir() && (e.Name() == "posix" || e.Name() == "right") {
				return filepath.SkipDir
			}
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil || !strings.HasPrefix(string(b), "TZif") {
			return nil
		}
		name, _ := filepath.Rel(dir, path)
		add(name, crc32.ChecksumIEEE(b), uint32(len(b)))
		return nil
	})
	if len(zones) < 300 {
		t.Fatalf("found %d zones: neither Go's zoneinfo.zip nor %s lists the tz database", len(zones), dir)
	}
	return zones
}
