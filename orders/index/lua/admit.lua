-- admit: count a user's open unpaid orders and add one if the limit allows, atomically.
--
-- KEYS[1]  the user's sorted set (member = order id, score = expiry in integer ms)
-- KEYS[2]  the user's admissions hash, in KEYS[1]'s slot: order id -> the start (ms) of the
--          create that added it, or minus the start of an attempt its caller abandoned
--          (abandon.lua). It lets reconcile tell a create still in flight from one that is over.
-- KEYS[3]  the user's own limit, in KEYS[1]'s slot (a copy of SQL's oes_user_limits row):
--          when present it replaces ARGV[4]
-- ARGV[1]  order id
-- ARGV[2]  its expiry, integer ms since the epoch
-- ARGV[3]  now, integer ms since the epoch (the caller's clock, never the server's): the
--          start of this create
-- ARGV[4]  the limit: how many open orders the user may hold, unless KEYS[3] says otherwise
-- ARGV[5]  the admission window, ms: how long a create can still be in flight (the hash
--          keeps an entry that long, and expires that long after its last write)
-- KEYS[4]  the user's rate set, in KEYS[1]'s slot: order id -> the start (ms) of the create
--          that admitted it, kept for ARGV[7] ms
-- ARGV[6]  the rate: how many creates the user may start in any ARGV[7] ms (0 or absent: off)
-- ARGV[7]  the rate's sliding window, ms
-- ARGV[8]  the suspects' age, ms: a refusal names the members whose create started at least
--          this long ago (by the admissions hash) and is not confirmed (absent: none)
--
-- Returns {code, open_count, score} where code is
--   1  admitted: the order was added; score is its expiry
--   0  exists:   the order was already a member (a retry); score is its stored expiry
--  -1  refused:  open_count >= limit; score is the earliest open expiry (0 when none), a
--      fourth element is the limit applied, and pairs (order id, start ms) follow: the
--      suspects, members whose create may be over without a row (the caller asks SQL;
--      a confirmed member has no entry in the hash, abandon.lua removes a dead one)
--  -3  rate:     ARGV[6] creates started in the last ARGV[7] ms (open_count is how many);
--      score is the start of the one whose leaving the window lets the next one in. The
--      rate is asked before the limit: a cancel frees a slot, never a create
--  -2  abandoned: an attempt at this order that started at or after now was abandoned by
--      its caller, so this is a late run of it (or of an older one): nothing is written;
--      open_count and score are 0
-- Scores are returned as strings; they are exact integers below 2^53.
--
-- The set has no expiry of its own (an expires entry costs ~45 bytes a user): an emptied
-- set vanishes by itself, the sweep drops the members it closes, and reconcile any stray
-- (expired, or no longer open in SQL).
--
-- On a server at maxmemory (noeviction) Redis refuses a script's first write when it is a
-- command that may grow memory, and lets every later one pass. So an admission's first
-- write is its ZADD: a full server refuses it with an OOM error and nothing is written.
local key = KEYS[1]
local admits = KEYS[2]
local order_id = ARGV[1]
local now = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])

local limit_key = KEYS[3]
local own_limit = redis.call('GET', limit_key)
if own_limit then
  limit = tonumber(own_limit) or limit
end

-- An order whose expiry is not ahead of now no longer counts. ARGV[3] is passed on as the
-- string it came in as: a Lua number would be printed with 14 digits and lose precision.
local count = redis.call('ZCOUNT', key, '(' .. ARGV[3], '+inf')
local existing = redis.call('ZSCORE', key, order_id)
if existing and tonumber(existing) > now then
  return {0, count, existing}
end

local entry = tonumber(redis.call('HGET', admits, order_id))
if entry and entry < 0 and -entry >= now then
  return {-2, 0, '0'}
end

-- The rate (a retry, answered above, is not a new create). Starts at or before `since`
-- have left the window; nothing is trimmed before the ZADD below (see the top).
local rate_key = KEYS[4]
local rate = tonumber(ARGV[6]) or 0
local since = rate > 0 and string.format('%.0f', now - tonumber(ARGV[7]))
if rate > 0 then
  local made = redis.call('ZCOUNT', rate_key, '(' .. since, '+inf')
  if made >= rate then
    redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', since)
    local next_out = redis.call('ZRANGE', rate_key, made - rate, made - rate, 'WITHSCORES')
    return {-3, made, next_out[2]}
  end
end

if count >= limit then
  -- Expired members go here, not before the count: ZREMRANGEBYSCORE only frees memory,
  -- which a full server allows.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  local reply = {-1, count, first[2] or '0', limit}
  local live = redis.call('ZRANGE', key, 0, -1)
  if ARGV[8] and #live > 0 then
    local settled = now - tonumber(ARGV[8])
    local starts = redis.call('HMGET', admits, unpack(live))
    for i = 1, #live do
      local start = tonumber(starts[i])
      if start and start > 0 and start <= settled then
        reply[#reply + 1] = live[i]
        reply[#reply + 1] = starts[i]
      end
    end
  end
  return reply
end

redis.call('ZADD', key, ARGV[2], order_id)
-- A key written before expiries were dropped may still carry one, set for its members of
-- then: it would take this later order with it.
redis.call('PERSIST', key)
redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])
if rate > 0 then
  redis.call('ZREMRANGEBYSCORE', rate_key, '-inf', since)
  redis.call('ZADD', rate_key, ARGV[3], order_id)
  redis.call('PEXPIRE', rate_key, ARGV[7])
end

-- Entries older than the window belong to creates that are over: they go.
local oldest = now - tonumber(ARGV[5])
local entries = redis.call('HGETALL', admits)
for i = 1, #entries, 2 do
  if math.abs(tonumber(entries[i + 1])) < oldest then
    redis.call('HDEL', admits, entries[i])
  end
end
redis.call('HSET', admits, order_id, ARGV[3])
redis.call('PEXPIRE', admits, ARGV[5])
return {1, count + 1, ARGV[2]}
