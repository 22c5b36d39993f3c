#!/usr/bin/env bash
# Throughput and latency of Caddy with rate_limit, against the same Caddy
# without it, under wrk, on loopback.
#
# It builds two Caddy binaries, the same Caddy version with the same flags:
# standard Caddy alone, and standard Caddy with this plugin (./cmd/caddy).
# It starts one redis-server and one Caddy per setup, on free 127.0.0.1
# ports, and runs wrk against each in turn, round after round (a b c d e,
# a b c d e, ...), so that the machine's drift hits every setup alike:
#
#   (a) no limiter (plain Caddy)
#   (b) the local store, by IP, limits never hit
#   (c) the local store with 1M distinct clients (X-Key, bench/keys.lua)
#   (d) the Redis store, by IP, limits never hit
#   (e) one client flooding the Redis store after its denial: the deny
#       cache answers; Redis INFO commandstats counts what it cost
#   (f) plain Caddy answering 429 through its error path (`error 429`),
#       as denials go: what (e) costs without a limiter
#   (g) (d) with the Redis store's "batch" turned off, so each decision
#       is its own EVALSHA, not pipelined with concurrent ones
#       (config: d.Caddyfile adapted, then "batch": false)
#   (h) (a) driven by bench/keys.lua, as (c) is: the baseline for (c),
#       since wrk with a Lua request() runs differently from plain wrk
#   (i) the Redis store with leases (`lease 10%`, DESIGN 9), 1,000
#       returning clients by X-Key (bench/keys.lua with LEASE_KEYS), limits
#       never hit: most decisions are made from leased tokens, in memory
#   (j) (i) in strict mode (no `lease`): one EVALSHA per request, the
#       same clients
#   (m) the Redis store with `lease 10%` by IP, under plain wrk as (a):
#       one client, never limited, decided from leased tokens; (i)'s
#       figure without bench/keys.lua
#   (n) (i) on the local store: the same limit and clients, every
#       decision in memory; (i)/(n) is what leases cost
#
# Every route is `respond "ok"`. Everything it starts is stopped on exit.
# It prints a markdown table for bench/README.md. Redis CPU per decision
# beside go-redis/redis_rate: bench/redis-cpu.sh (and bench/redisrate).
#
# Usage: bench/run.sh
# Environment (defaults in brackets):
#   ROUNDS [3]          rounds of all setups
#   DURATION [10s]      each wrk run
#   WARMUP [0s]         an unmeasured wrk run of each setup just before its
#                       measured one, in every round (e.g. 3s): the figures
#                       of a warm Caddy, whose leases have grown (a round
#                       comes back to a setup after the others' runs, long
#                       enough for its leases to lapse and be forgotten)
#   THREADS [1]         wrk threads
#   CONNECTIONS [32]    wrk connections
#   SETUPS [a b c d e f g h i j]  which setups, in this order within a round
#   KEYS [1000000]      distinct clients in (c) and (h)
#   LEASE_KEYS [1000]   distinct clients in (i), (j) and (n)
#   PREFILL [1]         send every (c) key once before the rounds, so the
#                       store holds them all from the first round
#   CADDY_CPUS, WRK_CPUS, REDIS_CPUS  taskset CPU lists; empty: no pinning
#   PROFILE []          setups to profile after the rounds, e.g. "d e": a
#                       CPU profile of each one's Caddy under wrk, from its
#                       loopback admin endpoint, and `go tool pprof -top`
#   BUILD_DIR [/tmp/caddy-ratelimit-bench]  cached binaries
#   OUT_DIR []          keep wrk outputs and profiles here (default: a temp
#                       directory, removed on exit)
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
DURATION=${DURATION:-10s}
WARMUP=${WARMUP:-0s}
THREADS=${THREADS:-1}
CONNECTIONS=${CONNECTIONS:-32}
SETUPS=${SETUPS:-a b c d e f g h i j}
KEYS=${KEYS:-1000000}
LEASE_KEYS=${LEASE_KEYS:-1000}
PREFILL=${PREFILL:-1}
CADDY_CPUS=${CADDY_CPUS:-}
WRK_CPUS=${WRK_CPUS:-}
REDIS_CPUS=${REDIS_CPUS:-}
PROFILE=${PROFILE:-}
BUILD_DIR=${BUILD_DIR:-${TMPDIR:-/tmp}/caddy-ratelimit-bench}

