package redisbucket

// bucketLuaOps is the last part of the bucket script (script.go): the
// operations, each of which answers and ends the script: peek, take,
// lease, return, giveback and charge.
const bucketLuaOps = `
-- quota_take and quota_peek: quota.go's TakeQuota and PeekQuota (as a
-- refusal reports it).
local function quota_take(q, cost)
  local left = math.max(0, q.n - q.used)
  if q.used + cost > q.n then return {ok = false, rem = left, retry = q.stop - now, reset = q.stop - now} end
  return {ok = true, rem = left - cost, retry = 0, reset = q.stop - now}
end
local function quota_peek(q) return {ok = false, rem = math.max(0, q.n - q.used), retry = 0, reset = q.stop - now} end

-- refund_held: shared_quota.go's refundHeld. k tokens of the lease h that
-- its node never spent go back to each quota that counted them, ban or
-- not, while the period that did lasts (the one that holds h.qstop - 1).
local function refund_held(h, k)
  if k <= 0 or h.qstop == 0 then return end
  for _, q in ipairs(Q) do
    if math.floor(h.mask / 2 ^ q.p) % 2 == 1 and h.qstop > q.start and h.qstop <= q.stop then
      q.used = math.max(0, q.used - k)
    end
  end
end

-- wait_all: the microseconds until every limit holds k tokens, 0 when
-- they do.
local function wait_all(k)
  local w = 0
  for i = 1, n do w = math.max(w, wait(i, k * L[i].iv)) end
  return w
end
-- retry_waiting: on a tier with max_wait that a ban holds, when a
-- request of k may come back: when every limit lets it go on within
-- max_wait (shared.go's retryWaiting), not when each holds k. The
-- leases out cap the level meanwhile, save skip's, which its node drops.
local function retry_waiting(k, skip)
  local all = H
  if skip then
    H = {}
    for _, h in ipairs(all) do if h.node ~= skip then H[#H + 1] = h end end
  end
  local w = 0
  for i = 1, n do
    local r = take_one(i, k, false)
    if not r.ok then w = math.max(w, r.retry) end
  end
  H = all
  return w
end
-- quota_wait: the microseconds until every quota has k tokens left, 0
-- when they do.
-- Tokens out on lease that a quota counted come back to it by the time
-- their records expire, or count as spent then (shared_quota.go's outIn).
local function quota_wait(k, skip)
  local w = 0
  for _, q in ipairs(Q) do
    if q.used + k > q.n then
      local wq, o, last = q.stop - now, 0, 0
      for _, h in ipairs(H) do
        if h.tokens > 0 and h.node ~= skip and math.floor(h.mask / 2 ^ q.p) % 2 == 1 and h.qstop > q.start and h.qstop <= q.stop then
          o, last = o + h.tokens, math.max(last, h.expires)
        end
      end
      if o > 0 and math.max(0, q.n - q.used) + o >= k then wq = math.min(wq, math.max(1, last - now)) end
      w = math.max(w, wq)
    end
  end
  return w
end
-- answer is a take's or a peek's: allowed, banned, now, each limit's and
-- each quota's result, then, when allowed, how long until every limit and
-- quota holds the cost again (shared.go's Next), for the node's deny
-- cache; 0 otherwise.
local function answer(allowed, started, res, qres)
  local r = {0, 0, now}
  if allowed then r[1] = 1 end
  if started then r[2] = 1 end
  local function put(x)
    local a = 0
    if x.ok then a = 1 end
    r[#r + 1], r[#r + 2], r[#r + 3], r[#r + 4] = a, x.rem, x.retry, x.reset
  end
  for i = 1, n do put(res[i]) end
  for j = 1, nq do put(qres[j]) end
  local nxt = 0
  if allowed and op == 'take' then nxt = math.max(wait_all(count), quota_wait(count)) end
  r[#r + 1] = nxt
  return r
end

if op == 'peek' then
  local res, allowed, qres = {}, true, {}
  for i = 1, n do res[i] = peek(i); allowed = allowed and res[i].ok end
  for j, q in ipairs(Q) do qres[j] = quota_peek(q); qres[j].ok = q.used < q.n end
  return answer(allowed, false, res, qres)
end

if op == 'take' then
  local res, allowed, started = {}, true, false
  -- The quotas first: one that lacks the cost refuses the request, which
  -- takes nothing and starts no ban.
  local qres, fits = {}, true
  for j, q in ipairs(Q) do
    qres[j] = quota_take(q, count)
    fits = fits and qres[j].ok
  end
  if not fits then
    -- Nothing taken; a limit that would refuse too says when it would
    -- not, so that Retry-After covers every refusal.
    for i = 1, n do
      local r = take_one(i, count)
      res[i] = peek(i)
      if not r.ok then res[i].retry = r.retry end
      res[i].ok = false
    end
    for j, q in ipairs(Q) do
      if qres[j].ok then qres[j] = quota_peek(q) end
    end
    save()
    return answer(false, false, res, qres)
  end
  for i = 1, n do
    res[i] = take_one(i, count)
    allowed = allowed and res[i].ok
  end
  if not allowed then
    -- A limit refused: the quotas keep their counts.
    for j, q in ipairs(Q) do qres[j] = quota_peek(q) end
  end
  if allowed then
    -- goTogether (held.go's): a request that waits takes from every limit
    -- when the slowest lets it go on.
    local w = 0
    if maxwait > 0 then
      for i = 1, n do w = math.max(w, res[i].retry) end
    end
    for i = 1, n do
      if res[i].retry < w then
        local d, need = settled(i, now + w), count * L[i].iv
        if count == 0 then
          res[i].rem = idiv(math.max(0, L[i].units - d), L[i].iv)
          res[i].retry = w
          S[i] = res[i].state
        else
          S[i] = state_at(now + w, d + need, L[i])
          res[i] = {ok = true, rem = idiv(math.max(0, L[i].units - d - need), L[i].iv), retry = w, reset = S[i].full - now, state = S[i]}
        end
      else
        S[i] = res[i].state
      end
    end
    for _, q in ipairs(Q) do q.used = q.used + count end
  elseif ban > 0 and short(count) then
    for i = 1, n do
      res[i] = ban_one(i, count * L[i].iv)
      started = started or res[i].started
    end
    if started then void_all() end
  else
    for i = 1, n do
      if res[i].ok then res[i] = peek(i); res[i].ok = false end
    end
  end
  save()
  return answer(allowed, started, res, qres)
end

-- report: the least level, of limits and quotas, and the latest reset of
-- a limit, for a lease's answer.
local function report()
  local rem, reset = nil, 0
  for i = 1, n do
    local r = peek(i)
    if rem == nil or r.rem < rem then rem = r.rem end
    reset = math.max(reset, r.reset)
  end
  for _, q in ipairs(Q) do rem = math.min(rem, math.max(0, q.n - q.used)) end
  return rem, reset
end
-- each_level appends to the answer r each limit's level and reset, then
-- each quota's (shared.go's ReportEach).
local function each_level(r)
  for i = 1, n do
    local x = peek(i)
    r[#r + 1], r[#r + 2] = x.rem, x.reset
  end
  for _, q in ipairs(Q) do
    r[#r + 1], r[#r + 2] = math.max(0, q.n - q.used), q.stop - now
  end
  return r
end

if op == 'lease' then
  local node, seq, held, want, hold = A[x], tonumber(A[x + 1]), tonumber(A[x + 2]), tonumber(A[x + 3]), tonumber(A[x + 4])
  local spend = tonumber(A[x + 5])
  local prefetch = A[x + 6] == '1'
  local drop, started = false, false
  -- Quotas count leased tokens when granted; the node may spend them
  -- until the earliest of the quotas' periods ends (qstop), and a record
  -- of a period that has ended is dropped.
  local qstop, mask, spend_for = 0, 0, 0
  for j, q in ipairs(Q) do
    if j == 1 or q.stop < qstop then qstop = q.stop end
    mask = mask + 2 ^ q.p
  end
  if nq > 0 then spend_for = qstop - now end
  local mine, void = find(node), false
  if mine then
    H[mine].tokens = math.min(H[mine].tokens, math.max(held, 0))
    if H[mine].mask > 0 and H[mine].qstop <= now then
      refund_held(H[mine], H[mine].tokens)
      drop = true
      H[mine].tokens = 0
    elseif H[mine].void then
      -- The node drops what a ban voided, and gives back what it did not
      -- spend, so that the quotas count only what was admitted.
      drop, void = true, H[mine].tokens > 0
    end
  end
  -- ban_holds: a ban holds some limit empty (shared.go's banHolds).
  local function ban_holds()
    for i = 1, n do if S[i].banned and banned(i) then return 1 end end
    return 0
  end
  local function flags()
    local b, d, v = 0, 0, 0
    if started then b = 1 end
    if drop then d = 1 end
    if void then v = 1 end
    return b, d, v
  end
  local qwait = quota_wait(count, node)
  local allowed = qwait == 0
  for i = 1, n do allowed = take_one(i, count, true).ok and allowed end
  if not allowed then
    local w = want
    if qwait == 0 and ban > 0 and not prefetch and short(count) then
      for i = 1, n do
        if ban_one(i, count * L[i].iv).started then started = true end
      end
      if started then void_all() end
      drop, w = true, count
      void = mine ~= nil and H[mine].tokens > 0
    end
    if mine and H[mine].tokens == 0 then
      table.remove(H, mine)
    elseif mine then
      H[mine].seq = seq -- the node's next give-back names this call
    end
    local lwait = wait_all(count)
    if maxwait > 0 and ban_holds() == 1 then
      local skip = nil
      if drop then skip = node end
      lwait = retry_waiting(count, skip)
    end
    local retry = math.max(lwait, qwait)
    local hold_off = math.max(lwait, wait_all(w))
    local rem, reset = report()
    save()
    local b, d, v = flags()
    return each_level({0, rem, retry, hold_off, reset, b, d, now, spend_for, qwait, v, ban_holds(), lwait})
  end
  if void then
    -- The node gives back what the ban left it first: its record names
    -- this call, and nothing is granted beside it.
    H[mine].seq = seq
    local rem, reset = report()
    save()
    local b, d, v = flags()
    return each_level({0, rem, 0, 0, reset, b, d, now, spend_for, 0, v, ban_holds(), 0})
  end
  local mincap = L[1].cap
  for i = 2, n do mincap = math.min(mincap, L[i].cap) end
  local grant = math.min(want, idiv(mincap, 2) - out())
  for i = 1, n do grant = math.min(grant, idiv(L[i].units - deficit(i, now), L[i].iv)) end
  -- Half of what a quota has left at most (shared.go).
  for _, q in ipairs(Q) do grant = math.min(grant, math.max(count, idiv(q.n - q.used, 2))) end
  grant = math.max(grant, count)
  for i = 1, n do S[i] = state_at(now, deficit(i, now) + grant * L[i].iv, L[i]) end
  for _, q in ipairs(Q) do q.used = q.used + grant end
  if not mine then
    H[#H + 1] = {node = node, tokens = 0}
    mine = #H
  end
  local h = H[mine]
  h.tokens, h.expires, h.seq, h.void = h.tokens + grant - math.min(spend, grant), now + hold, seq, false
  h.qstop, h.mask = qstop, mask
  if h.tokens == 0 then table.remove(H, mine) end
  local hold_off = 0
  if grant < want and wait_all(count) > 0 then hold_off = wait_all(want) end
  -- A quota the grant used up refuses the next request until its period
  -- ends, as a limit's refill does.
  local qhold, lretry = quota_wait(count, node), wait_all(count)
  local retry = math.max(lretry, qhold)
  local rem, reset = report()
  save()
  local b, d, v = flags()
  return each_level({grant, rem, retry, hold_off, reset, b, d, now, spend_for, qhold, v, ban_holds(), lretry})
end

if op == 'return' then
  local node, seq = A[x], tonumber(A[x + 1])
  local j = find(node)
  local back = 0
  if j and H[j].seq == seq then
    local h = table.remove(H, j)
    back = math.min(count, h.tokens)
    refund_held(h, back)
    if h.void or back <= 0 or any_banned() then
      back = 0
    else
      for i = 1, n do give_back(i, back, floor(i)) end
    end
  end
  save()
  return {back, now}
end

if op == 'giveback' then
  -- The limits take back A[x] tokens when it is given: fewer than the
  -- quotas after a reload that changed them.
  local back = tonumber(A[x]) or count
  if not any_banned() then
    for i = 1, n do give_back(i, back, floor(i)) end
  end
  -- A quota counts what was admitted: a give-back returns to it, ban or
  -- not, while the period the request was counted in (the node sent its
  -- boundaries) lasts.
  for _, q in ipairs(Q) do
    if q.start == q.taken then q.used = math.max(0, q.used - count) end
  end
  save()
  return {count, now}
end

if op == 'charge' then
  for i = 1, n do
    local l = L[i]
    local k = math.min(count, idiv(l.maxd, l.iv))
    local raw = math.min(raw_deficit(i) + k * l.iv, l.maxd)
    if raw <= 0 then
      S[i] = {full = 0, slack = 0, banned = false}
    else
      -- Never sooner full: a ban may outlast the deepest debt.
      local b = S[i].banned and S[i].full > now
      local nxt = state_at(now, raw, l)
      nxt.banned = b
      if nxt.full >= S[i].full then S[i] = nxt end
    end
  end
  -- Never lower: a reload may have set n below what was used.
  for _, q in ipairs(Q) do q.used = math.max(q.used, math.min(q.n, q.used + math.max(0, count))) end
  -- How long until every limit is out of debt (shared.go's Charge); the
  -- limit of a plan of quotas alone (a ban of -1) is never in debt.
  local debt = 0
  for i = 1, n do
    if i > 1 or tonumber(A[5]) >= 0 then
      debt = math.max(debt, S[i].full - now - idiv(L[i].units + S[i].slack, L[i].tok))
    end
  end
  save()
  return {count, now, debt}
end

return redis.error_reply('rate_limit: unknown operation ' .. tostring(op))
`
