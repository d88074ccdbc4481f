-- release: take an order's member out of each resource of one hash slot (the order was
-- cancelled, closed, replaced or erased, or its reserve is being undone), atomically.
--
-- KEYS     for each resource: its hash then its holds set (see reserve.lua), one hash slot
-- ARGV[1]  order id
--
-- Where the order is a member, its units leave `held` and its field and member go; where it
-- is not, nothing changes (a second release is a no-op). Only removals and a decrement:
-- nothing here grows memory, so a full server lets it run.
--
-- Returns how many resources had the order as a member.
local order_id = ARGV[1]
local field = 'o:' .. order_id
local released = 0
for i = 1, #KEYS, 2 do
  local res = KEYS[i]
  local holds = KEYS[i + 1]
  redis.call('ZREM', holds, order_id)
  local units = redis.call('HGET', res, field)
  if units then
    redis.call('HDEL', res, field)
    redis.call('HINCRBY', res, 'held', -tonumber(units))
    released = released + 1
  end
end
return released