for tool in go wrk redis-server redis-cli curl python3 jq; do
	command -v "$tool" >/dev/null || { echo "bench/run.sh: $tool is not on the PATH" >&2; exit 1; }
done

work=$(mktemp -d)
out=${OUT_DIR:-$work/out}
mkdir -p "$out" "$BUILD_DIR"
pids=()
cleanup() {
	for pid in "${pids[@]}"; do
		kill "$pid" 2>/dev/null || true
	done
	for pid in "${pids[@]}"; do
		wait "$pid" 2>/dev/null || true
	done
	rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

log() { echo "run.sh: $*" >&2; }

# Command prefixes that pin to CPUs, or nothing. Not a function: a
# backgrounded function is a subshell, and $! would name it, not the server.
pin_caddy=() pin_wrk=() pin_redis=()
[[ -n $CADDY_CPUS ]] && pin_caddy=(taskset -c "$CADDY_CPUS")
[[ -n $WRK_CPUS ]] && pin_wrk=(taskset -c "$WRK_CPUS")
[[ -n $REDIS_CPUS ]] && pin_redis=(taskset -c "$REDIS_CPUS")

free_port() {
	python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ---- build -----------------------------------------------------------------

caddy_version=$(awk '$1 == "github.com/caddyserver/caddy/v2" { print $2 }' "$repo/go.mod")
buildflags=(-trimpath)
plain=$BUILD_DIR/caddy-plain-$caddy_version
limited=$BUILD_DIR/caddy-ratelimit
if [[ ! -x $plain ]]; then
	# A throwaway module with the repository's go.mod and go.sum, so that
	# Caddy and every dependency are the versions the plugin build uses.
	log "building plain Caddy $caddy_version into $plain (once; minutes on a cold cache)"
	mod=$work/plain
	mkdir -p "$mod"
	sed 's#^module .*#module caddy-plain#' "$repo/go.mod" >"$mod/go.mod"
	cp "$repo/go.sum" "$mod/go.sum"
	cat >"$mod/main.go" <<-'EOF'
		// Command caddy is standard Caddy, without the rate_limit plugin.
		package main

		import (
			caddycmd "github.com/caddyserver/caddy/v2/cmd"

			_ "github.com/caddyserver/caddy/v2/modules/standard"
		)

		func main() { caddycmd.Main() }
	EOF
	(cd "$mod" && GOFLAGS=-mod=mod go build "${buildflags[@]}" -o "$plain.tmp" .)
	mv "$plain.tmp" "$plain"
fi
# The plugin changes as it is worked on: go build's cache makes this quick
# when nothing did.
log "building Caddy $caddy_version with the plugin into $limited"
(cd "$repo" && go build "${buildflags[@]}" -o "$limited" ./cmd/caddy)

# ---- servers ---------------------------------------------------------------

redis_port=$(free_port)
"${pin_redis[@]}" redis-server --bind 127.0.0.1 --port "$redis_port" --save "" --appendonly no \
	--dir "$work" --logfile "$work/redis.log" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 100); do
	redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null 2>&1 && break
	sleep 0.1
done
redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null

binary() { if [[ $1 == a || $1 == f || $1 == h ]]; then echo "$plain"; else echo "$limited"; fi; }
caddyfile() { if [[ $1 == h ]]; then echo "$repo/bench/caddy/a.Caddyfile"; else echo "$repo/bench/caddy/$1.Caddyfile"; fi; }

declare -A port admin
for s in $SETUPS; do
	port[$s]=$(free_port)
	admin[$s]=$(free_port)
	export BENCH_PORT=${port[$s]} BENCH_ADMIN_PORT=${admin[$s]} BENCH_REDIS_PORT=$redis_port
	config=(--adapter caddyfile --config "$(caddyfile "$s")")
	if [[ $s == g ]]; then
		"$limited" adapt --config "$repo/bench/caddy/d.Caddyfile" 2>/dev/null |
			jq 'walk(if type == "object" and (.store? | type) == "object" and .store.store == "redis"
				then .store.batch = false | .name = "bench_g" else . end)' >"$work/g.json"
		grep -q '"batch": false' "$work/g.json" || { log "could not set batch in $work/g.json"; exit 1; }
		config=(--config "$work/g.json")
	fi
	mkdir -p "$work/home-$s"
	HOME=$work/home-$s XDG_DATA_HOME=$work/home-$s XDG_CONFIG_HOME=$work/home-$s \
		"${pin_caddy[@]}" "$(binary "$s")" run "${config[@]}" >"$out/caddy-$s.log" 2>&1 &
	pids+=($!)
