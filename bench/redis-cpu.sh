#!/usr/bin/env bash
# Redis CPU per decision through Caddy, beside go-redis/redis_rate's GCRA
# on the same redis-server, in one run (bench/README.md, "Redis CPU per
# decision").
#
# It starts one redis-server and, on free 127.0.0.1 ports, plain Caddy (a)
# and Caddy with this plugin in strict mode, 100,000 X-Key clients
# (bench/keys.lua), never denied: (k) one limit, (l) a tier of two limits
# and a daily quota. With BEFORE set to another checkout of the repository
# (git worktree add /tmp/before <commit>), its build runs (k) and (l) too,
# as (K) and (L). Round after round, each setup gets a wrk run; Redis's
# INFO commandstats, reset before each, gives the microseconds of every
# command the decisions sent (EVALSHA, EVAL, FCALL and any other; the GET,
# SET, DEL, TIME and PTTL the scripts call are inside their script's
# figure, so they are not added again), divided by the script calls (a
# decision the store timed out is decided by on_store_error, and the
# share of decisions that reached Redis is given).
# Setup (r) is redis_rate's GCRA under the same load: bench/redisrate
# calls it with (k)'s limit and clients for the length of a wrk run
# against plain Caddy, so that Redis shares the CPUs as it does under (k);
# its figure is per call. Redis's own CPU time (INFO cpu, user and system,
# network included) per decision is given beside. Then bench/redisrate
# runs redis_rate's script and ours alone on the same server.
#
# Commandstats' usec is wall time inside a command: when the CPUs are
# shared, a command the scheduler preempts counts the time it lost. Pin
# redis-server to a CPU of its own (REDIS_CPUS=1 CADDY_CPUS=0 WRK_CPUS=0)
# for figures of the commands' own work; every setup is pinned alike.
#
# Usage: bench/redis-cpu.sh
# Environment (defaults in brackets): ROUNDS [3], DURATION [10s],
# THREADS [1], CONNECTIONS [32], KEYS [100000], BEFORE [], SETUPS [a r k l,
# with K L when BEFORE is set; r needs a]; REDIS_CPUS, CADDY_CPUS (Caddy
# and bench/redisrate), WRK_CPUS: taskset CPU lists [none: no pinning]
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
THREADS=${THREADS:-1}
CONNECTIONS=${CONNECTIONS:-32}
KEYS=${KEYS:-100000}
BEFORE=${BEFORE:-}
default_setups="a r k l"
[[ -n $BEFORE ]] && default_setups="a r k K l L"
SETUPS=${SETUPS:-$default_setups}
BUILD_DIR=${BUILD_DIR:-${TMPDIR:-/tmp}/caddy-ratelimit-bench}
pin_redis=() pin_caddy=() pin_wrk=()
[[ -n ${REDIS_CPUS:-} ]] && pin_redis=(taskset -c "$REDIS_CPUS")
[[ -n ${CADDY_CPUS:-} ]] && pin_caddy=(taskset -c "$CADDY_CPUS")
[[ -n ${WRK_CPUS:-} ]] && pin_wrk=(taskset -c "$WRK_CPUS")

