package ratelimit

import "github.com/redis/go-redis/v9"

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
const scriptPrelude = `
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
  if deficit > units or deficit < 0 then deficit = units end
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
-- leaves it lacking more than the whole bucket, holds it already.
local function apply_ban(ban)
  local gap = full_at - now
  if gap > 0 and gap > idiv(units + slack, tokens) then return end
  local refill = ceildiv(units, tokens)
  full_at, slack = now + ban + refill, refill * tokens - units
  local ok = redis.pcall('SET', KEYS[1], string.format('%d %d', full_at, slack), 'PX', ceildiv(full_at - now, 1000) + 1)
  if type(ok) == 'table' and ok.err then
    error('rate_limit: Redis refused to write the bucket: ' .. ok.err)
  end
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
// It returns {allowed (0|1), remaining, retry after, reset after, now}.
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
    return {0, idiv(level, interval), ceildiv(need - level, tokens), ceildiv(deficit, tokens), now}
  end
  apply_ban(ban)
  return {0, 0, wait_for(need), full_at - now, now}
end
local refill = store(deficit + need)
return {1, idiv(level - need, interval), 0, refill, now}
`

// leaseScript is bucket.go's Lease: the count is the request's cost,
// ARGV[6] is the tokens the node wants (ARGV[5] must then be given), and
// ARGV[7] the ban (µs, 0 for none), applied when the lease is refused.
//
// It returns {granted, remaining, hold-off, reset after, now}.
const leaseScript = scriptPrelude + `
local want = tonumber(ARGV[6])
local ban = tonumber(ARGV[7] or '0')
if level < count * interval then
  if ban > 0 then
    apply_ban(ban)
    return {0, 0, wait_for(want * interval), full_at - now, now}
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
