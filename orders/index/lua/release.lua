-- release: take an order's member out of each resource of one hash slot, atomically: its
-- units are free again (the order was cancelled, closed, replaced or erased, or its reserve
-- is being undone), or, with ARGV[2] = 'sold', sold (the order was paid).
--
-- KEYS     for each resource: its hash, holds set and units hash (see reserve.lua), one slot
-- ARGV[1]  order id
-- ARGV[2]  'sold' for a sale; anything else (or absent) for a release
--
-- Where the order is a member, its units leave `held` (and, for a sale, join `sold`) and its
-- field and member go. Where it is not (released or sold already, dropped as expired by a
-- later reserve, its keys lost), nothing changes: a second call is a no-op, and a sale the
-- index missed counts as free units, which is optimistic and safe (SQL refuses an oversell
-- by itself) until reconcile rebuilds it. The named units the order holds ('#' .. order id in
-- the units hash lists them) leave it, or are marked bought ('!' .. order id). Only
-- removals, counters that already exist and values replaced by one a byte longer: nothing
-- here grows memory by much, so a full server lets it run.
--
-- Returns how many resources had the order as a member.
local order_id = ARGV[1]
local sale = ARGV[2] == 'sold'
local field = 'o:' .. order_id
local moved = 0
for i = 1, #KEYS, 3 do
  local res = KEYS[i]
  local holds = KEYS[i + 1]
  local units_key = KEYS[i + 2]
  local listed = redis.call('HGET', units_key, '#' .. order_id)
  if listed then
    for name in string.gmatch(listed, '[^\n]+') do
      if redis.call('HGET', units_key, name) == order_id then
        if sale then
          redis.call('HSET', units_key, name, '!' .. order_id)
        else
          redis.call('HDEL', units_key, name)
        end
      end
    end
    redis.call('HDEL', units_key, '#' .. order_id)
  end
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
