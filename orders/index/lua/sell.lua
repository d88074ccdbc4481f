-- sell: turn an order's member of each resource of one hash slot into a sale (it was paid),
-- atomically.
--
-- KEYS     for each resource: its hash then its holds set (see reserve.lua), one hash slot
-- ARGV[1]  order id
--
-- Where the order is a member, its units move from `held` to `sold` and its field and member
-- go. Where it is not (dropped as expired by a later reserve, its keys lost, sold already),
-- nothing changes: the index then counts the sale as free units, which is optimistic and
-- safe (SQL refuses an oversell by itself) until reconcile rebuilds it. The first write is a
-- removal, so a full server lets it run.
--
-- Returns how many resources had the order as a member.
local order_id = ARGV[1]
local field = 'o:' .. order_id
local sold = 0
for i = 1, #KEYS, 2 do
  local res = KEYS[i]
  local holds = KEYS[i + 1]
  local units = redis.call('HGET', res, field)
  if units then
    redis.call('ZREM', holds, order_id)
    redis.call('HDEL', res, field)
    redis.call('HINCRBY', res, 'held', -tonumber(units))
    redis.call('HINCRBY', res, 'sold', units)
    sold = sold + 1
  end
end
return sold
