-- reconcile: make one user's set hold SQL's open orders, atomically (used by reconcile, and
-- by the rescore after an extension, which names the one order it moved).
--
-- KEYS[1]  the user's sorted set (member = order id, score = expiry in integer ms)
-- ARGV[1]  now, integer ms since the epoch: members at or before it are dropped
-- ARGV[2]  '1' for a dry run: count what would change, write nothing
-- ARGV[3 ..] pairs of (expiry ms, order id): the orders SQL has open for the user, best
--          in the set's own order (expiry, then id), which lets a right key be seen at once
--
-- Returns 0 when the set already holds exactly the wanted members with their scores and
-- nothing expired; else {dropped_expired, added, rescored, extra...}: the extras are the
-- live members not wanted, left in place (the caller asks SQL about them). A key of another
-- type is returned as its WRONGTYPE error, so the caller can tell foreign data from a
-- failing server.
local key = KEYS[1]
local now = tonumber(ARGV[1])

local all = redis.pcall('ZRANGE', key, 0, -1, 'WITHSCORES')
if all.err then
  return all
end

-- The common case on a right index: same members, same scores, same order, none expired.
-- Scores compare as the strings Redis and the caller both print for integers.
if #all == #ARGV - 2 and (#all == 0 or tonumber(all[2]) > now) then
  local same = true
  for i = 1, #all, 2 do
    if all[i] ~= ARGV[i + 3] or all[i + 1] ~= ARGV[i + 2] then
      same = false
      break
    end
  end
  if same then
    return 0
  end
end

local have = {}
local expired = 0
for i = 1, #all, 2 do
  local score = tonumber(all[i + 1])
  have[all[i]] = score
  if score <= now then
    expired = expired + 1
  end
end

local wanted = {}
local changes = {}
local added, rescored = 0, 0
for i = 3, #ARGV, 2 do
  local member, score = ARGV[i + 1], tonumber(ARGV[i])
  wanted[member] = true
  local current = have[member]
  if current ~= score then
    if current == nil then
      added = added + 1
    else
      rescored = rescored + 1
    end
    changes[#changes + 1] = ARGV[i]
    changes[#changes + 1] = member
  end
end

local reply = {expired, added, rescored}
for i = 1, #all, 2 do
  local score = have[all[i]]
  if not wanted[all[i]] and score > now then
    reply[#reply + 1] = all[i]
  end
end
if ARGV[2] == '1' or (expired == 0 and #changes == 0) then
  return reply
end

if expired > 0 then
  -- ARGV[1] goes on as the string it came in as: a Lua number prints 14 digits only.
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[1])
end
for i = 1, #changes, 2000 do -- unpack has a stack limit: a thousand pairs at a time
  redis.call('ZADD', key, unpack(changes, i, math.min(i + 1999, #changes)))
end
-- As in admit: no expiry on the key, and none left from before that could take these.
if #changes > 0 then
  redis.call('PERSIST', key)
end
return reply
