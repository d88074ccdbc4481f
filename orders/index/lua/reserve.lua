-- reserve: take an order's units of each resource of one hash slot, all or none, atomically.
--
-- KEYS     for each resource, in the caller's order: its hash (cap, sold, held, and
--          'o:' .. order id -> units for each member), its holds set (member = order id,
--          score = expiry in integer ms) and its units hash (a named unit -> the order id
--          holding it, or '!' .. the order id that bought it); all in one hash slot (the
--          resource id is the tag)
-- ARGV[1]  order id
-- ARGV[2]  its expiry, integer ms since the epoch (after ARGV[3])
-- ARGV[3]  now, integer ms since the epoch (the caller's clock, never the server's)
-- ARGV[3 + i]  the units asked of the i-th resource: a number, or the number followed by
--          the names asked for, each after a newline (a name has no control character)
--
-- Returns {code, position, free, unknown...}: code 1 when every known resource has the
-- order as a member (added now, or already: a retry is not counted twice; position and
-- free are 0), or -1 when the resource at `position` (1-based, the first in the caller's
-- order) has only `free` units for more asked: then nothing is written anywhere. The
-- positions after the third element are the unknown resources: no hash, or a hash and a set
-- that disagree (one key lost: HLEN - 3 fields against ZCARD members); nothing is written
-- for them, and the caller lets SQL decide. Code -2: a unit asked for by name at
-- `position` is bought, or held by a live member other than this order; the third element
-- is how many, the names follow; nothing is written. A holder that is no longer a live
-- member (expired, released, or its keys rebuilt) holds nothing: the index never refuses
-- on a stale name, and SQL has the last word on every unit.
--
-- A member whose expiry is at or before now no longer counts. It is dropped (its units
-- leave `held`) only when the script also writes, and after its first write: on a server at
-- maxmemory (noeviction) Redis refuses a script's first write when it is a command that may
-- grow memory and lets every later one pass, so that first write is the ZADD of the order,
-- and a full server refuses the reserve before anything is written.
local order_id = ARGV[1]
local field = 'o:' .. order_id
local now = tonumber(ARGV[3])
local count = #KEYS / 3

-- The units of the members listed, a thousand at a time (unpack has a stack limit).
local function units_of(res, members)
  local total = 0
  for from = 1, #members, 1000 do
    local fields = {}
    for j = from, math.min(from + 999, #members) do
      fields[#fields + 1] = 'o:' .. members[j]
    end
    local units = redis.call('HMGET', res, unpack(fields))
    for j = 1, #units do
      total = total + (tonumber(units[j]) or 0)
    end
  end
  return total
end

-- The names of ARGV[3 + i] held or bought by another order (none for a plain number).
local function taken_of(units_key, holds, spec)
  local taken = {}
  for name in string.gmatch(spec, '\n([^\n]+)') do
    local holder = redis.call('HGET', units_key, name)
    if holder and holder ~= order_id then
      if string.sub(holder, 1, 1) == '!' or (tonumber(redis.call('ZSCORE', holds, holder)) or 0) > now then
        taken[#taken + 1] = name
      end
    end
  end
  return taken
end

local unknown = {}
local plans = {}
local refused, refused_free = 0, 0
for i = 1, count do
  local res = KEYS[3 * i - 2]
  local holds = KEYS[3 * i - 1]
  local units_key = KEYS[3 * i]
  local state = redis.call('HMGET', res, 'cap', 'sold', 'held', field)
  local cap = tonumber(state[1])
  if not cap or redis.call('HLEN', res) - 3 ~= redis.call('ZCARD', holds) then
    unknown[#unknown + 1] = i
  else
    local score = tonumber(redis.call('ZSCORE', holds, order_id))
    if not (state[4] and score and score > now) then
      -- Not a live member: asked afresh (an expired member of this very order included:
      -- its old units are among the expired ones below).
      local expired = redis.call('ZRANGEBYSCORE', holds, '-inf', ARGV[3])
      local gone = units_of(res, expired)
      local free = cap - (tonumber(state[2]) or 0) - (tonumber(state[3]) or 0) + gone
      local asked = tonumber(string.match(ARGV[3 + i], '^%d+'))
      if refused == 0 then
        local taken = taken_of(units_key, holds, ARGV[3 + i])
        if #taken > 0 then
          return {-2, i, #taken, unpack(taken)}
        end
        if free < asked then
          refused, refused_free = i, free
        end
      end
      plans[#plans + 1] = {res, holds, asked, expired, gone}
    end
  end
end

if refused > 0 then
  return {-1, refused, refused_free, unpack(unknown)}
end

for _, plan in ipairs(plans) do
  local res, holds, units, expired, gone = plan[1], plan[2], plan[3], plan[4], plan[5]
  redis.call('ZADD', holds, ARGV[2], order_id)
  -- The order's own expired member, if any, was re-scored by the ZADD: it stays, and only
  -- its old units go (in `gone`), replaced by the new.
  if #expired > 0 then
    redis.call('ZREMRANGEBYSCORE', holds, '-inf', ARGV[3])
    for from = 1, #expired, 1000 do
      local fields = {}
      for j = from, math.min(from + 999, #expired) do
        if expired[j] ~= order_id then
          fields[#fields + 1] = 'o:' .. expired[j]
        end
      end
      if #fields > 0 then
        redis.call('HDEL', res, unpack(fields))
      end
    end
  end
  redis.call('HSET', res, field, units)
  redis.call('HINCRBY', res, 'held', tonumber(units) - gone)
end
return {1, 0, 0, unpack(unknown)}
