package redisbucket

import "github.com/redis/go-redis/v9"

// bucketLua applies package bucket's steps to one bucket, and those of
// the model of a shared bucket (internal/bucket/buckettest/shared.go),
// atomically: a request's take over every limit of its tier, a peek, a
// lease, the give-back of a lease, a give-back outside leases
// (count_status), and a charge after the fact (cost_from_response). It
// computes in Lua's doubles: every figure stays below 2^53, so they are
// exact, and idiv corrects the rounding of a quotient.
//
// KEYS[1] is the bucket, a string of segments separated by ";": first
// limit 1's state, "<fullAt> <slack>" (with " b" after it when a ban wrote
// it; fullAt in microseconds of the server's TIME), or nothing when it is
// full; then each other limit that is not full, as "<i>:<state>"; then what
// each node holds on lease, as "l:<node>:<tokens>:<expires>:<seq>:<void>",
// followed by ":<qstop>:<mask>" when quotas counted them (shared.go's
// Held); then each quota's count, as "q<period>:<start>:<used>:<end>". A bucket
// that is full with nothing on lease has no key: it expires when every
// limit is full and every lease has expired. A bucket of one limit
// and no lease is "<fullAt> <slack>", as versions before leases kept it.
//
// ARGV: the operation (take, peek, lease, return, giveback or charge); the
// number of limits n; a count of tokens (the cost, or the tokens given back
// or charged); microseconds to add to TIME, which only tests set; the ban
// (µs, 0 for none; -1 marks the one limit of a plan of quotas alone,
// bucket.Limit's Instant); max_wait (µs, 0 for none); then for each limit its
// capacity, rate tokens and rate interval (µs); then the quotas (see
// below); then, for lease, the node, the call's seq, the tokens the node
// still holds, the tokens it wants, how long the record lives (µs),
// the tokens it spends at once, and 1 for a prefetch (0 otherwise); for
// return, the node and the seq of its lease; for giveback, optionally,
// the tokens the limits take back (the count when absent).
//
// The short form, six arguments at most, is a take on one limit without
// quotas or max_wait (takeArgs): the cost, the capacity, the rate tokens
// and the rate interval, then optionally the microseconds to add to TIME
// and the ban. Its fast path answers it with the few steps it needs, and
// costs Redis about what the leanest limiters' scripts cost (bench/README.md,
// "Redis CPU per decision"); a bucket it cannot answer (leases, a ban
// mark, a longer state) or a refusal that starts a ban goes on as the
// long form of the same take. A take in the long form without max_wait,
// on a bucket that holds only its limits' states and this period's quota
// counts, has a fast path too, after the arguments are read and before the
// helpers are defined; it answers as the long form does. A lease and its
// give-back on one limit without quotas, max_wait or a ban have short forms
// too, whose first argument is "l" or "r" (leaseArgs, returnArgs), and fast
// paths that answer them as the long form does, on a bucket that holds at
// most the calling node's lease: a node that leases the same keys again and
// again makes these two calls for each (bench/README.md, "Issue 34: leases
// with many keys").
//
// It answers:
//   - take, peek: {allowed, banned (a ban started), now, then for each
//     limit and quota {allowed, remaining, retry after (when allowed: the
//     wait), reset after}, then, for an allowed take, how long until every
//     limit and quota holds the cost again}
//   - the short form, from its fast path: {remaining, reset after, now,
//     x}, where x is, when allowed, how long until the limit holds the
//     cost again, and when refused, minus the retry after; otherwise as
//     take
//   - lease: {granted, remaining, retry after, hold-off (the limits'),
//     reset after, banned, drop, now, until (with quotas: when the tokens'
//     quota period ends, 0 without), quota hold (until the quotas hold the
//     cost), void (the node gives back what a ban voided), ban holds, the
//     retry after of the limits alone, then
//     each limit's and each quota's {remaining, reset after}}
//   - return, giveback: {tokens, now}
//   - charge: {tokens, now, debt (how long until every limit holds 0
//     tokens or more again, 0 when none is in debt)}
//
// It reads TIME and then writes, which Redis before 5 refuses unless the
// script replicates its effects rather than itself: replicate_commands asks
// for that on 3.2 and 4, and does nothing from 5 on.
const bucketLua = bucketLuaState + bucketLuaOps

