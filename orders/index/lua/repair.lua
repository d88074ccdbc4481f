-- repair: make one user's set agree with SQL, atomically (used by reconcile).
--
-- KEYS[1]  the user's sorted set (member = order id, score = expiry in integer ms)
-- ARGV[1]  now, integer ms since the epoch: members at or before it are dropped
-- ARGV[2]  n, how many order ids to remove; ARGV[3 .. 2+n] are those ids
-- ARGV[3+n ..] pairs of (expiry ms, order id) to add or re-score
--
-- Returns {dropped_expired, removed, added_or_rescored}.
local key = KEYS[1]
local dropped = redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
local n = tonumber(ARGV[2])
local removed = 0
for i = 3, 2 + n do
  removed = removed + redis.call('ZREM', key, ARGV[i])
end
local changed = 0
for i = 3 + n, #ARGV, 2 do
  redis.call('ZADD', key, ARGV[i], ARGV[i + 1])
  changed = changed + 1
end
-- As in admit: no expiry on the key, and none left from before that could take these.
if changed > 0 then
  redis.call('PERSIST', key)
end
return {dropped, removed, changed}
