-- heartbeat: write one scheduler's beat into the schedulers hash, forget the stale ones.
--
-- KEYS[1]  the schedulers hash (field: an owner token; value: that scheduler's beat, JSON
--          with at least "seen_ms" and "forget_after_ms", integers)
-- ARGV[1]  the caller's owner token
-- ARGV[2]  the caller's beat, JSON
-- ARGV[3]  the caller's now, service-clock ms (the beat's own seen_ms)
-- ARGV[4]  how long the hash outlives its last beat, integer ms (PEXPIRE)
--
-- Returns the number of beats it forgot: a field whose seen_ms + forget_after_ms is before
-- the caller's now (its scheduler stopped beating), or whose value is not a beat at all.
-- The time is the caller's, passed in: the beats are on the service clock, not Redis's.
local key = KEYS[1]
local now_ms = tonumber(ARGV[3])

redis.call('HSET', key, ARGV[1], ARGV[2])
local forgot = 0
local fields = redis.call('HGETALL', key)
for i = 1, #fields, 2 do
  local ok, beat = pcall(cjson.decode, fields[i + 1])
  local stale = true
  if ok and type(beat) == 'table' and type(beat.seen_ms) == 'number'
      and type(beat.forget_after_ms) == 'number' then
    stale = beat.seen_ms + beat.forget_after_ms < now_ms
  end
  if stale then
    redis.call('HDEL', key, fields[i])
    forgot = forgot + 1
  end
end
redis.call('PEXPIRE', key, ARGV[4])
return forgot
