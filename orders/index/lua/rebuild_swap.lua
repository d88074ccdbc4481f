-- rebuild_swap: put a rebuilt resource's temporary keys (rebuild_part.lua) in place of its
-- keys, both at once: a reader sees the old state or the new, never half.
--
-- KEYS[1]  the temporary hash
-- KEYS[2]  the temporary holds set (absent when the new state has no member)
-- KEYS[3]  the temporary units hash (absent when no named unit is held or bought)
-- KEYS[4]  the resource's hash
-- KEYS[5]  the resource's holds set
-- KEYS[6]  the resource's units hash
--
-- The temporary keys carry an expiry (a rebuild that dies leaves nothing for long); the
-- renamed keys lose it. Returns 1 when swapped, 0 when the temporary hash is gone (it
-- expired: the rebuild took too long) or lacks its first part: nothing changes then.
local build = KEYS[1]
local build_holds = KEYS[2]
local build_units = KEYS[3]
local res = KEYS[4]
local holds = KEYS[5]
local units_key = KEYS[6]
if redis.call('HEXISTS', build, 'cap') == 0 then
  return 0
end
redis.call('RENAME', build, res)
redis.call('PERSIST', res)
if redis.call('EXISTS', build_holds) == 1 then
  redis.call('RENAME', build_holds, holds)
  redis.call('PERSIST', holds)
else
  redis.call('DEL', holds)
end
if redis.call('EXISTS', build_units) == 1 then
  redis.call('RENAME', build_units, units_key)
  redis.call('PERSIST', units_key)
else
  redis.call('DEL', units_key)
end
return 1
