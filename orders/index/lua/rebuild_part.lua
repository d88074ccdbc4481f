-- rebuild_part: write part of a resource's new state under temporary keys (rebuild_swap.lua
-- then puts them in place), so that a reader never sees half a rebuild.
--
-- KEYS[1]  the temporary hash (see reserve.lua for its fields), in the resource's slot
-- KEYS[2]  the temporary holds set, in the same slot
-- ARGV[1]  how long (ms) the temporary keys live if the rebuild never swaps them in
-- ARGV[2]  the capacity, on the first part only ('' on the others)
-- ARGV[3]  the units sold, on the first part only
-- ARGV[4 ..] triples (order id, units, expiry ms): members to add (the caller leaves out
--          the expired; at most about a thousand a part)
--
-- The first write is an HSET (it may grow memory), so a full server refuses the part whole.
-- Returns the number of members added.
local res = KEYS[1]
local holds = KEYS[2]
if ARGV[2] ~= '' then
  redis.call('HSET', res, 'cap', ARGV[2], 'sold', ARGV[3], 'held', '0')
end
local fields, scores = {}, {}
local held = 0
for i = 4, #ARGV, 3 do
  fields[#fields + 1] = 'o:' .. ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
  scores[#scores + 1] = ARGV[i + 2]
  scores[#scores + 1] = ARGV[i]
  held = held + tonumber(ARGV[i + 1])
end
if #fields > 0 then
  redis.call('HSET', res, unpack(fields))
  redis.call('ZADD', holds, unpack(scores))
  redis.call('HINCRBY', res, 'held', held)
  redis.call('PEXPIRE', holds, ARGV[1])
end
redis.call('PEXPIRE', res, ARGV[1])
return #fields / 2
