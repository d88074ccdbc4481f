-- admit: count a user's open unpaid orders and add one if the limit allows, atomically.
--
-- KEYS[1]  the user's sorted set (member = order id, score = expiry in integer ms)
-- ARGV[1]  order id
-- ARGV[2]  its expiry, integer ms since the epoch
-- ARGV[3]  now, integer ms since the epoch (the caller's clock, never the server's)
-- ARGV[4]  the limit: how many open orders the user may hold
--
-- Returns {code, open_count, score} where code is
--   1  admitted: the order was added; score is its expiry
--   0  exists:   the order was already a member (a retry); score is its stored expiry
--  -1  refused:  open_count >= limit; score is the earliest open expiry
-- Scores are returned as strings; they are exact integers below 2^53.
--
-- The key has no expiry of its own (an expires entry costs ~45 bytes a user): an emptied
-- set vanishes by itself, the sweep drops the members it closes, and reconcile any stray
-- (expired, or no longer open in SQL).
local key = KEYS[1]
local order_id = ARGV[1]
local limit = tonumber(ARGV[4])

-- An order whose expiry is not ahead of now no longer counts. ARGV[3] is passed on as the
-- string it came in as: a Lua number would be printed with 14 digits and lose precision.
redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])

local existing = redis.call('ZSCORE', key, order_id)
local count = redis.call('ZCARD', key)
if existing then
  return {0, count, existing}
end
if count >= limit then
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return {-1, count, first[2]}
end

redis.call('ZADD', key, ARGV[2], order_id)
-- A key written before expiries were dropped may still carry one, set for its members of
-- then: it would take this later order with it.
redis.call('PERSIST', key)
return {1, count + 1, ARGV[2]}
