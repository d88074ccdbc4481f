-- lease: take the sweeper lease if it is free, or renew it if the caller already holds it.
--
-- KEYS[1]  the lease key (a string; its value is the holder's owner token)
-- ARGV[1]  the caller's owner token
-- ARGV[2]  the lease's time to live, integer ms
--
-- Returns 1 if the caller holds the lease afterwards (taken or renewed), 0 if another
-- owner holds it (left untouched). Only the holder can extend its lease: the token is
-- compared before PEXPIRE, in this one script.
local key = KEYS[1]
local owner = ARGV[1]

if redis.call('SET', key, owner, 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', key) == owner then
  redis.call('PEXPIRE', key, ARGV[2])
  return 1
end
return 0
