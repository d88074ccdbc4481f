-- lease: take the sweeper lease if it is free, or renew it if the caller already holds it.
--
-- KEYS[1]  the lease key (a string; its value is the holder's owner token)
-- ARGV[1]  the caller's owner token
-- ARGV[2]  the lease's time to live, integer ms
--
-- Returns 1 if the caller holds the lease afterwards (taken or renewed), 0 if another
-- owner holds it (left untouched). Only the holder can extend its lease: the token is
-- compared before PEXPIRE, in this one script.
--
-- It looks before it writes: SET may be refused when Redis is at maxmemory under
-- noeviction (an OOM error), GET and PEXPIRE never are. So a full Redis still lets the
-- holder renew and a standby see that it is one; only a free lease cannot be taken then.
local key = KEYS[1]
local owner = ARGV[1]

local holder = redis.call('GET', key)
if holder == owner then
  redis.call('PEXPIRE', key, ARGV[2])
  return 1
end
if holder then
  return 0
end
redis.call('SET', key, owner, 'PX', ARGV[2])
return 1
