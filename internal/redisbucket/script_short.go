package redisbucket

// bucketLuaShort is the first part of the bucket script (script.go): the
// short forms, which answer the commonest calls before any of the long
// form's helpers is built: a take on one limit without quotas or max_wait
// (takeArgs), and a lease and its give-back on such a limit (leaseArgs,
// returnArgs). Any other call goes on to bucketLuaState.
const bucketLuaShort = `
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
`
