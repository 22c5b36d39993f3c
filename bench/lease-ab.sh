#!/usr/bin/env bash
# Setup (i) of bench/run.sh (lease 10%, 1,000 returning X-Key clients) on
# two or more Caddy builds, round after round on one redis-server, each
# build's wrk run in turn: req/s, the Redis script calls a request, Redis's
# time a call by INFO commandstats (usec) and by INFO cpu (user + system,
# network included), and the share of requests whose store call failed
# (a timeout, or the breaker open after five), which on_store_error
# decided (bench/README.md, "Issue 34: leases with many keys").
#
# Usage: bench/lease-ab.sh <rounds> <seconds> <name>=<caddy binary>...
# e.g.   bench/lease-ab.sh 4 10 old=/tmp/caddy-old new=/tmp/caddy-new
# (go build -trimpath -o /tmp/caddy-new ./cmd/caddy, in each checkout).
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
rounds=$1 secs=$2
shift 2
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"' EXIT
fp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
rp=$(fp)
redis-server --bind 127.0.0.1 --port "$rp" --save "" --appendonly no --dir "$work" --logfile "$work/redis.log" >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
declare -A port admin
names=()
for nb in "$@"; do
	n=${nb%%=*} b=${nb#*=}
	names+=("$n")
	port[$n]=$(fp) admin[$n]=$(fp)
	mkdir -p "$work/home-$n"
	BENCH_PORT=${port[$n]} BENCH_ADMIN_PORT=${admin[$n]} BENCH_REDIS_PORT=$rp \
		HOME=$work/home-$n XDG_DATA_HOME=$work/home-$n XDG_CONFIG_HOME=$work/home-$n \
		"$b" run --adapter caddyfile --config "$repo/bench/caddy/i.Caddyfile" >"$work/caddy-$n.log" 2>&1 &
	pids+=($!)
done
for n in "${names[@]}"; do
	for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:${port[$n]}/" && break; sleep 0.1; done
done
cpu() { redis-cli -p "$rp" INFO cpu | awk -F: '/^used_cpu_(sys|user):/ { s += $2 } END { printf "%.6f", s }'; }
errors() { curl -s "http://127.0.0.1:${admin[$1]}/metrics" | awk '/^caddy_http_rate_limit_store_errors_total/ { n += $2 } END { printf "%d", n }'; }
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq "$rounds"); do
	for n in "${names[@]}"; do
		redis-cli -p "$rp" CONFIG RESETSTAT >/dev/null
		e0=$(errors "$n") c0=$(cpu)
		BENCH_KEYS=1000 wrk -t1 -c32 -d"${secs}s" -s "$repo/bench/keys.lua" "http://127.0.0.1:${port[$n]}/" >"$work/wrk.txt"
		c1=$(cpu) e1=$(errors "$n")
		reqs=$(awk '/requests in/ { print $1 }' "$work/wrk.txt")
		rps=$(awk '/Requests\/sec/ { print $2 }' "$work/wrk.txt")
		redis-cli -p "$rp" INFO commandstats | awk -F'[:=,]' -v n="$n" -v r="$r" -v reqs="$reqs" -v rps="$rps" \
			-v errs=$((e1 - e0)) -v cpu="$(awk -v a="$c0" -v b="$c1" 'BEGIN { print (b - a) * 1e6 }')" '
			/^cmdstat_(eval|evalsha|fcall)/ { calls += $3; usec += $5 }
			END { printf "round %d %-6s req/s %6.0f  script calls %6d (%.4f a request)  µs a call: commandstats %6.2f, cpu %6.2f  store errors %.4f a request\n",
				r, n, rps, calls, calls / reqs, usec / calls, cpu / calls, errs / reqs }'
	done
done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
