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
const bucketLua = bucketLuaShort + bucketLuaState + bucketLuaSteps + bucketLuaOps

// bucketLuaState is the long form's start, after the short forms
// (script_short.go): its arguments, and the bucket's text read into
// limits' states, leases and quota counts; the steps on them follow
// (script_steps.go), then the operations (script_ops.go).
const bucketLuaState = `local function idiv(a, b)
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

`

// ScriptHash is the SHA1 of the bucket script, by which SCRIPT EXISTS
// tells whether Redis has it loaded.
func ScriptHash() string { return bucketScript.Hash() }

// bucketScript runs bucketLua by EVALSHA, and by EVAL when Redis answers
// NOSCRIPT (a restart, a failover, SCRIPT FLUSH), which loads it again.
var bucketScript = redis.NewScript(bucketLua)