done
for s in $SETUPS; do
	for _ in $(seq 100); do
		curl -s -o /dev/null "http://127.0.0.1:${port[$s]}/" && break
		sleep 0.1
	done
	curl -s -o /dev/null "http://127.0.0.1:${port[$s]}/" || { log "caddy ($s) did not start:"; cat "$out/caddy-$s.log" >&2; exit 1; }
done
log "redis on $redis_port; caddy: $(for s in $SETUPS; do printf '%s=%s ' "$s" "${port[$s]}"; done)"

# ---- wrk -------------------------------------------------------------------

wrk_run() { # wrk_run <setup> <output file> [duration]
	local s=$1 file=$2 d=${3:-$DURATION}
	local script=() keys=$KEYS
	[[ $s == c || $s == h || $s == i || $s == j || $s == n ]] && script=(-s "$repo/bench/keys.lua")
	[[ $s == i || $s == j || $s == n ]] && keys=$LEASE_KEYS
	BENCH_KEYS=$keys "${pin_wrk[@]}" wrk -t"$THREADS" -c"$CONNECTIONS" -d"$d" --latency "${script[@]}" \
		"http://127.0.0.1:${port[$s]}/" >"$file"
}

redis_script_calls() { # EVAL, EVALSHA and their _ro forms, since start
	redis-cli -h 127.0.0.1 -p "$redis_port" INFO commandstats |
		awk -F'[:=,]' '/^cmdstat_(eval|evalsha|eval_ro|evalsha_ro):/ { n += $3 } END { print n + 0 }'
}

if [[ " $SETUPS " == *" c "* && $PREFILL == 1 ]]; then
	# wrk runs to its duration even when its script stops it, so it is
	# stopped from here once the store holds every key (at most 300 s).
	log "(c): sending each of the $KEYS keys once"
	BENCH_KEYS=$KEYS BENCH_FILL=1 "${pin_wrk[@]}" wrk -t1 -c"$CONNECTIONS" -d300s -s "$repo/bench/keys.lua" \
		"http://127.0.0.1:${port[c]}/" >"$out/prefill-c.txt" &
	fill=$!
	pids+=("$fill")
	for _ in $(seq 300); do
		sleep 1
		awk -v want="$KEYS" '$1 == "caddy_http_rate_limit_keys{policy=\"bench_c\"}" && $2 + 0 >= want { found = 1 } END { exit !found }' \
			<(curl -s "http://127.0.0.1:${admin[c]}/metrics") && break
	done
	kill "$fill" 2>/dev/null || true
	wait "$fill" 2>/dev/null || true
fi
if [[ " $SETUPS " == *" e "* ]]; then
	# The one request that is allowed; every later one is denied.
	curl -s -o /dev/null "http://127.0.0.1:${port[e]}/"