work=$(mktemp -d)
mkdir -p "$BUILD_DIR"
pids=()
cleanup() {
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
log() { echo "redis-cpu.sh: $*" >&2; }
free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ---- build -----------------------------------------------------------------

caddy_version=$(awk '$1 == "github.com/caddyserver/caddy/v2" { print $2 }' "$repo/go.mod")
plain=$BUILD_DIR/caddy-plain-$caddy_version
if [[ ! -x $plain ]]; then
	log "building plain Caddy $caddy_version into $plain"
	mod=$work/plain
	mkdir -p "$mod"
	sed 's#^module .*#module caddy-plain#' "$repo/go.mod" >"$mod/go.mod"
	cp "$repo/go.sum" "$mod/go.sum"
	printf '%s\n' 'package main' 'import (' 'caddycmd "github.com/caddyserver/caddy/v2/cmd"' \
		'_ "github.com/caddyserver/caddy/v2/modules/standard"' ')' 'func main() { caddycmd.Main() }' >"$mod/main.go"
	(cd "$mod" && GOFLAGS=-mod=mod go build -trimpath -o "$plain.tmp" .)
	mv "$plain.tmp" "$plain"
fi
log "building Caddy with the plugin"
(cd "$repo" && go build -trimpath -o "$work/caddy-after" ./cmd/caddy)
(cd "$repo/bench/redisrate" && go build -o "$work/redisrate" .)
if [[ -n $BEFORE ]]; then
	log "building Caddy with the plugin at $BEFORE ($(git -C "$BEFORE" log --oneline -1))"
	(cd "$BEFORE" && go build -trimpath -o "$work/caddy-before" ./cmd/caddy)
fi

# ---- servers ---------------------------------------------------------------

redis_port=$(free_port)
"${pin_redis[@]}" redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
	--dir "$work" --logfile "$work/redis.log" >/dev/null 2>&1 &
pids+=($!)
until redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null 2>&1; do sleep 0.1; done
rcli() { redis-cli -h 127.0.0.1 -p "$redis_port" "$@"; }

binary() {
	case $1 in a) echo "$plain" ;; [KL]) echo "$work/caddy-before" ;; *) echo "$work/caddy-after" ;; esac
}
caddyfile() { echo "$repo/bench/caddy/$(echo "$1" | tr KL kl).Caddyfile"; }
declare -A port
for s in $SETUPS; do
	[[ $s == r ]] && continue
	port[$s]=$(free_port)
	mkdir -p "$work/home-$s"
	BENCH_PORT=${port[$s]} BENCH_ADMIN_PORT=$(free_port) BENCH_REDIS_PORT=$redis_port \
		HOME=$work/home-$s XDG_DATA_HOME=$work/home-$s XDG_CONFIG_HOME=$work/home-$s \
		"${pin_caddy[@]}" "$(binary "$s")" run --adapter caddyfile --config "$(caddyfile "$s")" >"$work/caddy-$s.log" 2>&1 &
	pids+=($!)
done
port[r]=${port[a]:-}
for s in $SETUPS; do
	[[ $s == r ]] && continue
	for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:${port[$s]}/" && break; sleep 0.1; done
	curl -s -o /dev/null "http://127.0.0.1:${port[$s]}/" || { log "caddy ($s) did not start"; cat "$work/caddy-$s.log" >&2; exit 1; }
done

# usec: the microseconds of the commands sent since the last reset, and
# how many script calls (EVALSHA, EVAL, FCALL) there were.
usec() {
	rcli INFO commandstats | tr -d '\r' | awk -F'[:=,]' '
		/^cmdstat_/ { name = substr($1, 9)
			if (name ~ /^(get|set|del|time|pttl|info|config.*)$/) next
			u += $5
			if (name ~ /^(eval|evalsha|eval_ro|evalsha_ro|fcall|fcall_ro)$/) c += $3 }
		END { print u + 0, c + 0 }'
}
# cpu: Redis's CPU time so far (user and system), in µs.
cpu() { rcli INFO cpu | tr -d '\r' | awk -F: '$1 == "used_cpu_user" || $1 == "used_cpu_sys" { t += $2 } END { printf "%.0f", t * 1e6 }'; }
breakdown() { rcli INFO commandstats | tr -d '\r' | awk -F'[:=,]' '/^cmdstat_/ && $1 !~ /info|config/ { printf "%s %d calls %.2f us/call; ", substr($1, 9), $3, $7 }'; }

