package ratelimit

import "github.com/redis/go-redis/v9"

// luaArithmetic opens every script: effects replication (below), and
// integer division on doubles, corrected for the rounding of a quotient.
const luaArithmetic = `
if redis.replicate_commands then redis.replicate_commands() end
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
  return q
end
local function ceildiv(a, b) return idiv(a + b - 1, b) end
`

// The scripts apply bucket.go's math to one bucket, atomically, in Lua's
// doubles: every figure stays below 2^53, so they are exact, and idiv
// corrects the rounding of a quotient.
//
// KEYS[1] is the bucket, stored as "<fullAt> <slack>" (microseconds of the
// server's TIME) and expiring when the bucket is full again, when it is the
// same as no bucket.
//
// Every script's ARGV starts alike: capacity, rate tokens, rate interval
// (µs), a count of tokens (what each script does with it, below), and
// optionally microseconds to add to TIME, which only tests pass.
//
// They read TIME and then write, which Redis before 5 refuses unless the
// script replicates its effects rather than itself: replicate_commands
// asks for that on 3.2 and 4, and does nothing from 5 on (7 only keeps it
// for old scripts). Older Redis refuses the write; the error says why.
const scriptPrelude = luaArithmetic + `

local capacity = tonumber(ARGV[1])
local tokens = tonumber(ARGV[2])
local interval = tonumber(ARGV[3])
local count = tonumber(ARGV[4])
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
  if deficit > units then deficit = units elseif deficit < 0 then deficit = 0 end
end
local level = units - deficit

-- store keeps a bucket that lacks deficit units, until it is full again;
-- a full bucket is no bucket. It returns the microseconds until full.
local function store(deficit)
  if deficit <= 0 then
    redis.call('DEL', KEYS[1])
    return 0
  end
  local refill = ceildiv(deficit, tokens)
  local ok = redis.pcall('SET', KEYS[1], string.format('%d %d', now + refill, refill * tokens - deficit),
    'PX', ceildiv(refill, 1000) + 1)
  if type(ok) == 'table' and ok.err then
    error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. ok.err)
  end
  return refill
end

-- apply_ban empties the bucket for ban µs from now, unless a ban, which
-- leaves it lacking more than the whole bucket, holds it already. It
-- returns 1 when it started a ban, else 0.
local function apply_ban(ban)
  local gap = full_at - now
  if gap > 0 and gap > idiv(units + slack, tokens) then return 0 end
  local refill = ceildiv(units, tokens)
  full_at, slack = now + ban + refill, refill * tokens - units
  local ok = redis.pcall('SET', KEYS[1], string.format('%d %d', full_at, slack), 'PX', ceildiv(full_at - now, 1000) + 1)
  if type(ok) == 'table' and ok.err then
    error('rate_limit: Redis refused to write the bucket: ' .. ok.err)
  end
  return 1
end

-- wait_for is the µs until the bucket holds x units, at least 1; it holds
-- for a banned bucket too.
local function wait_for(x)
  local wait = full_at - now - idiv(units - x + slack, tokens)
  if wait < 1 then wait = 1 end
  return wait
end
`

// takeScript applies one request: bucket.go's Take, or Peek when the count
// (the request's cost) is 0. ARGV[6], when given and above 0, is the ban
// (µs): a denial then empties the bucket for that long, unless a ban holds
// it already. Any other denial writes nothing.
//
// It returns {allowed (0|1), remaining, retry after, reset after, now},
// and a sixth value, 1, when the denial started a ban.
const takeScript = scriptPrelude + `
if count == 0 then
  local allowed = 0
  if level >= interval then allowed = 1 end
  return {allowed, idiv(level, interval), 0, ceildiv(deficit, tokens), now}
end
local need = count * interval
if level < need then
  local ban = tonumber(ARGV[6] or '0')
  if ban <= 0 then
    local gap = full_at - now
    if gap > 0 and gap > idiv(units + slack, tokens) then
      -- In debt, or under a ban of an earlier config.
      return {0, 0, wait_for(need), gap, now}
    end
    return {0, idiv(level, interval), ceildiv(need - level, tokens), ceildiv(deficit, tokens), now}
  end
  local started = apply_ban(ban)
  return {0, 0, wait_for(need), full_at - now, now, started}
end
local refill = store(deficit + need)
return {1, idiv(level - need, interval), 0, refill, now}
`

