package redisbucket

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Collectors are the engine's metrics, for the caller to register: lease
// calls by result, leased tokens given back, lease entries evicted, and
// denials the deny cache answered. They count across every connection.
func Collectors() []prometheus.Collector {
	return []prometheus.Collector{leasesTotal, leaseTokensReturned, leaseEvictions, denyCacheHitsCounter}
}

var (
	leasesTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "leases_total",
		Help: "Lease calls to the shared store, by result: granted, partial or refused.",
	}, []string{"result"})
	leaseTokensReturned = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "lease_tokens_returned_total",
		Help: "Leased tokens given back unused to the shared store.",
	})
	leaseEvictions = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "http_rate_limit", Name: "lease_evictions_total",
		Help: "Lease entries dropped to keep this node's lease table within its bound.",
	})
)

// denyCacheHitsTotal counts, over every connection, the denials the deny
// caches answered without Redis.
var denyCacheHitsTotal atomic.Uint64

var denyCacheHitsCounter = prometheus.NewCounterFunc(prometheus.CounterOpts{
	Namespace: "caddy", Subsystem: "http_rate_limit", Name: "deny_cache_hits_total",
	Help: "Denials answered from the local deny cache without asking the shared store.",
}, func() float64 { return float64(denyCacheHitsTotal.Load()) })
