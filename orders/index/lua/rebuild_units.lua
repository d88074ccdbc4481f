-- rebuild_units: write part of a named resource's new units hash under its temporary key
-- (rebuild_swap.lua then puts it in place with the rest of the resource).
--
-- KEYS[1]  the temporary units hash (see reserve.lua for its fields), in the resource's slot
-- ARGV[1]  how long (ms) the temporary key lives if the rebuild never swaps it in
-- ARGV[2 ..] pairs (field, value): a unit -> its holder (or '!' .. its buyer), and
--          '#' .. a holder -> its units, each after a newline
--
-- Returns the number of fields written.
local units_key = KEYS[1]
if #ARGV > 1 then
  redis.call('HSET', units_key, unpack(ARGV, 2))
  redis.call('PEXPIRE', units_key, ARGV[1])
end
return (#ARGV - 1) / 2