fi

store_errors() { # store_errors <setup>: the Redis store's failed calls since start
	curl -s "http://127.0.0.1:${admin[$1]}/metrics" |
		awk '/^caddy_http_rate_limit_store_errors_total/ { n += $2 } END { printf "%d", n }'
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A redis_calls redis_reqs redis_errors
for r in $(seq "$ROUNDS"); do
	for s in $SETUPS; do
		if [[ $WARMUP != 0s && $WARMUP != 0 ]]; then
			wrk_run "$s" "$out/warmup-$s-$r.txt" "$WARMUP"
		fi
		before=$(redis_script_calls)
		errors=$(store_errors "$s")
		wrk_run "$s" "$out/wrk-$s-$r.txt"
		after=$(redis_script_calls)
		redis_calls[$s]=$((${redis_calls[$s]:-0} + after - before))
		redis_errors[$s]=$((${redis_errors[$s]:-0} + $(store_errors "$s") - errors))
		n=$(awk '/requests in/ { print $1 }' "$out/wrk-$s-$r.txt")
		redis_reqs[$s]=$((${redis_reqs[$s]:-0} + n))
		log "round $r ($s): $(awk '/Requests\/sec/ { print $2 }' "$out/wrk-$s-$r.txt") req/s, $((after - before)) Redis script calls"
	done
done

# ---- figures ---------------------------------------------------------------

# to_us <wrk duration such as 512.00us, 1.23ms, 2.00s>
to_us() {
	awk -v v="$1" 'BEGIN {
		if (v ~ /us$/) m = 1; else if (v ~ /ms$/) m = 1000; else if (v ~ /m$/) m = 60e6; else m = 1e6
		sub(/[a-z]+$/, "", v); printf "%.0f", v * m }'
}
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else print (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
field() { # field <setup> <awk program printing one value per file>
	local s=$1 prog=$2
	for r in $(seq "$ROUNDS"); do awk "$prog" "$out/wrk-$s-$r.txt"; done
}

declare -A what=(
	[a]="no limiter (plain Caddy)"
	[b]="local store, by IP, never limited"
	[c]="local store, $KEYS distinct X-Key clients"
	[d]="Redis store, by IP, never limited (\`batch\` on, the default)"
	[e]="Redis store, one denied client (deny cache)"
	[f]="no limiter, plain Caddy answering \`error 429\`"
	[g]="Redis store, by IP, never limited, \`batch\` off"
	[h]="no limiter (plain Caddy), under bench/keys.lua as (c)"
	[i]="Redis store, \`lease 10%\`, $LEASE_KEYS returning X-Key clients, never limited"
	[j]="Redis store, strict (no \`lease\`), $LEASE_KEYS returning X-Key clients, never limited"
	[m]="Redis store, \`lease 10%\`, by IP, never limited, plain wrk as (a)"
	[n]="local store, (i)'s limit and $LEASE_KEYS returning X-Key clients, never limited"
)
declare -A rps
for s in $SETUPS; do
	rps[$s]=$(field "$s" '/Requests\/sec/ { print $2 }' | median)
done

echo
echo "Caddy $caddy_version, $(nproc) CPUs, load average before the runs: $load_before"
echo "wrk -t$THREADS -c$CONNECTIONS -d$DURATION --latency (after $WARMUP unmeasured), $ROUNDS alternating rounds; medians over rounds." \
	"Pinning: caddy=${CADDY_CPUS:-none} wrk=${WRK_CPUS:-none} redis=${REDIS_CPUS:-none}."
echo
echo "| setup | | req/s | ratio to (a) | p50 | p99 | non-2xx | Redis script calls per request |"
echo "|---|---|---:|---:|---:|---:|---:|---:|"
for s in $SETUPS; do
	ratio="-"
	[[ -n ${rps[a]:-} ]] && ratio=$(awk -v x="${rps[$s]}" -v a="${rps[a]}" 'BEGIN { printf "%.2f", x / a }')
	p50=$(for r in $(seq "$ROUNDS"); do to_us "$(awk '$1 == "50%" { print $2 }' "$out/wrk-$s-$r.txt")"; echo; done | median)
	p99=$(for r in $(seq "$ROUNDS"); do to_us "$(awk '$1 == "99%" { print $2 }' "$out/wrk-$s-$r.txt")"; echo; done | median)
	non2xx=$(field "$s" 'BEGIN { n = 0 } /Non-2xx/ { n = $NF } END { print n }' | awk '{ t += $1 } END { print t + 0 }')
	per="-"
	if [[ $s == d || $s == e || $s == g || $s == i || $s == j || $s == m ]]; then
		per=$(awk -v c="${redis_calls[$s]}" -v n="${redis_reqs[$s]}" 'BEGIN { printf "%.6f (%d / %d)", c / n, c, n }')
	fi
	printf '| (%s) | %s | %.0f | %s | %s µs | %s µs | %s | %s |\n' \
		"$s" "${what[$s]}" "${rps[$s]}" "$ratio" "$p50" "$p99" "$non2xx" "$per"
done
# A request whose store call failed (a timeout, or the breaker open after
# five) is decided by on_store_error (local by default): its throughput is
# the local store's, not the setup's.
echo "Store errors per request (decided by on_store_error):"
for s in $SETUPS; do
	[[ $s == d || $s == e || $s == g || $s == i || $s == j || $s == m ]] || continue
	awk -v s="$s" -v e="${redis_errors[$s]}" -v n="${redis_reqs[$s]}" 'BEGIN { printf "  (%s) %.4f (%d / %d)\n", s, e / n, e, n }'
done
echo "Per-round req/s:"
for s in $SETUPS; do
	echo "  ($s) $(field "$s" '/Requests\/sec/ { printf "%s ", $2 }')"
done
# A setup against its baseline round by round, each pair run back to back
# but for the setups between them: the median of those ratios drifts less
# than the ratio of the medians.
echo "Paired ratios, the median over rounds of each round's ratio:"
for pair in b/a c/h c/b d/a e/a e/f d/g i/a i/h i/d i/j i/n n/h m/a j/h; do
	x=${pair%/*} y=${pair#*/}
	[[ -n ${rps[$x]:-} && -n ${rps[$y]:-} ]] || continue
	ratio=$(for r in $(seq "$ROUNDS"); do
		paste <(awk '/Requests\/sec/ { print $2 }' "$out/wrk-$x-$r.txt") <(awk '/Requests\/sec/ { print $2 }' "$out/wrk-$y-$r.txt") |
			awk '{ printf "%.4f\n", $1 / $2 }'
	done | median)
	printf '  (%s)/(%s) %.2f\n' "$x" "$y" "$ratio"
done
if [[ " $SETUPS " == *" c "* ]]; then
	keys=$(curl -s "http://127.0.0.1:${admin[c]}/metrics" | awk '/^caddy_http_rate_limit_keys\{policy="bench_c"\}/ { print $2 }')
	echo "(c) buckets held by the local store after the rounds: ${keys:-unknown}"
fi

# ---- profile ---------------------------------------------------------------

for s in $PROFILE; do
	secs=${DURATION%s}
	log "profiling ($s) for ${secs}s under wrk"
	wrk_run "$s" "$out/wrk-$s-profile.txt" "$((secs + 2))s" &
	wrk_pid=$!
	sleep 1
	curl -s -o "$out/cpu-$s.pprof" "http://127.0.0.1:${admin[$s]}/debug/pprof/profile?seconds=$secs"
	wait "$wrk_pid"
	echo
	bin=$(binary "$s")
	echo "CPU profile of Caddy ($s) under wrk, ${secs}s: $out/cpu-$s.pprof"
	go tool pprof -top -nodecount=35 "$bin" "$out/cpu-$s.pprof" 2>/dev/null
done
