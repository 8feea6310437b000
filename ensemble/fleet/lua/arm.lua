-- The arm of a request, shared by the gateway's two Lua filters (pin_version.lua, client_error.lua).
--
-- A route's metadata (ensemble/fleet/envoy_config.py, _arm_metadata) names the serving release
-- ("release") and, during an experiment, the candidates with their upper bounds in CONFIG.points
-- ("arms": "4:1000;5:1500"), the key ("key"), the shadow share in CONFIG.points ("shadow") and the
-- candidates a shadow request names ("candidates"). The key's value is the request header of that
-- name or, when the request has none, the request parameter of that name (key_wanted says when the
-- filter must read the body for it); a request with neither hashes Envoy's x-request-id (random per
-- request). The value is hashed as ensemble.fleet.arms.arm_point does (the Python twin, tested
-- against this one); the request gets the release whose bound is the first above its point, and the
-- release header naming it. Outside an experiment arm_of gives the pinned release, or nil. A client's
-- own shadow header is always removed; a sample of the serving arm's requests, drawn from the
-- request id, gets one naming the candidates.
--
-- The file is a chunk: `...` is the CONFIG table the generator writes (release_header, shadow_header,
-- points), and it returns its functions.
local CONFIG = ...
local POINTS = CONFIG.points
local RELEASE_HEADER, SHADOW_HEADER = CONFIG.release_header, CONFIG.shadow_header

local KEY_PROBLEM = "the arm key parameter '%s' must be a string or an integer from 0 to 2^53 - 1"

-- Where `value` (bytes) falls in [0, POINTS): a polynomial hash of its bytes mixed by `rounds`
-- Lehmer steps (3 for the arm, 5 for the shadow sample), exact in doubles: every product stays
-- below 2^53.
local function point_of(value, rounds)
  local h = 0
  for i = 1, #value do h = (h * 31 + value:byte(i)) % 2147483647 end
  for _ = 1, rounds do h = (h * 48271 + 11) % 2147483647 end
  return h % POINTS
end

-- The release of the arm `point` falls in: the first candidate of `arms` ("4:1000;5:1500") whose
-- bound is above it, else `release`.
local function choose(arms, point, release)
  for candidate, upto in string.gmatch(arms, "(%d+):(%d+)") do
    if point < tonumber(upto) then return candidate end
  end
  return release
end

-- The key parameter to read from the body: during an experiment with a key that the request does
-- not carry as a header; nil otherwise.
local function key_wanted(handle)
  local meta = handle:metadata()
  local key = meta:get("key")
  if meta:get("arms") == nil or key == nil or key == "" then return nil end
  if handle:headers():get(key) ~= nil then return nil end
  return key
end

-- The release that scores the request, its headers set to say so; `value`: the key parameter's
-- value when the body gave one.
local function arm_of(handle, value)
  local headers = handle:headers()
  headers:remove(SHADOW_HEADER)
  local meta = handle:metadata()
  local release = meta:get("release")
  local arms = meta:get("arms")
  if release == nil or arms == nil then return release end
  local key = meta:get("key")
  local id = headers:get("x-request-id") or ""
  if value == nil and key ~= nil and key ~= "" then value = headers:get(key) end
  if value == nil then value = id end
  local chosen = choose(arms, point_of(value, 3), release)
  headers:remove(RELEASE_HEADER)
  headers:add(RELEASE_HEADER, chosen)
  local shadow = tonumber(meta:get("shadow") or "0")
  if chosen == release and shadow > 0 and point_of(id, 5) < shadow then
    headers:add(SHADOW_HEADER, meta:get("candidates"))
  end
  return chosen
end

return {KEY_PROBLEM = KEY_PROBLEM, point_of = point_of, choose = choose, key_wanted = key_wanted, arm_of = arm_of}
