-- The gRPC listener's Lua filter: a ModelInfer request for the ranker that names no version gets
-- the release of its arm (arm.lua: the pinned release, or during an experiment the arm its key
-- falls in) as `model_version` (field 2 of Triton's ModelInferRequest), appended to the message.
-- When the arm key is to be read from a request parameter, the `parameters` map (field 4, entries
-- of InferParameter) gives it: a string parameter's bytes, or an integer's decimal digits from 0
-- to 2^53 - 1; a parameter of another kind is refused with INVALID_ARGUMENT.
--
-- The message is read as protobuf reads it (the last occurrence of a field counts, a map's last
-- entry of a key, a oneof's last member; fields in any order; unknown fields and groups skipped),
-- so what the gateway sees is what Triton sees. A frame that is compressed (refused before this
-- filter), not one whole message, or not a message protobuf can read passes unchanged: Triton
-- answers it. tests/fuzz/lua.py holds this reading to protobuf's own on any bytes.
--
-- The file is a chunk: `...` is CONFIG (ranker) and arm.lua's functions; it returns its functions.
local CONFIG, arm = ...
local RANKER = CONFIG.ranker
local TWO_53 = 9007199254740992
local TWO_32 = 4294967296
local MAX_GROUP_DEPTH = 100 -- protobuf's own recursion limit

-- The varint at `pos` of `s`, as protobuf reads one (at most 10 bytes, bits past the 64th
-- dropped): its value, exact below 2^53 and TWO_53 for any larger one (a key that large is refused,
-- a length that large runs past any message), and the position after it; nil when unterminated.
local function varint(s, pos)
  local value, scale, big = 0, 1, false
  for i = 0, 9 do
    local b = s:byte(pos + i)
    if b == nil then return nil end
    local bits = b % 128
    if i < 7 then
      value = value + bits * scale
    elseif i == 7 then -- bits 49 to 55: those from 53 on make it too large
      value = value + bits % 16 * scale
      big = big or bits >= 16
    elseif i == 8 then
      big = big or bits > 0
    else -- only bit 63 is left inside 64 bits
      big = big or bits % 2 == 1
    end
    if b < 128 then return big and TWO_53 or value, pos + i + 1 end
    scale = scale * 128
  end
  return nil
end

-- The varint encoding of `n` (below 2^53).
local function encode(n)
  local out = {}
  while n >= 128 do
    out[#out + 1] = string.char(n % 128 + 128)
    n = math.floor(n / 128)
  end
  out[#out + 1] = string.char(n)
  return table.concat(out)
end

-- The field at `pos` of a message in s[.. last]: its number, wire type, value (a varint's number; a
-- fixed or length-delimited field's first byte) and the position after it; nil when it cannot be
-- read. A group is read to its end tag and skipped; an end tag is returned as wire type 4 for the
-- group that reads it.
local function field(s, pos, last, depth)
  local tag, at = varint(s, pos)
  if tag == nil or at > last + 1 or tag < 8 or tag >= TWO_32 then return nil end
  local number, wire = math.floor(tag / 8), tag % 8
  if wire == 0 then
    local value, after = varint(s, at)
    if value == nil or after > last + 1 then return nil end
    return number, 0, value, after
  elseif wire == 2 then
    local n, start = varint(s, at)
    if n == nil or start + n > last + 1 then return nil end
    return number, 2, start, start + n
  elseif wire == 1 or wire == 5 then
    local after = at + (wire == 1 and 8 or 4)
    if after > last + 1 then return nil end
    return number, wire, at, after
  elseif wire == 3 then
    if depth >= MAX_GROUP_DEPTH then return nil end
    local pos_in = at
    while true do
      local inner, inner_wire, _, after = field(s, pos_in, last, depth + 1)
      if inner == nil then return nil end
      if inner_wire == 4 then
        if inner ~= number then return nil end
        return number, 3, at, after
      end
      pos_in = after
    end
  elseif wire == 4 then
    return number, 4, nil, at
  end
  return nil
end

-- An InferParameter's bytes as an arm key: its value (a string's bytes, or an integer's decimal
-- digits from 0 to 2^53 - 1) or nil and true (another kind, or none), and whether it reads.
local function key_value(s)
  local value, bad = nil, true
  local pos, last = 1, #s
  while pos <= last do
    local number, wire, at, after = field(s, pos, last, 0)
    if number == nil or wire == 4 then return nil, false, false end
    if (number == 1 and wire == 0) or (number == 4 and wire == 1) then -- bool, double
      value, bad = nil, true
    elseif (number == 2 or number == 5) and wire == 0 then -- int64, uint64
      if at < TWO_53 then value, bad = string.format("%.0f", at), false else value, bad = nil, true end
    elseif number == 3 and wire == 2 then -- string
      value, bad = s:sub(at, after - 1), false
    end
    pos = after
  end
  return value, bad, true
end

-- One entry of the parameters map (1: key, 2: InferParameter) in s[pos .. last]: whether it reads,
-- its key, and its value's bytes (nil: absent; a value given twice is one message, merged).
local function entry(s, pos, last)
  local key, parts = "", nil
  while pos <= last do
    local number, wire, at, after = field(s, pos, last, 0)
    if number == nil or wire == 4 then return false end
    if number == 1 and wire == 2 then
      key = s:sub(at, after - 1)
    elseif number == 2 and wire == 2 then
      parts = parts or {}
      parts[#parts + 1] = s:sub(at, after - 1)
    end
    pos = after
  end
  return true, key, parts and table.concat(parts)
end

-- What the gateway reads of a gRPC ModelInfer request `frame` (its 5-byte prefix, then the message):
-- the model's name, whether the request names a version, and with `wanted`, that parameter's value
-- (nil: absent; nil and true: of a kind that cannot be a key). A frame it cannot read gives nil,
-- false, nil, false.
local function read_request(frame, wanted)
  local size = #frame
  if size < 5 then return nil, false, nil, false end
  local flag, b1, b2, b3, b4 = frame:byte(1, 5)
  if flag ~= 0 or ((b1 * 256 + b2) * 256 + b3) * 256 + b4 ~= size - 5 then return nil, false, nil, false end
  local name, named, value, bad = "", false, nil, false
  local pos = 6
  while pos <= size do
    local number, wire, at, after = field(frame, pos, size, 0)
    if number == nil or wire == 4 then return nil, false, nil, false end
    if wire == 2 and number == 1 then
      name = frame:sub(at, after - 1)
    elseif wire == 2 and number == 2 then
      named = after > at
    elseif wire == 2 and number == 4 and wanted ~= nil then
      local reads, key, parameter = entry(frame, at, after - 1)
      if not reads then return nil, false, nil, false end
      if key == wanted then
        local readable
        value, bad, readable = key_value(parameter or "")
        if not readable then return nil, false, nil, false end
      end
    end
    pos = after
  end
  return name, named, value, bad
end

-- `frame` with `release` appended as field 2 (model_version: the last occurrence counts), its
-- prefix's length updated.
local function with_version(frame, release)
  local message = frame:sub(6) .. string.char(18) .. encode(#release) .. release
  local m = #message
  return string.char(0, math.floor(m / 16777216) % 256, math.floor(m / 65536) % 256, math.floor(m / 256) % 256,
                     m % 256) .. message
end

local function envoy_on_request(handle)
  local wanted = arm.key_wanted(handle)
  local release = nil
  if wanted == nil then
    release = arm.arm_of(handle, nil)
    if release == nil then return end
  end
  local body = handle:body()
  local size = body and body:length() or 0
  local frame = size >= 5 and body:getBytes(0, size) or ""
  local name, named, value, bad = read_request(frame, wanted)
  if wanted ~= nil then
    if bad then
      handle:respond({[":status"] = "200", ["content-type"] = "application/grpc", ["grpc-status"] = "3",
                      ["grpc-message"] = "refused at the gateway: " .. string.format(arm.KEY_PROBLEM, wanted)}, "")
      return
    end
    release = arm.arm_of(handle, value)
  end
  if name ~= RANKER or named or release == nil then return end
  local pinned = with_version(frame, release)
  body:setBytes(pinned)
  if handle:headers():get("content-length") ~= nil then
    handle:headers():replace("content-length", tostring(#pinned))
  end
end

return {varint = varint, encode = encode, field = field, key_value = key_value, entry = entry,
        read_request = read_request, with_version = with_version, envoy_on_request = envoy_on_request}
