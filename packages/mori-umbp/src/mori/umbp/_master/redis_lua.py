"""The Lua scripts of the Redis store: one per mutation, so each runs atomically in Redis.

Every script gets the hash-tag prefix ``{umbp:<namespace>}`` as ARGV[1] and builds its key names
from it (all keys share one hash slot, so a script stays atomic on Redis Cluster too); KEYS[1]
is any key under the prefix, for cluster routing. Times come in as ARGV (wall-clock ms): the
scripts never read the server clock. Layout (MORI's design-redis-metadata-store.md, section 4):

  P:node:<id>          HASH addr peer status last_hb reg_at seq caps engine tags
  P:nodes:alive        SET  node ids
  P:alive_peers        HASH node id -> peer address
  P:block:<key>        HASH l|<node>|<tier> -> size; _n (location count), _lease, _lacc, _acnt, _created
  P:node:<id>:blocks   SET  the node's keys
  P:lru:<node>:<tier>  ZSET key scored by last access
  P:extkv:<hash>       HASH node -> tier bitmask (bit 1 << tier)
  P:extkv:node:<id>    SET  the node's reported hashes
  P:hit:<hash>         HASH c (count), ls (last seen)
  P:nblocks, P:nhits   counters of block keys and hit entries (mori's addition, for the bounds)
"""

from __future__ import annotations

_COMMON = """
local P = ARGV[1]
local TIERS = {1, 2, 3}
local function nodekey(id) return P .. ':node:' .. id end
local function blockkey(k) return P .. ':block:' .. k end
local function locfield(node, tier) return 'l|' .. node .. '|' .. tier end

local function add_loc(node, k, tier, size, now)
  local bk = blockkey(k)
  if redis.call('HSET', bk, locfield(node, tier), size) == 1 then
    if redis.call('HINCRBY', bk, '_n', 1) == 1 then
      redis.call('INCR', P .. ':nblocks')
      redis.call('HSET', bk, '_created', now, '_lacc', now)
    end
  end
  redis.call('SADD', nodekey(node) .. ':blocks', k)
  redis.call('ZADD', P .. ':lru:' .. node .. ':' .. tier, now, k)
end

local function node_holds(node, k)
  local bk = blockkey(k)
  for _, t in ipairs(TIERS) do
    if redis.call('HEXISTS', bk, locfield(node, t)) == 1 then return true end
  end
  return false
end

local function remove_loc(node, k, tier)
  local bk = blockkey(k)
  if redis.call('HDEL', bk, locfield(node, tier)) == 0 then return end
  redis.call('ZREM', P .. ':lru:' .. node .. ':' .. tier, k)
  if not node_holds(node, k) then redis.call('SREM', nodekey(node) .. ':blocks', k) end
  if redis.call('HINCRBY', bk, '_n', -1) <= 0 then
    redis.call('DEL', bk)
    redis.call('DECR', P .. ':nblocks')
  end
end

local function wipe_blocks(node)
  local set = nodekey(node) .. ':blocks'
  for _, k in ipairs(redis.call('SMEMBERS', set)) do
    for _, t in ipairs(TIERS) do remove_loc(node, k, t) end
  end
  redis.call('DEL', set)
end

local function clear_ext(node, hashes, mask)
  local set = P .. ':extkv:node:' .. node
  for _, h in ipairs(hashes) do
    local ek = P .. ':extkv:' .. h
    local cur = tonumber(redis.call('HGET', ek, node) or '0')
    if cur ~= 0 then
      local left = bit.band(cur, bit.bnot(mask))
      if left == 0 then
        redis.call('HDEL', ek, node)
        redis.call('SREM', set, h)
      else
        redis.call('HSET', ek, node, left)
      end
    end
  end
end

local function drop_node(node)
  wipe_blocks(node)
  for _, t in ipairs(TIERS) do redis.call('DEL', P .. ':lru:' .. node .. ':' .. t) end
  clear_ext(node, redis.call('SMEMBERS', P .. ':extkv:node:' .. node), -1)
  redis.call('DEL', P .. ':extkv:node:' .. node)
  redis.call('DEL', nodekey(node))
  redis.call('SREM', P .. ':nodes:alive', node)
  redis.call('HDEL', P .. ':alive_peers', node)
end
"""