// leaseScript is bucket.go's Lease: the count is the request's cost,
// ARGV[6] is the tokens the node wants (ARGV[5] must then be given), and
// ARGV[7] the ban (µs, 0 for none), applied when the lease is refused.
//
// It returns {granted, remaining, hold-off, reset after, now}, and a sixth
// value, 1, when the refusal started a ban.
const leaseScript = scriptPrelude + `
local want = tonumber(ARGV[6])
local ban = tonumber(ARGV[7] or '0')
if level < count * interval then
  if ban > 0 then
    local started = apply_ban(ban)
    return {0, 0, wait_for(want * interval), full_at - now, now, started}
  end
  return {0, idiv(level, interval), ceildiv(want * interval - level, tokens), ceildiv(deficit, tokens), now}
end
local granted = math.min(idiv(level, interval), want)
level = level - granted * interval
local refill = store(deficit + granted * interval)
local hold = 0
if granted < want then hold = ceildiv(want * interval - level, tokens) end
return {granted, idiv(level, interval), hold, refill, now}
`

// giveBackScript is bucket.go's GiveBack: the count is the unused leased
// tokens that go back, up to the capacity.
//
// It returns {count, 0, 0, reset after, now}.
const giveBackScript = scriptPrelude + `
local refill = store(deficit - count * interval)
return {count, 0, 0, refill, now}
`

// bucketScript runs takeScript by EVALSHA, and by EVAL when Redis answers
// NOSCRIPT (a restart, a failover, SCRIPT FLUSH), which loads it again.
var bucketScript = redis.NewScript(takeScript)

// leaseBucketScript and giveBackBucketScript run the lease scripts as
// bucketScript runs takeScript.
var (
	leaseBucketScript    = redis.NewScript(leaseScript)
	giveBackBucketScript = redis.NewScript(giveBackScript)
)

// takeAllScript is the local store's takeAll: one request against several
// limits of one bucket, all or none. KEYS[1] is a hash whose field i holds
// limit i's "<fullAt> <slack>"; the key expires when every limit is full.
//
// ARGV: the number of limits n, the cost, microseconds to add to TIME
// (tests only; 0 otherwise), then for each limit its capacity, rate tokens
// and rate interval.
//
// It returns, for each limit, {allowed (0|1), remaining, retry after,
// reset after}, as Take would for that limit alone, but taking only when
// all allow; then the server's time.
const takeAllScript = luaArithmetic + `

local n = tonumber(ARGV[1])
local cost = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[3])
local fields = redis.call('HMGET', KEYS[1], unpack((function()
  local f = {}
  for i = 1, n do f[i] = tostring(i) end
  return f
end)()))

local out, levels, deficits, allowed = {}, {}, {}, true
for i = 1, n do
  local capacity, tokens, interval = tonumber(ARGV[1 + 3 * i]), tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
  local units = capacity * interval
  local deficit = 0
  if fields[i] then
    local a, b = string.match(fields[i], '^(%d+) (%d+)$')
    if not a then
      return redis.error_reply('rate_limit: key ' .. KEYS[1] .. ' does not hold a bucket')
    end
    local full_at, slack = tonumber(a), tonumber(b)
    if now < full_at then
      deficit = (full_at - now) * tokens - slack
      if deficit > units then deficit = units elseif deficit < 0 then deficit = 0 end
    end
  end
  deficits[i], levels[i] = deficit, units - deficit
  if levels[i] < cost * interval then allowed = false end
end

local ttl = 0
for i = 1, n do
  local tokens, interval = tonumber(ARGV[2 + 3 * i]), tonumber(ARGV[3 + 3 * i])
  local need = cost * interval
  local level, deficit = levels[i], deficits[i]
  if allowed then
    deficit = deficit + need
    local refill = ceildiv(deficit, tokens)
    redis.call('HSET', KEYS[1], tostring(i), string.format('%d %d', now + refill, refill * tokens - deficit))
    if refill > ttl then ttl = refill end
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = 1, idiv(level - need, interval), 0, refill
  else
    local retry = 0
    if level < need then retry = ceildiv(need - level, tokens) end
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = 0, idiv(level, interval), retry, ceildiv(deficit, tokens)
  end
end
if allowed then redis.call('PEXPIRE', KEYS[1], ceildiv(ttl, 1000) + 1) end
out[#out + 1] = now
return out
`

// takeAllBucketScript runs takeAllScript as bucketScript runs takeScript.
var takeAllBucketScript = redis.NewScript(takeAllScript)

// chargeScript is bucket.go's Charge: the count is the tokens taken after
// the fact, and ARGV[6] the deepest deficit (units) the bucket may reach.
//
// It returns {count, 0, 0, reset after, now}.
const chargeScript = scriptPrelude + `
local floor = tonumber(ARGV[6])
if count > idiv(floor, interval) then count = idiv(floor, interval) end
local raw = 0
if now < full_at then
  raw = (full_at - now) * tokens - slack
  if raw < 0 then raw = 0 end
end
if raw > floor then raw = floor end
raw = raw + count * interval
if raw > floor then raw = floor end
local refill = store(raw)
return {count, 0, 0, refill, now}
`

// chargeBucketScript runs chargeScript as bucketScript runs takeScript.
var chargeBucketScript = redis.NewScript(chargeScript)
