-- Names a different client on each request, by X-Key, cycling through
-- BENCH_KEYS values (default 1000000). Each wrk thread starts at its own
-- random offset. With BENCH_FILL set, it starts at 1 instead, so the keys go
-- in order: bench/run.sh uses that to fill the store.
local n = tonumber(os.getenv("BENCH_KEYS") or "1000000")
local fill = os.getenv("BENCH_FILL") ~= nil
local host, i = "", 0

function init(args)
	host = wrk.host .. ":" .. wrk.port
	if not fill then
		math.randomseed(os.time() + tonumber(tostring({}):match("0x(%x+)") or "0", 16) % 1000003)
		i = math.random(n) - 1
	end
end

-- Concatenating the request by hand is several times cheaper than
-- wrk.format, and wrk shares the CPUs with Caddy.
function request()
	i = i % n + 1
	return "GET / HTTP/1.1\r\nHost: " .. host .. "\r\nX-Key: client-" .. i .. "\r\n\r\n"
end