# ARGV: P, id, now, stale_after_ms, max_clients, addr, peer, caps, engine, tags.
# Returns 1 registered, 0 alive already, -1 full.
REGISTER_CLIENT = (
    _COMMON
    + """
local id, now, stale = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local rec = redis.call('HMGET', nodekey(id), 'status', 'last_hb')
if rec[1] then
  if tonumber(rec[1]) == 1 and now - tonumber(rec[2]) <= stale then return 0 end
  drop_node(id)
elseif redis.call('SCARD', P .. ':nodes:alive') >= tonumber(ARGV[5]) then
  return -1
end
redis.call('HSET', nodekey(id), 'addr', ARGV[6], 'peer', ARGV[7], 'status', 1, 'last_hb', now,
           'reg_at', now, 'seq', 0, 'caps', ARGV[8], 'engine', ARGV[9], 'tags', ARGV[10])
redis.call('SADD', P .. ':nodes:alive', id)
redis.call('HSET', P .. ':alive_peers', id, ARGV[7])
return 1
"""
)

UNREGISTER_CLIENT = (
    _COMMON
    + """
if redis.call('EXISTS', nodekey(ARGV[2])) == 0 then return 0 end
drop_node(ARGV[2])
return 1
"""
)

# ARGV: P, id, first_seq, last_seq, now, full_sync (0/1), caps, max_per_client, max_keys,
# then 4 per event: add (1/0), key, tier, size.
# Returns {'UNKNOWN', 0} | {'SEQ_GAP', seq} | {'QUOTA', message} | {'APPLIED', seq}.
APPLY_HEARTBEAT = (
    _COMMON
    + """
local id, first, last, now = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local full = ARGV[6] == '1'
local max_per, max_keys = tonumber(ARGV[8]), tonumber(ARGV[9])
local nk = nodekey(id)
local seq = redis.call('HGET', nk, 'seq')
if not seq then return {'UNKNOWN', 0} end
if not full and first ~= tonumber(seq) + 1 then
  redis.call('HSET', nk, 'last_hb', now, 'status', 1)
  return {'SEQ_GAP', tonumber(seq)}
end
-- the final state of each touched (key, tier): size for an ADD, false for a REMOVE
local touched, order = {}, {}
for i = 10, #ARGV, 4 do
  local add, k, t, size = ARGV[i] == '1', ARGV[i + 1], tonumber(ARGV[i + 2]), ARGV[i + 3]
  if not full or add then
    if touched[k] == nil then touched[k] = {}; order[#order + 1] = k end
    if add then touched[k][t] = size else touched[k][t] = false end
  end
end
local mine = nk .. ':blocks'
local node_count = redis.call('SCARD', mine)
local current_count = node_count
local total = tonumber(redis.call('GET', P .. ':nblocks') or '0')
local current_total = total
local function own_fields(k)
  local n = 0
  for _, t in ipairs(TIERS) do
    if redis.call('HEXISTS', blockkey(k), locfield(id, t)) == 1 then n = n + 1 end
  end
  return n
end
if full then
  node_count = #order
  for _, k in ipairs(redis.call('SMEMBERS', mine)) do
    if touched[k] == nil then
      local n = tonumber(redis.call('HGET', blockkey(k), '_n') or '0')
      if n == own_fields(k) then total = total - 1 end
    end
  end
  for _, k in ipairs(order) do
    if redis.call('EXISTS', blockkey(k)) == 0 then total = total + 1 end
  end
else
  for _, k in ipairs(order) do
    local exists = redis.call('EXISTS', blockkey(k)) == 1
    local before = redis.call('SISMEMBER', mine, k) == 1
    local after = false
    for _, t in ipairs(TIERS) do
      local v = touched[k][t]
      if v == nil then
        if redis.call('HEXISTS', blockkey(k), locfield(id, t)) == 1 then after = true end
      elseif v then
        after = true
      end
    end
    local others = exists and tonumber(redis.call('HGET', blockkey(k), '_n') or '0') > own_fields(k)
    if after and not before then node_count = node_count + 1 end
    if before and not after then node_count = node_count - 1 end
    local held = after or others
    if held and not exists then total = total + 1 end
    if exists and not held then total = total - 1 end
  end
end
local function refuse(msg)
  redis.call('HSET', nk, 'last_hb', now, 'status', 1)  -- a refused heartbeat still says it is alive
  return {'QUOTA', msg}
end
if node_count > max_per and node_count > current_count then
  return refuse("node '" .. id .. "' would own " .. node_count .. ' keys, over its quota of ' ..
                max_per .. ' (UMBP_MASTER_MAX_KEYS_PER_CLIENT)')
end
if total > max_keys and total > current_total then
  return refuse('the block index would hold ' .. total .. ' keys, over its limit of ' ..
                max_keys .. ' (UMBP_MASTER_MAX_KEYS)')
end
if full then wipe_blocks(id) end
for _, k in ipairs(order) do
  for _, t in ipairs(TIERS) do
    local v = touched[k][t]
    if v then add_loc(id, k, t, v, now) elseif v == false then remove_loc(id, k, t) end
  end
end
redis.call('HSET', nk, 'seq', last, 'last_hb', now, 'status', 1)
if ARGV[7] ~= '' then redis.call('HSET', nk, 'caps', ARGV[7]) end
redis.call('SADD', P .. ':nodes:alive', id)
return {'APPLIED', last}
"""
)

