#!/bin/sh
# Decisions per second of the Redis store against a local redis-server,
# serial and concurrent, beside redis-benchmark's own figure for the same
# script by EVALSHA, with the same concurrency (32 connections; the Go
# benchmark runs 16 goroutines per CPU, 32 on 2 CPUs).
#
# Usage: bench/redis-benchmark.sh   (needs redis-server, redis-cli,
# redis-benchmark; REDIS_BENCH_PORT picks the port, default 16379)
set -eu
cd "$(dirname "$0")/.."
port=${REDIS_BENCH_PORT:-16379}
dir=$(mktemp -d)
redis-server --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
	--dir "$dir" --logfile "$dir/redis.log" --pidfile "$dir/redis.pid" --daemonize yes
trap 'kill "$(cat "$dir/redis.pid")" 2>/dev/null; rm -rf "$dir"' EXIT
until redis-cli -h 127.0.0.1 -p "$port" ping >/dev/null 2>&1; do sleep 0.1; done

# The script, as internal/redisbucket holds it: its state part
# (script.go), then its operations (script_ops.go).
script="$(sed -n '/^const bucketLuaState = `/,/^`$/p' internal/redisbucket/script.go | sed '1d;$d')
$(sed -n '/^const bucketLuaOps = `/,/^`$/p' internal/redisbucket/script_ops.go | sed '1d;$d')"
sha=$(redis-cli -h 127.0.0.1 -p "$port" SCRIPT LOAD "$script")

# One bucket that never denies (capacity 1e9, 1 token per µs), cost 1: every
# call runs the whole script and writes the key, as an allowed Take does.
for c in 1 32; do
	echo "redis-benchmark, EVALSHA $sha, $c connection(s):"
	redis-benchmark -h 127.0.0.1 -p "$port" -n 200000 -c "$c" -q \
		EVALSHA "$sha" 1 rl:bench:default:0123456789abcdef0123456789abcdef take 1 1 0 0 0 1000000000 1 1 0 |
		tr '\r' '\n' | tail -n 1
done

echo "Go, Store.Take (its own redis-server):"
go test -run '^$' -bench 'BenchmarkRedisTake' -benchtime 3s ./internal/redisbucket 2>&1 | grep -E '^(Benchmark|ok|FAIL)|decisions'
