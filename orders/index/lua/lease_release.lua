-- lease_release: give the sweeper lease up, but only if the caller holds it.
--
-- KEYS[1]  the lease key (a string; its value is the holder's owner token)
-- ARGV[1]  the caller's owner token
--
-- Returns 1 if the lease was the caller's and is now deleted, else 0 (free already, or
-- held by another owner, which keeps it).
local key = KEYS[1]

if redis.call('GET', key) == ARGV[1] then
  return redis.call('DEL', key)
end
return 0