# ARGV: P, cutoff_ms. Returns the expired node ids.
EXPIRE_STALE = (
    _COMMON
    + """
local cutoff, dead = tonumber(ARGV[2]), {}
for _, id in ipairs(redis.call('SMEMBERS', P .. ':nodes:alive')) do
  local hb = tonumber(redis.call('HGET', nodekey(id), 'last_hb') or '0')
  if hb < cutoff then dead[#dead + 1] = id end
end
for _, id in ipairs(dead) do drop_node(id) end
return dead
"""
)

# ARGV: P, n_alive, alive node ids..., keys... Returns 1/0 per key: held by an alive node.
EXISTS_LIVE = (
    _COMMON
    + """
local n = tonumber(ARGV[2])
local alive = {}
for i = 3, 2 + n do alive[ARGV[i]] = true end
local out = {}
for i = 3 + n, #ARGV do
  local found = 0
  for _, f in ipairs(redis.call('HKEYS', blockkey(ARGV[i]))) do
    if string.sub(f, 1, 2) == 'l|' and alive[string.match(f, '^l|(.*)|%d+$')] then
      found = 1
      break
    end
  end
  out[#out + 1] = found
end
return out
"""
)

# ARGV: P, now, lease_ms, keys...
TOUCH = (
    _COMMON
    + """
local now, lease = tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 4, #ARGV do
  local k = ARGV[i]
  local bk = blockkey(k)
  if redis.call('EXISTS', bk) == 1 then
    redis.call('HSET', bk, '_lease', now + lease, '_lacc', now)
    redis.call('HINCRBY', bk, '_acnt', 1)
    local fields = redis.call('HKEYS', bk)
    for _, f in ipairs(fields) do
      if string.sub(f, 1, 2) == 'l|' then
        local node, tier = string.match(f, '^l|(.*)|(%d+)$')
        redis.call('ZADD', P .. ':lru:' .. node .. ':' .. tier, now, k)
      end
    end
  end
end
return 0
"""
)

