"""The Lua scripts the edges share their limits with, in Valkey.

Each runs atomically on the server in one round trip; ``SharedLimits``
(``iop/edge/tenancy/_cluster.py``, whose docstring says when each is called
and what happens on a fault) registers them all (``SCRIPTS``), and each
script's reply has one decoder in ``iop/edge/tenancy/_cluster_replies.py``.
Keys are passed as ``KEYS``; the scripts touch no other key except the
membership set's members, so they run on one Valkey, not a cluster.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BUDGET_KEY_GRACE_S",
    "BUDGET_RESERVE",
    "BUDGET_SETTLE",
    "HEARTBEAT",
    "LEAVE",
    "RESERVE",
    "RESYNC",
    "SCRIPTS",
    "SETTLE",
]

_BUCKET = """
local function level(lf, af, cap, now)
  local l = tonumber(redis.call('HGET', KEYS[1], lf))
  local at = tonumber(redis.call('HGET', KEYS[1], af))
  if l == nil or at == nil then return cap end
  if now > at then l = math.min(cap, l + (now - at) * cap / 60) end
  return l
end
local function until_full(l, cap) return (cap - l) / (cap / 60) end
"""

RESERVE: Final = (
    _BUCKET
    + """
-- KEYS: bucket hash, concurrency hash. ARGV: edge id, rpm, tpm, max
-- concurrent, tokens, membership key prefix.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3])
local maxc, cost = tonumber(ARGV[4]), tonumber(ARGV[5])
local rl, tl = 0, 0
if rpm > 0 then rl = level('rl', 'ra', rpm, now) end
if tpm > 0 then tl = level('tl', 'ta', tpm, now) end
local running = 0
if maxc > 0 then
  local held = redis.call('HGETALL', KEYS[2])
  for i = 1, #held, 2 do
    if redis.call('EXISTS', ARGV[6] .. held[i]) == 1 then
      running = running + tonumber(held[i + 1])
    else
      redis.call('HDEL', KEYS[2], held[i])
    end
  end
end
local wc, wr, wt = 0, 0, 0
if maxc > 0 and running >= maxc then wc = 1 end
if rpm > 0 and rl < 1 then wr = (1 - rl) / (rpm / 60) end
if tpm > 0 then
  if cost > tpm then wt = -1 elseif tl < cost then wt = (cost - tl) / (tpm / 60) end
end
local ok = 0
if wc == 0 and wr == 0 and wt == 0 then
  ok = 1
  local ttl = 0
  if rpm > 0 then
    rl = rl - 1
    redis.call('HSET', KEYS[1], 'rl', tostring(rl), 'ra', tostring(now))
    ttl = math.max(ttl, until_full(rl, rpm))
  end
  if tpm > 0 then
    tl = tl - cost
    redis.call('HSET', KEYS[1], 'tl', tostring(tl), 'ta', tostring(now))
    ttl = math.max(ttl, until_full(tl, tpm))
  end
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000) end
  if maxc > 0 then
    redis.call('HINCRBY', KEYS[2], ARGV[1], 1)
    running = running + 1
  end
end
local rr, tr = 0, 0
if rpm > 0 then rr = until_full(rl, rpm) end
if tpm > 0 then tr = until_full(tl, tpm) end
return {ok, tostring(rl), tostring(rr), tostring(tl), tostring(tr), running,
        tostring(wr), tostring(wt), wc}
"""
)

SETTLE: Final = (
    _BUCKET
    + """
-- KEYS: bucket hash, concurrency hash. ARGV: edge id, tpm, tokens given
-- back (negative: charged), 1 to release a concurrency slot.
if tonumber(ARGV[4]) == 1 then
  local n = redis.call('HINCRBY', KEYS[2], ARGV[1], -1)
  if n <= 0 then redis.call('HDEL', KEYS[2], ARGV[1]) end
end
local tpm, give = tonumber(ARGV[2]), tonumber(ARGV[3])
if tpm > 0 and give ~= 0 then
  local t = redis.call('TIME')
  local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
  local tl = math.min(tpm, level('tl', 'ta', tpm, now) + give)
  redis.call('HSET', KEYS[1], 'tl', tostring(tl), 'ta', tostring(now))
  local ttl = until_full(tl, tpm)
  if ttl > 0 then redis.call('PEXPIRE', KEYS[1], math.ceil(ttl * 1000) + 1000) end
end
return 1
"""
)

HEARTBEAT: Final = """
-- KEYS: this edge's membership key, the members sorted set. ARGV: edge id,
-- TTL (ms). Returns the live edges.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1], '1', 'PX', ttl)
redis.call('ZADD', KEYS[2], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
return redis.call('ZCARD', KEYS[2])
"""

RESYNC: Final = """
-- KEYS: tenants' concurrency hashes. ARGV: edge id, then the slots this
-- edge holds for each (0: none). Sets them to what the edge knows it holds.
for i = 1, #KEYS do
  local n = tonumber(ARGV[i + 1])
  if n > 0 then redis.call('HSET', KEYS[i], ARGV[1], n)
  else redis.call('HDEL', KEYS[i], ARGV[1]) end
end
return 1
"""

LEAVE: Final = """
-- KEYS: this edge's membership key, the members sorted set, then every
-- tenant's concurrency hash. ARGV: edge id. An edge that starts or stops
-- holds no slot.
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
for i = 3, #KEYS do redis.call('HDEL', KEYS[i], ARGV[1]) end
return 1
"""


BUDGET_RESERVE: Final = """
-- KEYS: the tenant's budget keys, one per period. ARGV: cost (micro-units),
-- then each key's limit, then each key's expiry (Unix seconds). Returns
-- {1, spent...} (taken) or {0, spent...} (refused, nothing taken).
local cost = tonumber(ARGV[1])
local n = #KEYS
local spent = {}
local ok = 1
for i = 1, n do
  spent[i] = tonumber(redis.call('GET', KEYS[i]) or '0')
  local limit = tonumber(ARGV[1 + i])
  if spent[i] >= limit or spent[i] + cost > limit then ok = 0 end
end
if ok == 1 then
  for i = 1, n do
    spent[i] = redis.call('INCRBY', KEYS[i], cost)
    redis.call('EXPIREAT', KEYS[i], tonumber(ARGV[1 + n + i]))
  end
end
local out = {ok}
for i = 1, n do out[i + 1] = tostring(spent[i]) end
return out
"""

BUDGET_SETTLE: Final = """
-- KEYS: budget keys. ARGV: the micro-units to add to each (negative: given
-- back), then each key's expiry (Unix seconds).
local n = #KEYS
for i = 1, n do
  local add = tonumber(ARGV[i])
  if add ~= 0 then
    redis.call('INCRBY', KEYS[i], add)
    redis.call('EXPIREAT', KEYS[i], tonumber(ARGV[n + i]))
  end
end
return 1
"""

# A budget key outlives its period by a day: an edge whose clock is behind
# still finds it, and a settlement arriving after the turn still lands.
BUDGET_KEY_GRACE_S: Final = 86400

SCRIPTS: Final = {
    "reserve": RESERVE,
    "settle": SETTLE,
    "heartbeat": HEARTBEAT,
    "leave": LEAVE,
    "resync": RESYNC,
    "budget_reserve": BUDGET_RESERVE,
    "budget_settle": BUDGET_SETTLE,
}
