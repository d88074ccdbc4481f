-- repair: make one user's set agree with SQL, atomically (used by reconcile).
--
-- KEYS[1]  the user's sorted set (member = order id, score = expiry in integer ms)
-- ARGV[1]  now, integer ms since the epoch: members at or before it are dropped
-- ARGV[2]  margin in ms: the key expires this long after its latest member
-- ARGV[3]  n, how many order ids to remove; ARGV[4 .. 3+n] are those ids
-- ARGV[4+n ..] pairs of (expiry ms, order id) to add or re-score
--
-- Returns {dropped_expired, removed, added_or_rescored}.
local key = KEYS[1]
local dropped = redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
local n = tonumber(ARGV[3])
local removed = 0
for i = 4, 3 + n do
  removed = removed + redis.call('ZREM', key, ARGV[i])
end
local changed = 0
for i = 4 + n, #ARGV, 2 do
  redis.call('ZADD', key, ARGV[i], ARGV[i + 1])
  changed = changed + 1
end
-- As in admit: the key lives a margin past its latest member, so it frees itself.
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if last[2] then
  redis.call('PEXPIREAT', key, string.format('%d', tonumber(last[2]) + tonumber(ARGV[2])))
end
return {dropped, removed, changed}
