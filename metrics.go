package ratelimit

import (
	"errors"
	"strings"
	"sync/atomic"

	"github.com/bramsley/caddy-ratelimit/internal/localbucket"
	"github.com/bramsley/caddy-ratelimit/internal/redisbucket"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// The collectors live for the whole process and are registered into each
// config's registry as it loads, so that counts go on across reloads. No
// label ever carries a client's key: only policy, tier, decision and store.
var (
	requestsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "requests_total",
		Help: "Requests the rate limiter decided, by policy, tier and decision (allowed, denied, dry_run, unlimited, error).",
	}, []string{"policy", "tier", "decision"})

	storeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "store_duration_seconds",
		Help:    "Time one decision took in the Redis store (the local store is not timed).",
		Buckets: []float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25},
	}, []string{"store"})

	bansTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "bans_total",
		Help: "Bans started (ban): denials that emptied a bucket for the ban's length, by policy and tier.",
	}, []string{"policy", "tier"})

	waitSeconds = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "wait_seconds",
		Help:    "How long requests waited for their tokens (max_wait), by policy and tier; requests that did not wait are not counted.",
		Buckets: []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
	}, []string{"policy", "tier"})

	inFlightGauge = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "in_flight",
		Help: "Requests this node passed on that hold an in-flight slot (concurrency) now, by policy and tier.",
	}, []string{"policy", "tier"})

	storeErrorsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "store_errors_total",
		Help: "Decisions the store failed to make, so that on_store_error decided.",
	}, []string{"store"})

	// evictionsTotal is added to by the local stores.
	evictionsTotal atomic.Uint64

	evictionsCounter = prometheus.NewCounterFunc(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "evictions_total",
		Help: "Live buckets the local store dropped to stay within max_keys. Full buckets dropped are not counted: dropping them changes nothing.",
	}, func() float64 { return float64(evictionsTotal.Load()) })

	keysGauge = keysCollector{desc: prometheus.NewDesc("caddy_http_rate_limit_keys",
		"Buckets the local store holds, by policy.", []string{"policy"}, nil)}

	storeRTTGauge = storeRTTCollector{desc: prometheus.NewDesc("caddy_http_rate_limit_store_rtt_seconds",
		"The round trip to the shared store this node measured, by policy: a moving average of its calls the store answered.", []string{"policy", "store"}, nil)}
)

// keysCollector reports the size of every local bucket table when scraped,
// so the hot path keeps no gauge up to date.
type keysCollector struct{ desc *prometheus.Desc }

func (c keysCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

// An on_store_error local fallback's table is shown as the policy
// "<policy>/on_store_error"; a policy of that very name adds its own.
func (c keysCollector) Collect(ch chan<- prometheus.Metric) {
	keys := map[string]int{}
	localPool.Range(func(key, value any) bool {
		lb, isTable := value.(*localbucket.Store)
		if !isTable {
			return true
		}
		if policy, ok := strings.CutPrefix(key.(string), "local/"); ok {
			keys[policy] += lb.Len()
		} else if policy, ok := strings.CutPrefix(key.(string), fallbackPoolPrefix); ok {
			keys[policy+"/on_store_error"] += lb.Len()
		}
		return true
	})
	for policy, n := range keys {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), policy)
	}
}

// storeRTTCollector reports, when scraped, the round trip each running
// policy's store measured (roundTripWatcher), so that a reload's new
// store is the one shown; a policy with none measured yet is left out.
type storeRTTCollector struct{ desc *prometheus.Desc }

func (c storeRTTCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c storeRTTCollector) Collect(ch chan<- prometheus.Metric) {
	for policy, hs := range runningHandlers() {
		h := hs[len(hs)-1]
		w, ok := h.store.(roundTripWatcher)
		if !ok {
			continue
		}
		if rtt := w.roundTrip(); rtt > 0 {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, rtt.Seconds(), policy, caddy.GetModuleName(h.store))
		}
	}
}

// registerMetrics adds the collectors to a config's registry. A second
// handler in the same config finds them there already.
func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	for _, c := range append([]prometheus.Collector{requestsTotal, storeDuration, storeErrorsTotal, evictionsCounter, keysGauge, storeRTTGauge, bansTotal, waitSeconds, inFlightGauge}, redisbucket.Collectors()...) {
		if err := reg.Register(c); err != nil {
			var already prometheus.AlreadyRegisteredError
			if !errors.As(err, &already) {
				return err
			}
		}
	}
	return nil
}

// outcomeCounters are one tier's request counters, one per outcome, looked
// up once at provision rather than on every request.
type outcomeCounters [outcomeCount]prometheus.Counter

func newOutcomeCounters(policy, tier string) *outcomeCounters {
	var c outcomeCounters
	for o := range outcomeCount {
		c[o] = requestsTotal.WithLabelValues(policy, tier, o.String())
	}
	return &c
}