median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A rps per cpus shares
for r in $(seq "$ROUNDS"); do
	for s in $SETUPS; do
		rcli CONFIG RESETSTAT >/dev/null
		c0=$(cpu)
		script=(-s "$repo/bench/keys.lua")
		if [[ $s == r ]]; then
			"${pin_caddy[@]}" "$work/redisrate" -addr "127.0.0.1:$redis_port" -setups redis_rate -alongside "$DURATION" -keys "$KEYS" \
				-limit "10000 1000/s" >"$work/rr-$r.txt" &
			rr_pid=$!
			pids+=("$rr_pid")
		fi
		BENCH_KEYS=$KEYS "${pin_wrk[@]}" wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" "${script[@]}" "http://127.0.0.1:${port[$s]}/" >"$work/wrk-$s-$r.txt"
		n=$(awk '/requests in/ { print $1 }' "$work/wrk-$s-$r.txt")
		if [[ $s == r ]]; then
			wait "$rr_pid"
			n=$(awk '/decisions in/ { print $2 }' "$work/rr-$r.txt")
		fi
		read -r u calls < <(usec)
		c=$(awk -v a="$c0" -v b="$(cpu)" -v n="$n" 'BEGIN { printf "%.2f", (b - a) / n }')
		cpus[$s]="${cpus[$s]:-} $c"
		non2xx=$(awk '/Non-2xx/ { print $NF }' "$work/wrk-$s-$r.txt")
		x=$(awk '/Requests\/sec/ { print $2 }' "$work/wrk-$s-$r.txt")
		rps[$s]="${rps[$s]:-} $x"
		# Per script call: a decision the store's timeout cut short
		# (on_store_error decides it) still cost Redis its call.
		p=$(awk -v u="$u" -v n="$calls" 'BEGIN { if (n > 0) printf "%.2f", u / n; else print 0 }')
		per[$s]="${per[$s]:-} $p"
		share=$(awk -v c="$calls" -v n="$n" 'BEGIN { printf "%.3f", c / n }')
		shares[$s]="${shares[$s]:-} $share"
		log "round $r ($s): $x req/s, ${non2xx:-0} non-2xx, $n decisions, $calls script calls, Redis $p µs/call, CPU $c µs/decision ($(breakdown))"
	done
done
log "redis_rate on the same redis-server"
rr=$("${pin_caddy[@]}" "$work/redisrate" -addr "127.0.0.1:$redis_port" -setups redis_rate,ours,tier -n 100000 -rounds "$ROUNDS" -keys "$KEYS" -limit "10000 1000/s")
echo "$rr" >&2
g=$(echo "${per[r]:-}" | median)
[[ -n $g ]] || g=$(echo "$rr" | awk '$1 == "redis_rate" && NF >= 3 && $2 ~ /^[0-9.]+$/ { print $2 }')
load_after=$(cut -d' ' -f1-3 /proc/loadavg)

declare -A what=(
	[a]="plain Caddy"
	[r]="redis_rate's GCRA beside plain Caddy under wrk (bench/redisrate), (k)'s limit and clients"
	[k]="strict, one limit"
	[l]="strict, two limits and a daily quota"
	[K]="strict, one limit (BEFORE)"
	[L]="strict, two limits and a daily quota (BEFORE)"
)
echo
echo "Caddy $caddy_version, redis-server $(rcli INFO server | tr -d '\r' | awk -F: '$1 == "redis_version" { print $2 }'), $(nproc) CPUs;" \
	"load average $load_before before, $load_after after"
echo "wrk -t$THREADS -c$CONNECTIONS -d$DURATION, bench/keys.lua with $KEYS X-Key clients, $ROUNDS alternating rounds; medians. Pinning: redis=${REDIS_CPUS:-none} caddy=${CADDY_CPUS:-none} wrk=${WRK_CPUS:-none}."
echo "redis_rate's GCRA, same server, same run: ${g:-?} µs per call (r)"
echo
echo "| setup | | req/s | / plain | Redis µs per script call (commandstats) | / (r) | script calls per decision | Redis CPU µs per decision (INFO cpu) |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for s in $SETUPS; do
	x=$(echo "${rps[$s]}" | median)
	ratio="-" us="-" vs="-" cp="-" sh="-"
	[[ -n ${rps[a]:-} && $s != r ]] && ratio=$(awk -v x="$x" -v a="$(echo "${rps[a]}" | median)" 'BEGIN { printf "%.2f", x / a }')
	if [[ $s != a ]]; then
		us=$(echo "${per[$s]}" | median)
		cp=$(echo "${cpus[$s]}" | median)
		sh=$(echo "${shares[$s]}" | median)
		[[ -n $g ]] && vs=$(awk -v u="$us" -v g="$g" 'BEGIN { printf "%.2f", u / g }')
	fi
	[[ $s == r ]] && x="-"
	echo "| ($s) | ${what[$s]} | $x | $ratio | $us | $vs | $sh | $cp |"
done
echo "Per round: $(for s in $SETUPS; do printf '(%s) req/s%s, µs/call%s, calls/decision%s, CPU µs%s; ' "$s" "${rps[$s]}" "${per[$s]:-}" "${shares[$s]:-}" "${cpus[$s]:-}"; done)"
echo
echo "bench/redisrate alone on the same server afterwards (no Caddy, no wrk):"
echo "$rr" | sed -n '/^Redis µs/,$p' 
