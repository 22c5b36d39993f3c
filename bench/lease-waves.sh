#!/usr/bin/env bash
# Setup (i) of bench/run.sh on one Caddy build under wrk for 8 s, and, every
# 100 ms, the script calls Redis ran (INFO commandstats) and the requests
# whose store call failed (store_errors_total), to see when the lease
# calls come (bench/README.md, "Issue 34: leases with many keys").
#
# Usage: bench/lease-waves.sh <caddy binary>
set -u
repo=$(cd "$(dirname "$0")/.." && pwd)
bin=$1
work=$(mktemp -d)
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$work"' EXIT
fp() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
rp=$(fp) cp=$(fp) ap=$(fp)
redis-server --bind 127.0.0.1 --port "$rp" --save "" --appendonly no --dir "$work" --logfile "$work/redis.log" >/dev/null 2>&1 &
pids+=($!)
sleep 0.5
BENCH_PORT=$cp BENCH_ADMIN_PORT=$ap BENCH_REDIS_PORT=$rp HOME=$work XDG_DATA_HOME=$work XDG_CONFIG_HOME=$work \
	"$bin" run --adapter caddyfile --config "$repo/bench/caddy/i.Caddyfile" >"$work/caddy.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$cp/" && break; sleep 0.1; done
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
BENCH_KEYS=1000 wrk -t1 -c32 -d8s -s "$repo/bench/keys.lua" "http://127.0.0.1:$cp/" >"$work/wrk.txt" &
wpid=$!
python3 - "$rp" "$ap" <<'PY'
import socket, sys, time, urllib.request
rp, ap = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", rp))
def calls():
    s.sendall(b"INFO commandstats\r\n")
    data = b""
    while True:
        data += s.recv(65536)
        head = data.find(b"\r\n")
        if head > 0 and len(data) >= head + 2 + int(data[1:head]) + 2:
            break
    for line in data.decode().split("\r\n"):
        if line.startswith("cmdstat_evalsha:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0
def errors():
    for line in urllib.request.urlopen(f"http://127.0.0.1:{ap}/metrics").read().decode().splitlines():
        if line.startswith("caddy_http_rate_limit_store_errors_total"):
            return float(line.split()[1])
    return 0
t0, c0, e0 = time.time(), calls(), errors()
while time.time() - t0 < 7.5:
    time.sleep(0.1)
    c, e = calls(), errors()
    print(f"{time.time() - t0:4.1f} s  script calls +{c - c0:5d}  store errors +{int(e - e0):5d}")
    c0, e0 = c, e
PY
wait "$wpid"
grep Requests/sec "$work/wrk.txt"
echo "load average $(cut -d' ' -f1-3 /proc/loadavg)"