// bucketLuaState is the first part of the script: its arguments, the
// bucket's text read into limits' states, leases and quota counts, the
// steps of package bucket and of buckettest's shared.go on them, and the
// write back.
const bucketLuaState = `
if redis.replicate_commands then redis.replicate_commands() end
local A, t, stored, got = ARGV, redis.call('TIME'), nil, false
if #A <= 6 then
  -- The fast path (takeArgs): a take on one limit, without quotas or
  -- max_wait, of a bucket stored as "<fullAt> <slack>" or not at all (no
  -- lease, no ban mark). It is package bucket's Take on one State, the
  -- steps below for n = 1 with nothing held, and it answers before any of
  -- them is defined: the closures and tables they build cost more than the
  -- take itself (bench/README.md, "Redis CPU per decision").
  -- TestRedisScriptMatchesTheSharedModel holds it to the model. Strings
  -- become numbers by arithmetic, which is cheaper than tonumber. Every
  -- dividend is below 2^53 (units at most 2^52, a cost at most the
  -- capacity, a slack below 2^31), so math.floor of a quotient is exact.
  local count, units, k, iv = A[1] + 0, A[2] + 0, A[3] + 0, A[4] + 0
  local now, ban, floor = t[1] * 1000000 + t[2], 0, math.floor
  if A[5] then now, ban = now + A[5], (A[6] or 0) + 0 end
  stored, got = redis.call('GET', KEYS[1]), true
  local full, slack = 0, 0
  if stored then
    full, slack = string.match(stored, '^(%d+) (%d+)$')
    if full then full, slack = full + 0, slack + 0 end
  end
  if full then
    -- x is the next wait when allowed (shared.go's Next), or minus the
    -- retry after when refused, which is at least 1.
    local need, gap, rem, reset, x = count * iv, full - now, 0, 0, 0
    units = units * iv
    if gap > 0 and gap > floor((units + slack) / k) then
      -- Overdrawn (a debt): refused until the level holds the cost.
      x, reset = floor((units - need + slack) / k) - gap, gap
      if x > -1 then x = -1 end
    else
      local d = 0
      if gap > 0 then
        d = gap * k - slack
        if d < 0 then d = 0 elseif d > units then d = units end
      end
      local level = units - d
      if level < need then
        rem, reset, x = floor(level / iv), floor((d + k - 1) / k), -floor((need - level + k - 1) / k)
      elseif count > 0 then
        rem, reset = floor((level - need) / iv), floor((d + need + k - 1) / k)
        full, slack = now + reset, reset * k - d - need
        if level - need < need then
          x = reset - floor((units - need + slack) / k)
          if x < 1 then x = 1 end
        end
      else
        rem, reset = floor(level / iv), floor((d + k - 1) / k)
      end
    end
    -- A refusal under a ban starts one: the rest of the script does that.
    if x >= 0 or ban == 0 then
      if full <= now then
        if stored then redis.call('DEL', KEYS[1]) end
      else
        local v = string.format('%d %d', full, slack)
        if v ~= stored then
          local w = redis.pcall('SET', KEYS[1], v, 'PX', floor((full - now + 999) / 1000) + 1)
          if w.err then
            error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. w.err)
          end
        end
      end
      return {rem, reset, now, x}
    end
  end
  -- The long form of the same take.
  A = {'take', '1', A[1], A[5] or '0', A[6] or '0', '0', A[2], A[3], A[4], '0'}
elseif A[1] == 'l' or A[1] == 'r' then
  -- The fast paths of a lease ('l') and of its give-back ('r') on one
  -- limit, without quotas, max_wait or a ban (leaseArgs, returnArgs in
  -- quota.go): the cost or the tokens, the capacity, the rate tokens and
  -- interval, the microseconds to add to TIME, the node and the call's
  -- seq, then for a lease the tokens the node holds, the tokens it wants,
  -- how long the record lives, the tokens it spends and 1 for a prefetch.
  -- They answer a bucket stored as "<fullAt> <slack>", with this node's
  -- lease after it (";l:<node>:<tokens>:<expires>:<seq>:0"), or not at
  -- all: the steps below for n = 1 and at most this one lease, with the
  -- same answer, before any helper is defined. Any other bucket, and a
  -- lease the limit refuses, goes on as the long form.
  -- TestRedisScriptMatchesTheSharedModel and
  -- TestTheLeaseFastPathsAnswerAsTheLongForm hold them to it.
  local count, c, k, iv = A[2] + 0, A[3] + 0, A[4] + 0, A[5] + 0
  local now, node, seq = t[1] * 1000000 + t[2] + A[6], A[7], A[8] + 0
  local min, units = math.min, c * iv
  stored, got = redis.call('GET', KEYS[1]), true
  local full, slack, ok, hn, ht, he, hs = 0, 0, not stored, nil, 0, 0, 0
  if stored then
    local a, b = string.match(stored, '^(%d+) (%d+)$')
    if a then
      ok = true
    else
      a, b, hn, ht, he, hs = string.match(stored, '^(%d+) (%d+);l:([^:;]+):(%d+):(%d+):(%d+):0$')
      if not a then
        a, b, hn, ht, he, hs = '0', '0', string.match(stored, '^;l:([^:;]+):(%d+):(%d+):(%d+):0$')
      end
      if hn == node then ht, he, hs, ok = ht + 0, he + 0, hs + 0, true end
    end
    if ok then full, slack = a + 0, b + 0 end
  end
  local function idiv(x, y)
    local q = math.floor(x / y)
    local r = x - q * y
    if r < 0 then q = q - 1 elseif r >= y then q = q + 1 end
    return q
  end
  -- deficit and state_at below, on (full, slack).
  local function def(at)
    if at >= full then return 0 end
    local gap = full - at
    if gap > idiv(units + slack, k) + 1 then return units end
    local d = gap * k - slack
    if d > units then return units elseif d < 0 then return 0 end
    return d
  end
  local function put(at, d)
    local refill = idiv(d + k - 1, k)
    full, slack = at + refill, refill * k - d
  end
  if ok and hn then
    -- settle_to(now): the lease caps the level; one that expired counted
    -- as spent when it did, and goes.
    local f = min(ht, c) * iv
    if he <= now then
      if def(he) < f then put(he, f) end
      hn = nil
    elseif def(now) < f then
      put(now, f)
    end
  end
  local r
  if ok and A[1] == 'l' then
    local held, want, hold, spend = A[9] + 0, A[10] + 0, A[11] + 0, A[12] + 0
    local gap, d = full - now, def(now)
    if not hn then ht = 0 end
    ht = min(ht, math.max(held, 0))
    if (gap <= 0 or gap <= idiv(units + slack, k)) and units - d >= count * iv then
      local grant = min(want, idiv(c, 2) - ht, idiv(units - d, iv))
      if grant < count then grant = count end
      put(now, d + grant * iv)
      ht, he, hs, hn = ht + grant - min(spend, grant), now + hold, seq, node
      if ht == 0 then hn = nil end
      -- wait_all(x) and peek on the new state.
      d = def(now)
      gap = full - now
      local over = gap > 0 and gap > idiv(units + slack, k)
      local function waitfor(x)
        if not over and units - d >= x * iv then return 0 end
        return math.max(1, gap - idiv(units - x * iv + slack, k))
      end
      local lretry, hold_off = waitfor(count), 0
      if grant < want and lretry > 0 then hold_off = waitfor(want) end
      local rem, reset = idiv(units - d, iv), idiv(d + k - 1, k)
      if d == units then reset = math.max(reset, math.max(1, gap - idiv(slack, k))) end
      r = {grant, rem, lretry, hold_off, reset, 0, 0, now, 0, 0, 0, 0, lretry, rem, reset}
    end
  elseif ok then
    local back = 0
    if hn and hs == seq then
      back, hn = math.max(0, min(count, ht)), nil
      if back > 0 then
        -- give_back, with nothing else out: the raw deficit less back.
        local maxd, g, raw = units + min(units * 1000, 4503599627370496 - units), full - now, 0
        if g > 0 then
          if g > idiv(maxd + slack, k) + 1 then raw = maxd else raw = min(math.max(0, g * k - slack), maxd) end
        end
        local d2 = raw - min(back, c) * iv
        if d2 <= 0 then full, slack = 0, 0 else put(now, d2) end
      end
    end
    r = {back, now}
  end
  if r then
    -- save, and life for one lease: the key lives until the lease has
    -- expired and the limit is full again from the cap it leaves.
    local v, ttl = '', full - now
    if full > now then v = string.format('%d %d', full, slack) end
    if hn then
      v = v .. string.format(';l:%s:%d:%d:%d:0', hn, ht, he, hs)
      local f0, s0 = full, slack
      if def(he) < min(ht, c) * iv then put(he, min(ht, c) * iv) end
      ttl = math.max(0, math.max(he, full) - now)
      full, slack = f0, s0
    end
    if v == '' then
      if stored then redis.call('DEL', KEYS[1]) end
    elseif v ~= stored then
      local w = redis.pcall('SET', KEYS[1], v, 'PX', idiv(ttl + 999, 1000) + 1)
      if w.err then
        error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. w.err)
      end
    end
    return r
  end
  if A[1] == 'l' then
    A = {'lease', '1', A[2], A[6], '0', '0', A[3], A[4], A[5], '0', A[7], A[8], A[9], A[10], A[11], A[12], A[13]}
  else
    A = {'return', '1', A[2], A[6], '0', '0', A[3], A[4], A[5], '0', A[7], A[8]}
  end
end
local function idiv(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then q = q - 1 elseif r >= b then q = q + 1 end
  return q
end
local function ceildiv(a, b) return idiv(a + b - 1, b) end

local op = A[1]
local n = tonumber(A[2])
local count = tonumber(A[3])
local now = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(A[4])
local ban = tonumber(A[5])
local maxwait = tonumber(A[6])
local L = {}
for i = 1, n do
  local c, k, iv = tonumber(A[4 + 3 * i]), tonumber(A[5 + 3 * i]), tonumber(A[6 + 3 * i])
  local units = c * iv
  L[i] = {cap = c, tok = k, iv = iv, units = units, maxd = units + math.min(units * 1000, 4503599627370496 - units)}
end
-- Quotas (quota.go): for each, its count; its period (1 day, 2 week,
-- 3 month, 4 year), which names its count in the key, so that a reload
-- that adds, drops or reorders quotas moves no count; the start of the
-- period a give-back's request was counted in (0 otherwise); and the
-- boundaries around the node's now: the start of the period before, the
-- period's start and end, and the end of the next. Redis's TIME picks the
-- period among them, so that nodes whose clocks differ agree at a
-- boundary.
local nq = tonumber(A[7 + 3 * n])
local Q = {}
for j = 1, nq do
  local y = 8 + 3 * n + 7 * (j - 1)
  local b0, b1, b2, b3 = tonumber(A[y + 3]), tonumber(A[y + 4]), tonumber(A[y + 5]), tonumber(A[y + 6])
  local q = {n = tonumber(A[y]), p = tonumber(A[y + 1]), taken = tonumber(A[y + 2]), used = 0}
  if now < b0 or now >= b3 then
    -- Redis's clock is more than a period from the node's: neither can
    -- say which period it is. Nothing is counted; the node's store
    -- failure setting (on_store_error) decides.
    return redis.error_reply('rate_limit: the Redis server\'s clock is more than a quota period from this node\'s; check both clocks')
  end
  if now < b1 then q.start, q.stop = b0, b1
  elseif now >= b2 then q.start, q.stop = b2, b3
  else q.start, q.stop = b1, b2 end
  Q[j] = q
end
local x = 8 + 3 * n + 7 * nq
if op == 'take' and maxwait == 0 and ban >= 0 then
  -- The fast path of a tier's take without max_wait (the short form's
  -- for several limits and quotas): a bucket of limits' states and this
  -- period's quota counts, no lease, no ban mark, nothing another config
  -- left. It is the take below with nothing held; any other bucket, and a
  -- refusal under a ban, goes on to it.
  -- TestRedisScriptMatchesTheSharedModel holds it to the model. Every
  -- dividend is below 2^53, so math.floor of a quotient is exact.
  local floor, F, K, QU = math.floor, {}, {}, {}
  for i = 1, n do F[i], K[i] = 0, 0 end
  for j = 1, nq do QU[j] = 0 end
  stored, got = redis.call('GET', KEYS[1]), true
  local plain, pos = true, 1
  while stored and plain do
    local e = string.find(stored, ';', pos, true)
    local seg = string.sub(stored, pos, (e or 0) - 1)
    if pos == 1 then
      if seg ~= '' then
        local a, b = string.match(seg, '^(%d+) (%d+)$')
        if a then F[1], K[1] = a + 0, b + 0 else plain = false end
      end
    elseif string.byte(seg, 1) == 113 then
      -- "q<period>:<start>:<used>:<end>" of this period of a quota named.
      local p, s, u = string.match(seg, '^q(%d+):(%d+):(%d+):%d+$')
      plain = false
      if p then
        for j = 1, nq do
          if Q[j].p == p + 0 and Q[j].start == s + 0 then QU[j], plain = u + 0, true end
        end
      end
    else
      local i, a, b = string.match(seg, '^(%d+):(%d+) (%d+)$')
      if i and i + 0 >= 2 and i + 0 <= n then F[i + 0], K[i + 0] = a + 0, b + 0 else plain = false end
    end
    if not e then break end
    pos = e + 1
  end
  if plain then
    -- Each limit's take (take_one), and its peek, on the states read.
    local R, allowed, fits = {}, true, true
    local function level(i)
      local l, gap = L[i], F[i] - now
      if gap <= 0 then return l.units, 0, false end
      local over = floor((l.units + K[i]) / l.tok)
      if gap > over + 1 then return 0, l.units, true end
      local d = gap * l.tok - K[i]
      if d > l.units then d = l.units elseif d < 0 then d = 0 end
      return l.units - d, d, gap > over
    end
    local function untl(i, need)
      local u = F[i] - now - floor((L[i].units - need + K[i]) / L[i].tok)
      if u < 1 then u = 1 end
      return u
    end
    local function peek1(i)
      local l = L[i]
      local lv, d = level(i)
      local reset = floor((d + l.tok - 1) / l.tok)
      if d == l.units then reset = math.max(reset, untl(i, l.units)) end
      return {0, floor(lv / l.iv), 0, reset}
    end
    for j = 1, nq do
      local q = Q[j]
      q.used = QU[j]
      if q.used + count > q.n then fits = false end
    end
    for i = 1, n do
      local l = L[i]
      local need, lv, d, banned = count * l.iv, level(i)
      local r
      if banned then
        r = {0, 0, untl(i, need), F[i] - now}
      elseif lv < need then
        r = {0, floor(lv / l.iv), floor((need - lv + l.tok - 1) / l.tok), floor((d + l.tok - 1) / l.tok)}
      elseif count == 0 then
        r = {1, floor(lv / l.iv), 0, floor((d + l.tok - 1) / l.tok), F[i], K[i]}
      else
        local refill = floor((d + need + l.tok - 1) / l.tok)
        r = {1, floor((lv - need) / l.iv), 0, refill, now + refill, refill * l.tok - d - need}
      end
      allowed = allowed and r[1] == 1
      R[i] = r
    end
    if not fits then
      for i = 1, n do
        local r = R[i]
        R[i] = peek1(i)
        if r[1] == 0 then R[i][3] = r[3] end
      end
    elseif allowed then
      for i = 1, n do F[i], K[i] = R[i][5], R[i][6] end
      for j = 1, nq do Q[j].used = Q[j].used + count end
    else
      for i = 1, n do
        if R[i][1] == 1 then R[i] = peek1(i) end
      end
    end
    if fits and not allowed and ban > 0 then
      -- A refusal under a ban starts one: the rest of the script does that.
      for j = 1, nq do Q[j].used = 0 end
    else
      local out = {0, 0, now}
      if fits and allowed then out[1] = 1 end
      for i = 1, n do
        local r = R[i]
        out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = r[1], r[2], r[3], r[4]
      end
      local nxt = 0
      for j = 1, nq do
        local q = Q[j]
        local left, a, rem, retry = math.max(0, q.n - q.used), 1, 0, 0
        if out[1] == 1 then
          rem = left
        elseif fits then
          a, rem = 0, left
        elseif QU[j] + count > q.n then
          a, rem, retry = 0, left, q.stop - now
        else
          a, rem = 0, left
        end
        out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = a, rem, retry, q.stop - now
        if out[1] == 1 and q.used + count > q.n then nxt = math.max(nxt, q.stop - now) end
      end
      -- The bucket as save writes it, and how long until every limit
      -- holds the cost again (shared.go's Next).
      local segs, last = {}, now
      for i = 1, n do
        local st = ''
        if F[i] > now then
          st = string.format('%d %d', F[i], K[i])
          if i > 1 then st = i .. ':' .. st end
          last = math.max(last, F[i])
        end
        if i == 1 or st ~= '' then segs[#segs + 1] = st end
        if out[1] == 1 then
          local lv, _, banned = level(i)
          if banned or lv < count * L[i].iv then nxt = math.max(nxt, untl(i, count * L[i].iv)) end
        end
      end
      for j = 1, nq do
        local q = Q[j]
        if q.used > 0 then
          segs[#segs + 1] = string.format('q%d:%d:%d:%d', q.p, q.start, q.used, q.stop)
          last = math.max(last, q.stop)
        end
      end
      out[#out + 1] = nxt
      if last <= now then
        if stored then redis.call('DEL', KEYS[1]) end
      else
        local v = table.concat(segs, ';')
        if v ~= stored then
          local w = redis.pcall('SET', KEYS[1], v, 'PX', floor((last - now + 999) / 1000) + 1)
          if w.err then
            error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. w.err)
          end
        end
      end
      return out
    end
  end
end

local function bad()
  return redis.error_reply('rate_limit: key ' .. KEYS[1] .. ' does not hold a bucket')
end

-- Read the bucket: S[i] is limit i's state, H the leases. Limits past the
-- n of this call (a reload dropped them, or a call names fewer) keep their
-- segments, in extra, and the key lives as long as they need: later is the
-- latest moment one of them is full.
local S, H, extra, qextra, later = {}, {}, {}, {}, 0
for i = 1, n do S[i] = {full = 0, slack = 0, banned = false} end
if not got then stored = redis.call('GET', KEYS[1]) end
if stored then
  local first = true
  for seg in string.gmatch(stored .. ';', '([^;]*);') do
    local i, body = 1, seg
    if not first then
      local node, a, e, sq, vd, qrest = string.match(seg, '^l:([^:]+):(%d+):(%d+):(%d+):([01])(.*)$')
      local qi, qs, qu, qe = string.match(seg, '^q(%d+):(%d+):(%d+):?(%d*)$')
      if node then
        -- A lease that quotas counted ends with ":<qstop>:<mask>".
        local qstop, mask = 0, 0
        if qrest ~= '' then
          local a2, m2 = string.match(qrest, '^:(%d+):(%d+)$')
          if not a2 then return bad() end
          qstop, mask = tonumber(a2), tonumber(m2)
        end
        H[#H + 1] = {node = node, tokens = tonumber(a), expires = tonumber(e), seq = tonumber(sq), void = vd == '1', qstop = qstop, mask = mask}
        i = nil
      elseif qi then
        -- A quota's count, of the period that starts at qs and ends at qe
        -- (versions before it did not write the end); one of an earlier
        -- period goes. The count of a quota this call does not name (a
        -- call made under a config before a reload added it, or after one
        -- dropped it) stays until its period ends: no call but the
        -- quota's own may lose it. One that says no end, which a version
        -- before this one wrote, ends when the key would have (the old
        -- version kept the key until the period's end), or a period's
        -- longest after its start, whichever is first.
        -- A count of the same period kind but another start is an
        -- earlier period's, which goes, unless its period still runs: one
        -- counted in another time zone, before a reload changed it, which
        -- a call of the old config or the new may not erase.
        local named = false
        for _, q in ipairs(Q) do
          if q.p == tonumber(qi) then
            if q.start == tonumber(qs) then
              named, q.used = true, tonumber(qu)
            elseif qe == '' or tonumber(qe) <= now then
              named = true
            end
          end
        end
        if not named and qe == '' then
          -- At most a period's longest after its start: a day of 25 hours,
          -- a week, a month of 31 days, a year of 366, and an hour more.
          local longest = ({90000, 608400, 2682000, 31626000})[tonumber(qi)]
          local pttl = redis.call('PTTL', KEYS[1])
          if longest and pttl > 0 then
            qe = string.format('%d', math.min(now + pttl * 1000, tonumber(qs) + longest * 1000000))
            seg = string.format('q%s:%s:%s:%s', qi, qs, qu, qe)
          end
        end
        if not named and qe ~= '' and tonumber(qe) > now then
          qextra[#qextra + 1] = seg
          later = math.max(later, tonumber(qe))
        end
        i = nil
      else
        local at, rest = string.match(seg, '^(%d+):(.*)$')
        if not at then return bad() end
        i, body = tonumber(at), rest
      end
    end
    first = false
    if i and body ~= '' then
      local a, b, mark = string.match(body, '^(%d+) (%d+)( ?b?)$')
      if not a then return bad() end
      if S[i] then
        S[i] = {full = tonumber(a), slack = tonumber(b), banned = mark == ' b'}
      else
        extra[#extra + 1] = seg
        later = math.max(later, tonumber(a))
      end
    end
  end
end

local function deficit(i, at)
  local s, l = S[i], L[i]
  if at >= s.full then return 0 end
  local gap = s.full - at
  if gap > idiv(l.units + s.slack, l.tok) + 1 then return l.units end
  local d = gap * l.tok - s.slack
  if d > l.units then return l.units end
  if d < 0 then return 0 end
  return d
end
local function raw_deficit(i, at)
  local s, l = S[i], L[i]
  local gap = s.full - (at or now)
  if gap <= 0 then return 0 end
  if gap > idiv(l.maxd + s.slack, l.tok) + 1 then return l.maxd end
  return math.min(math.max(0, gap * l.tok - s.slack), l.maxd)
end
local function banned(i)
  local s, l = S[i], L[i]
  local gap = s.full - now
  return gap > 0 and gap > idiv(l.units + s.slack, l.tok)
end
local function until_level(i, need)
  local s, l = S[i], L[i]
  return math.max(1, s.full - now - idiv(l.units - need + s.slack, l.tok))
end
-- retry_banned: bucket.go's retryBanned.
local function retry_banned(i, need)
  local u = until_level(i, need)
  if maxwait > 0 then u = math.max(until_level(i, 0), u - maxwait) end
  return u
end
local function wait(i, need)
  if not banned(i) and L[i].units - deficit(i, now) >= need then return 0 end
  return until_level(i, need)
end
local function state_at(at, d, l)
  local refill = ceildiv(d, l.tok)
  return {full = at + refill, slack = refill * l.tok - d, banned = false}
end
local function out()
  local o = 0
  for _, h in ipairs(H) do o = o + h.tokens end
  return o
end
local function floor(i) return math.min(out(), L[i].cap) * L[i].iv end

-- settle: leases that expired count as spent, and each level refills up
-- to its capacity less the tokens then out, across the expiries in order.
local function cap_at(at)
  if out() == 0 then return end
  for i = 1, n do
    local f = floor(i)
    if deficit(i, at) < f then
      local b = S[i].banned and S[i].full > at
      S[i] = state_at(at, f, L[i])
      S[i].banned = b
    end
  end
end
local function settle_to(at)
  while true do
    local j = nil
    for k, h in ipairs(H) do
      if h.expires <= at and (j == nil or h.expires < H[j].expires) then j = k end
    end
    if j == nil then break end
    cap_at(H[j].expires)
    table.remove(H, j)
  end
  cap_at(at)
end
-- bucket.go's read: the limit of a plan of quotas alone (a ban of -1)
-- is full a microsecond after any state, so that one another limit wrote
-- before a reload, or a charge's debt, never empties it.
if ban < 0 then
  ban = 0
  if S[1].full - now > 1 then S[1] = {full = 0, slack = 0, banned = false} end
end
settle_to(now)

-- life is how long the bucket must be kept: until every lease has expired
-- and every limit is full again, refilling from the cap each expiry
-- leaves (shared.go's Life).
local function life()
  local s0, h0, last = S, H, now
  if #H == 0 then
    for i = 1, n do last = math.max(last, S[i].full) end
    return last - now
  end
  S, H = {}, {}
  for i = 1, n do S[i] = {full = s0[i].full, slack = s0[i].slack, banned = s0[i].banned} end
  for k, h in ipairs(h0) do
    H[k] = {node = h.node, tokens = h.tokens, expires = h.expires, seq = h.seq, void = h.void, qstop = h.qstop, mask = h.mask}
    last = math.max(last, h.expires)
  end
  settle_to(last)
  for i = 1, n do last = math.max(last, S[i].full) end
  S, H = s0, h0
  return last - now
end

-- floor_at, settled and wait_settled: buckettest's floorAt,
-- settledDeficit and waitSettled (held.go), on the leases H.
local function floor_at(i, t, at_too)
  local o = 0
  for _, h in ipairs(H) do
    if h.expires > t or (at_too and h.expires == t) then o = o + h.tokens end
  end
  return math.min(o, L[i].cap) * L[i].iv
end
local function settled(i, t)
  local d = math.max(raw_deficit(i, t), floor_at(i, t, false))
  for _, h in ipairs(H) do
    if h.expires > now and h.expires <= t then
      d = math.max(d, floor_at(i, h.expires, true) - (t - h.expires) * L[i].tok)
    end
  end
  return d
end
local function wait_settled(i, need, w)
  local l = L[i]
  for _ = 1, 2 * #H + 2 do
    local t = now + w
    local d = settled(i, t)
    local lack = d + need - l.units
    if lack <= 0 then return w end
    local nxt = nil
    if d == floor_at(i, t, false) then
      for _, h in ipairs(H) do
        if h.expires > t and (nxt == nil or h.expires < nxt) then nxt = h.expires end
      end
    end
    if nxt then w = nxt - now else w = w + ceildiv(lack, l.tok) end
  end
  return w
end

-- take_waiting is take_one with max_wait, for a limit no ban holds: the
-- level may go below zero by max_wait's refill, and retry says the wait.
-- With leases out, it reckons with the cap they keep the level under.
local function take_waiting(i, cost)
  local l = L[i]
  local raw = raw_deficit(i)
  local need = cost * l.iv
  local w = 0
  local lack = raw + need - l.units
  if lack > 0 then w = ceildiv(lack, l.tok) end
  if #H > 0 then w = wait_settled(i, need, w) end
  if w > maxwait then
    return {ok = false, rem = idiv(math.max(0, l.units - raw), l.iv), retry = w - maxwait, reset = ceildiv(raw, l.tok)}
  end
  if cost == 0 then
    return {ok = true, rem = idiv(math.max(0, l.units - raw), l.iv), retry = w, reset = ceildiv(raw, l.tok), state = S[i]}
  end
  local st = state_at(now, raw + need, l)
  if #H > 0 then st = state_at(now + w, settled(i, now + w) + need, l) end
  return {ok = true, rem = idiv(math.max(0, l.units - raw - need), l.iv), retry = w, reset = st.full - now, state = st}
end
local function take_one(i, cost, nowait)
  local l = L[i]
  local need = cost * l.iv
  if maxwait > 0 and not nowait and not (S[i].banned and banned(i)) then return take_waiting(i, cost) end
  if banned(i) then
    return {ok = false, rem = 0, retry = retry_banned(i, need), reset = S[i].full - now}
  end
  local d = deficit(i, now)
  local level = l.units - d
  if level < need then
    return {ok = false, rem = idiv(level, l.iv), retry = ceildiv(need - level, l.tok), reset = ceildiv(d, l.tok)}
  end
  if cost == 0 then
    return {ok = true, rem = idiv(level, l.iv), retry = 0, reset = ceildiv(d, l.tok), state = S[i]}
  end
  local st = state_at(now, d + need, l)
  return {ok = true, rem = idiv(level - need, l.iv), retry = 0, reset = st.full - now, state = st}
end
local function peek(i)
  local l = L[i]
  local d = deficit(i, now)
  local level = l.units - d
  local ok = level >= l.iv
  local reset = ceildiv(d, l.tok)
  if d == l.units then reset = math.max(reset, until_level(i, l.units)) end
  return {ok = ok, rem = idiv(level, l.iv), retry = 0, reset = reset}
end
-- ban_one empties limit i for the ban from now, unless a ban holds it;
-- it answers as a denial and says whether it started one.
local function ban_one(i, need)
  local l = L[i]
  local started = not banned(i) or (maxwait > 0 and not S[i].banned)
  if started then
    local refill = ceildiv(l.units, l.tok)
    local b = {full = now + ban + refill, slack = refill * l.tok - l.units, banned = true}
    if S[i].full > b.full then b = {full = S[i].full, slack = S[i].slack, banned = true} end
    S[i] = b
  end
  return {ok = false, rem = 0, retry = retry_banned(i, need), reset = S[i].full - now, started = started}
end
-- short: some limit lacks cost tokens even with the tokens out on lease,
-- so one bucket would refuse too; only then does a denial ban.
local function short(cost)
  local o = out()
  for i = 1, n do
    local l = L[i]
    local extra = math.min(o, l.cap) * l.iv
    if maxwait > 0 then
      if (S[i].banned and banned(i)) or raw_deficit(i) + cost * l.iv - l.units - extra > maxwait * l.tok then return true end
    elseif banned(i) or l.units - deficit(i, now) + extra < cost * l.iv then
      return true
    end
  end
  return false
end
local function void_all()
  for _, h in ipairs(H) do h.void = true end
end
local function any_banned()
  for i = 1, n do if S[i].banned and S[i].full > now then return true end end
  return false
end
local function give_back(i, k, f)
  local l = L[i]
  if k <= 0 or (S[i].banned and S[i].full > now) then return end
  local raw = raw_deficit(i)
  local d = math.max(raw - math.min(k, l.cap) * l.iv, math.min(f, raw))
  if d <= 0 then S[i] = {full = 0, slack = 0, banned = false} else S[i] = state_at(now, d, l) end
end
local function find(node)
  for k, h in ipairs(H) do if h.node == node then return k end end
  return nil
end

-- save writes the bucket when it changed: limit 1's state first (as
-- versions before several limits kept it), then the other limits' as
-- "<i>:<state>", then the leases as "l:<node>:<tokens>:<expires>:<seq>:<void>",
-- separated by ";". A limit that is full has no state; a bucket that is
-- full with nothing on lease has no key.
local function state_text(st)
  if st.full <= now then return '' end
  local v = string.format('%d %d', st.full, st.slack)
  if st.banned then v = v .. ' b' end
  return v
end
local function save()
  if n == 1 and #H == 0 and #extra == 0 and nq == 0 and #qextra == 0 then
    -- The common bucket: one limit, no lease.
    if S[1].full <= now then
      if stored then redis.call('DEL', KEYS[1]) end
      return
    end
    local v = state_text(S[1])
    if v ~= stored then
      local ok = redis.pcall('SET', KEYS[1], v, 'PX', ceildiv(math.max(later, S[1].full) - now, 1000) + 1)
      if type(ok) == 'table' and ok.err then
        error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. ok.err)
      end
    end
    return
  end
  local segs, any = {state_text(S[1])}, S[1].full > now
  for i = 2, n do
    if S[i].full > now then
      segs[#segs + 1] = i .. ':' .. state_text(S[i])
      any = true
    end
  end
  for _, seg in ipairs(extra) do
    segs[#segs + 1] = seg
    any = true
  end
  for _, h in ipairs(H) do
    local vd = 0
    if h.void then vd = 1 end
    local seg = string.format('l:%s:%d:%d:%d:%d', h.node, h.tokens, h.expires, h.seq, vd)
    if h.qstop > 0 then seg = seg .. string.format(':%d:%d', h.qstop, h.mask) end
    segs[#segs + 1] = seg
    any = true
  end
  -- A quota's count lives until its period ends, no longer.
  local qlater = 0
  for j, q in ipairs(Q) do
    if q.used > 0 then
      segs[#segs + 1] = string.format('q%d:%d:%d:%d', q.p, q.start, q.used, q.stop)
      qlater = math.max(qlater, q.stop)
      any = true
    end
  end
  for _, seg in ipairs(qextra) do
    segs[#segs + 1] = seg
    any = true
  end
  if not any then
    if stored then redis.call('DEL', KEYS[1]) end
    return
  end
  local v = table.concat(segs, ';')
  if v == stored then return end
  local ttl = math.max(0, later - now, qlater - now, life())
  local ok = redis.pcall('SET', KEYS[1], v, 'PX', ceildiv(ttl, 1000) + 1)
  if type(ok) == 'table' and ok.err then
    error('rate_limit: Redis refused to write the bucket (it needs Redis 3.2 or newer): ' .. ok.err)
  end
end

`

// ScriptHash is the SHA1 of the bucket script, by which SCRIPT EXISTS
// tells whether Redis has it loaded.
func ScriptHash() string { return bucketScript.Hash() }

// bucketScript runs bucketLua by EVALSHA, and by EVAL when Redis answers
// NOSCRIPT (a restart, a failover, SCRIPT FLUSH), which loads it again.
var bucketScript = redis.NewScript(bucketLua)
