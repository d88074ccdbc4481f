-- set_capacity: change a resource's capacity where the index knows the resource.
--
-- KEYS[1]  the resource's hash (see reserve.lua)
-- ARGV[1]  the capacity
--
-- A resource with no hash stays unknown (nothing is written): only a rebuild from SQL makes
-- it known, with its sold units and holds. Returns 1 when written, else 0.
local key = KEYS[1]
if redis.call('HEXISTS', key, 'cap') == 0 then
  return 0
end
redis.call('HSET', key, 'cap', ARGV[1])
return 1
