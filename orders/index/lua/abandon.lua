-- abandon: undo an admission whose caller never learnt its outcome (the call timed out, its
-- connection broke, it was interrupted), whichever of this and the admission Redis runs
-- first: a stalled server may still hold the admission, to run it when it wakes.
--
-- KEYS[1]  the user's sorted set (see admit.lua)
-- KEYS[2]  the user's admissions hash (see admit.lua)
-- KEYS[3]  the user's rate set (see admit.lua): the attempt's entry goes with its member
-- ARGV[1]  order id
-- ARGV[2]  the abandoned attempt's start, integer ms (the ARGV[3] its admission was sent)
-- ARGV[3]  the admission window, ms (how long the hash keeps the tombstone)
--
-- If that very attempt added the member (the hash names its start), the member goes. Unless
-- another attempt at the order added it (a concurrent twin, a retry: a start of its own),
-- the hash then names the attempt as abandoned, so that a late run of it, or of an older
-- attempt, adds nothing (admit.lua returns -2); a later retry still proceeds.
--
-- Returns 1 when it removed the member, else 0.
local key = KEYS[1]
local admits = KEYS[2]
local rate_key = KEYS[3]
local order_id = ARGV[1]
local started = tonumber(ARGV[2])

local entry = tonumber(redis.call('HGET', admits, order_id))
if entry and entry > 0 and entry ~= started then
  return 0
end
if entry and entry < 0 and -entry >= started then
  return 0
end
local removed = 0
if entry == started then
  removed = redis.call('ZREM', key, order_id)
  if tonumber(redis.call('ZSCORE', rate_key, order_id)) == started then
    redis.call('ZREM', rate_key, order_id)
  end
end
redis.call('HSET', admits, order_id, '-' .. ARGV[2])
redis.call('PEXPIRE', admits, ARGV[3])
return removed
