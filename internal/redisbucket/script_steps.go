package redisbucket

// bucketLuaSteps is the third part of the bucket script (script.go): the
// steps of package bucket and of buckettest's shared.go and held.go on the
// states bucketLuaState read (refill, settle the leases, take, wait, ban),
// and the write back (save), which the operations (script_ops.go) use.
const bucketLuaSteps = `local function deficit(i, at)
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
-- ban_retry: held.go's banRetry. Under a ban with max_wait, a request of
-- need goes on within max_wait once the ban is over on the level as the
-- leases out cap it, which retry_banned reckons without.
local function ban_retry(i, need)
  local u = retry_banned(i, need)
  if maxwait > 0 and #H > 0 and S[i].banned and banned(i) then
    u = math.max(u, wait_settled(i, need, until_level(i, need)) - maxwait)
  end
  return u
end
local function take_one(i, cost, nowait)
  local l = L[i]
  local need = cost * l.iv
  if maxwait > 0 and not nowait and not (S[i].banned and banned(i)) then return take_waiting(i, cost) end
  if banned(i) then
    local retry = retry_banned(i, need)
    if not nowait then retry = ban_retry(i, need) end
    return {ok = false, rem = 0, retry = retry, reset = S[i].full - now}
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
  return {ok = false, rem = 0, retry = ban_retry(i, need), reset = S[i].full - now, started = started}
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
