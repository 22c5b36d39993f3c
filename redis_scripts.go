package ratelimit

import "github.com/redis/go-redis/v9"

// takeScript applies one request to one bucket, atomically, with the math
// of bucket.go's Take and Peek, in Lua's doubles: every figure stays below
// 2^53, so they are exact, and idiv corrects the rounding of a quotient.
//
// KEYS[1] is the bucket, stored as "<fullAt> <slack>" (microseconds of the
// server's TIME) and expiring when the bucket is full again, when it is the
// same as no bucket. A denial writes nothing.
//
// ARGV: capacity, rate tokens, rate interval (µs), cost (0 peeks), and
// optionally microseconds to add to TIME, which only tests pass.
//
// It returns {allowed (0|1), remaining, retry after, reset after, now}.
//
// It reads TIME and then writes, which Redis before 5 refuses unless the
// script replicates its effects rather than itself: replicate_commands
// asks for that on 3.2 and 4, and does nothing from 5 on (7 only keeps it
// for old scripts). Older Redis refuses the write; the error says why.
const takeScript = `
if redis.replicate_commands then redis.replicate_commands() end
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
  return q
end
local function ceildiv(a, b) return idiv(a + b - 1, b) end

local capacity = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local interval = tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[5] or '0')
local units = capacity * interval

local full_at, slack = 0, 0
local v = redis.call('GET', KEYS[1])
if v then
  local a, b = string.match(v, '^(%d+) (%d+)$')
  if not a then
    return redis.error_reply('rate_limit: key ' .. KEYS[1] .. ' does not hold a bucket')
  end
  full_at, slack = tonumber(a), tonumber(b)
end

local deficit = 0
if now < full_at then
  deficit = (full_at - now) * tokens - slack
  if deficit > units or deficit < 0 then deficit = units end
end
local level = units - deficit

if cost == 0 then
  local allowed = 0
  if level >= interval then allowed = 1 end
  return {allowed, idiv(level, interval), 0, ceildiv(deficit, tokens), now}
end
local need = cost * interval
if level < need then
  return {0, idiv(level, interval), ceildiv(need - level, tokens), ceildiv(deficit, tokens), now}
end
deficit = deficit + need
local refill = ceildiv(deficit, tokens)
local ok = redis.pcall('SET', KEYS[1], string.format('%d %d', now + refill, refill * tokens - deficit),
  'PX', ceildiv(refill, 1000) + 1)
if type(ok) == 'table' and ok.err then
  return redis.error_reply('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. ok.err)
end
return {1, idiv(level - need, interval), 0, refill, now}
`

// bucketScript runs takeScript by EVALSHA, and by EVAL when Redis answers
// NOSCRIPT (a restart, a failover, SCRIPT FLUSH), which loads it again.
var bucketScript = redis.NewScript(takeScript)