# ARGV: P, node, tier, limit, now. Returns a flat list key, size, key, size...
EVICTION_CANDIDATES = (
    _COMMON
    + """
local node, tier, limit, now = ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local out, start, step = {}, 0, 256
while #out < 2 * limit do
  local keys = redis.call('ZRANGE', P .. ':lru:' .. node .. ':' .. tier, start, start + step - 1)
  if #keys == 0 then break end
  for _, k in ipairs(keys) do
    local v = redis.call('HMGET', blockkey(k), '_lease', locfield(node, tier))
    if v[2] and tonumber(v[1] or '0') <= now then
      out[#out + 1] = k
      out[#out + 1] = v[2]
      if #out >= 2 * limit then break end
    end
  end
  start = start + step
  if start >= 16 * step then break end
end
return out
"""
)

# ARGV: P, node, tier, max_per_client, hashes... Returns 1 ok, 0 not alive, -1 over quota.
REPORT_EXTERNAL_KV = (
    _COMMON
    + """
local node, tier, max_per = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if tonumber(redis.call('HGET', nodekey(node), 'status') or '0') ~= 1 then return 0 end
local set = P .. ':extkv:node:' .. node
local n, seen = redis.call('SCARD', set), {}
for i = 5, #ARGV do
  local h = ARGV[i]
  if not seen[h] then
    seen[h] = true
    if redis.call('SISMEMBER', set, h) == 0 then n = n + 1 end
  end
end
if n > max_per then return -1 end
local b = bit.lshift(1, tier)
for i = 5, #ARGV do
  local ek = P .. ':extkv:' .. ARGV[i]
  redis.call('HSET', ek, node, bit.bor(tonumber(redis.call('HGET', ek, node) or '0'), b))
  redis.call('SADD', set, ARGV[i])
end
return 1
"""
)

# ARGV: P, node, mask, hashes... (no hashes: every hash the node reported)
REVOKE_EXTERNAL_KV = (
    _COMMON
    + """
local node, mask, hashes = ARGV[2], tonumber(ARGV[3]), {}
for i = 4, #ARGV do hashes[#hashes + 1] = ARGV[i] end
if #hashes == 0 then hashes = redis.call('SMEMBERS', P .. ':extkv:node:' .. node) end
clear_ext(node, hashes, mask)
return 0
"""
)

# ARGV: P, count_as_hit (0/1), now, max_hit_entries, hashes (distinct)...
# Returns a flat list node, mask, hash, node, mask, hash...
MATCH_EXTERNAL_KV = (
    _COMMON
    + """
local count, now, max_hits = ARGV[2] == '1', tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i = 5, #ARGV do
  local h = ARGV[i]
  local pairs_ = redis.call('HGETALL', P .. ':extkv:' .. h)
  for j = 1, #pairs_, 2 do
    out[#out + 1] = pairs_[j]
    out[#out + 1] = pairs_[j + 1]
    out[#out + 1] = h
  end
  if count and #pairs_ > 0 then
    local hk = P .. ':hit:' .. h
    if redis.call('EXISTS', hk) == 1 then
      redis.call('HINCRBY', hk, 'c', 1)
      redis.call('HSET', hk, 'ls', now)
    elseif tonumber(redis.call('GET', P .. ':nhits') or '0') < max_hits then
      redis.call('HSET', hk, 'c', 1, 'ls', now)
      redis.call('INCR', P .. ':nhits')
    end
  end
end
return out
"""
)

# ARGV: P, cutoff, hit keys found by SCAN... Returns how many were dropped.
GC_HITS = (
    _COMMON
    + """
local cutoff, dropped = tonumber(ARGV[2]), 0
for i = 3, #ARGV do
  local ls = redis.call('HGET', ARGV[i], 'ls')
  if ls and tonumber(ls) < cutoff then
    redis.call('DEL', ARGV[i])
    redis.call('DECR', P .. ':nhits')
    dropped = dropped + 1
  end
end
return dropped
"""
)
