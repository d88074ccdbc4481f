-- release: take an order's member out of each resource of one hash slot, atomically: its
-- units are free again (the order was cancelled, closed, replaced or erased, or its reserve
-- is being undone), or, with ARGV[2] = 'sold', sold (the order was paid).
--
-- KEYS     for each resource: its hash then its holds set (see reserve.lua), one hash slot
-- ARGV[1]  order id
-- ARGV[2]  'sold' for a sale; anything else (or absent) for a release
--
-- Where the order is a member, its units leave `held` (and, for a sale, join `sold`) and its
-- field and member go. Where it is not (released or sold already, dropped as expired by a
-- later reserve, its keys lost), nothing changes: a second call is a no-op, and a sale the
-- index missed counts as free units, which is optimistic and safe (SQL refuses an oversell
-- by itself) until reconcile rebuilds it. Only removals and counters that already exist:
-- nothing here grows memory, so a full server lets it run.
--
-- Returns how many resources had the order as a member.
local order_id = ARGV[1]
local sale = ARGV[2] == 'sold'
local field = 'o:' .. order_id
local moved = 0
for i = 1, #KEYS, 2 do
  local res = KEYS[i]
  local holds = KEYS[i + 1]
  redis.call('ZREM', holds, order_id)
  local units = redis.call('HGET', res, field)
  if units then
    redis.call('HDEL', res, field)
    redis.call('HINCRBY', res, 'held', -tonumber(units))
    if sale then
      redis.call('HINCRBY', res, 'sold', units)
    end
    moved = moved + 1
  end
end
return moved
