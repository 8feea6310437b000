-- The HTTP listener's Lua filter.
--
-- On the way in: the JSON a POST carries (the whole body, or the first Inference-Header-Content-Length
-- bytes of a binary request, that header read as Triton reads it) nested deeper than
-- CONFIG.max_json_depth is refused with 400 before Triton parses it: Triton 2.51's JSON parser
-- recurses once per level, and a deep enough body kills tritonserver. A first pass counts opening
-- brackets (a C search, no per-byte Lua); only a body with more than the limit is walked bracket by
-- bracket, strings skipped. When the arm key is to be read from a parameter (arm.key_wanted), the
-- same JSON's top-level "parameters" object gives it: a string's text (JSON escapes decoded, so the
-- value is the bytes gRPC would carry) or an unsigned integer's digits, the last member of a name
-- counting (as Python's json and protobuf read them); a parameter of another kind is refused (400).
--
-- On the way out: Triton 2.51 answers JSON it cannot parse, or a field it cannot read (a negative
-- shape or timeout, or "parameters" that is no object), with 500; those are the client's errors,
-- answered 400 (only a 500's body is read).
--
-- tests/fuzz/lua.py holds the depth walker, the string decoder and the key walker to Python's own
-- reading of the same bytes.
--
-- The file is a chunk: `...` is CONFIG (max_json_depth) and arm.lua's functions; it returns its
-- functions.
local CONFIG, arm = ...
local MAX_DEPTH = CONFIG.max_json_depth
local TWO_53 = 9007199254740992
local MARKS = {"failed to parse the request JSON", "Unable to parse '", "attempt to get members for non-object"}

-- Whether the JSON text `s` (any bytes) opens more than MAX_DEPTH arrays and objects inside one
-- another anywhere, strings skipped: whatever a parser would descend into before its first error.
local function too_deep(s)
  local pos, opens = 1, 0
  while true do
    pos = string.find(s, "[%[{]", pos)
    if pos == nil then return false end
    opens = opens + 1
    if opens > MAX_DEPTH then break end
    pos = pos + 1
  end
  local depth = 0
  pos = 1
  while true do
    pos = string.find(s, '[%[%]{}"]', pos)
    if pos == nil then return false end
    local c = string.byte(s, pos)
    if c == 34 then
      local i = pos + 1
      while true do
        i = string.find(s, '["\\]', i)
        if i == nil then return false end
        if string.byte(s, i) == 92 then i = i + 2 else break end
      end
      pos = i + 1
    else
      if c == 91 or c == 123 then
        depth = depth + 1
        if depth > MAX_DEPTH then return true end
      else
        depth = depth - 1
      end
      pos = pos + 1
    end
  end
end

local ESCAPES = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}

-- The UTF-8 bytes of code point `c` (a lone surrogate too, as a JSON \u escape may name one).
local function utf8_char(c)
  if c < 128 then return string.char(c) end
  if c < 2048 then return string.char(192 + math.floor(c / 64), 128 + c % 64) end
  if c < 65536 then return string.char(224 + math.floor(c / 4096), 128 + math.floor(c / 64) % 64, 128 + c % 64) end
  return string.char(240 + math.floor(c / 262144), 128 + math.floor(c / 4096) % 64, 128 + math.floor(c / 64) % 64,
                     128 + c % 64)
end

-- The JSON string that opens at `pos`: its text, escapes decoded (other bytes as they are), and the
-- position after it; nil when it is unterminated or holds an escape JSON does not have.
local function json_string(s, pos)
  local parts, i = {}, pos + 1
  while true do
    local j = string.find(s, '["\\]', i)
    if j == nil then return nil end
    parts[#parts + 1] = string.sub(s, i, j - 1)
    if string.byte(s, j) == 34 then return table.concat(parts), j + 1 end
    local e = string.sub(s, j + 1, j + 1)
    if e == "u" then
      local c = string.match(s, "^%x%x%x%x", j + 2)
      if c == nil then return nil end
      c, i = tonumber(c, 16), j + 6
      local low = string.match(s, "^\\u(%x%x%x%x)", i)
      low = low and tonumber(low, 16)
      if c >= 55296 and c < 56320 and low and low >= 56320 and low < 57344 then
        c, i = 65536 + (c - 55296) * 1024 + (low - 56320), i + 6
      end
      parts[#parts + 1] = utf8_char(c)
    else
      if ESCAPES[e] == nil then return nil end
      parts[#parts + 1], i = ESCAPES[e], j + 2
    end
  end
end

-- The closing quote's position of the JSON string that opens at `pos` (nil: unterminated).
local function string_end(s, pos)
  local close = pos + 1
  while true do
    close = string.find(s, '["\\]', close)
    if close == nil then return nil end
    if string.byte(s, close) ~= 92 then return close end
    close = close + 2
  end
end

-- The JSON value at `at` as an arm key: a string's text or an integer's digits from 0 to 2^53 - 1
-- (-0 is 0); nil and true for any other kind (nil alone: a string that does not read).
local function key_of(s, at)
  if string.byte(s, at) == 34 then return json_string(s, at), false end
  local minus, digits = string.match(s, "^(%-?)(%d+)%s*[,}]", at)
  local n = digits and tonumber(digits)
  if n ~= nil and n < TWO_53 and (minus == "" or n == 0) then return string.format("%.0f", n), false end
  return nil, true
end

-- The member `name` of the JSON object that opens at `open` (its last member of that name): its
-- value as an arm key (nil: absent; nil and true: a kind that cannot be a key), and the position
-- after the object (nil: unreadable). With `object`, instead where that member's value opens when it
-- is an object (nil: absent, or not an object). Strings are skipped by a C search each; a member
-- name's text is decoded only when it holds an escape.
local function json_member(s, open, name, object)
  local depth, pos, value, bad = 0, open, nil, false
  while true do
    pos = string.find(s, '[%[%]{}"]', pos)
    if pos == nil then return nil end
    local c = string.byte(s, pos)
    if c == 34 then
      local close = string_end(s, pos)
      if close == nil then return nil end
      if depth == 1 then
        local _, colon = string.find(s, "^%s*:%s*", close + 1)
        if colon ~= nil then
          local text = string.sub(s, pos + 1, close - 1)
          if string.find(text, "\\", 1, true) then text = json_string(s, pos) end
          if text == name and object then
            value = string.byte(s, colon + 1) == 123 and colon + 1 or nil
          elseif text == name then
            value, bad = key_of(s, colon + 1)
          end
        end
      end
      pos = close + 1
    else
      depth = (c == 91 or c == 123) and depth + 1 or depth - 1
      pos = pos + 1
      if depth == 0 then return value, bad, pos end
    end
  end
end

local function blank(b)
  return b == 32 or b == 9 or b == 10 or b == 13
end

-- The top-level parameter `name` of a v2 request's JSON: its value, or nil (absent, or JSON that does
-- not read: Triton answers that), or nil and true (a kind that cannot be a key). tritonclient writes
-- "parameters" last, so the last "parameters" is tried first: a member name there (after a comma or
-- the opening brace, so no string's text) whose object only the request's closing brace follows is
-- the top-level one, read alone. Otherwise the request is walked from its start (a text without
-- "parameters" is walked only when it holds an escape, which could spell that name).
local function json_parameter(s, name)
  local last, at = nil, 1
  while true do
    local i = string.find(s, '"parameters"', at, true)
    if i == nil then break end
    last, at = i, i + 12
  end
  if last ~= nil then
    local before = last - 1
    while blank(string.byte(s, before)) do before = before - 1 end
    local _, brace = string.find(s, "^%s*:%s*{", last + 12)
    if brace ~= nil and (string.byte(s, before) == 44 or string.byte(s, before) == 123) then
      local value, bad, after = json_member(s, brace, name)
      if after ~= nil and string.find(s, "^%s*}%s*$", after) then return value, bad end
    end
  elseif not string.find(s, "\\", 1, true) then
    return nil
  end
  local top = string.match(s, "^%s*(){")
  local open = top and json_member(s, top, "parameters", true)
  if open == nil then return nil end
  local value, bad = json_member(s, open, name)
  return value, bad
end

-- How many bytes of a POST body of `size` bytes Triton parses as JSON: the Inference-Header-Content-Length
-- `header` read as C's atoi reads it (as Triton does: blanks, a sign, decimal digits) when that is
-- from 1 to below the size; otherwise the whole body (for 0, a raw binary body, and a length Triton
-- refuses, reading all of it is the safe side).
local function json_length(size, header)
  local sign, digits = string.match(header or "", "^%s*([+-]?)(%d+)")
  local head = digits and sign ~= "-" and tonumber(digits)
  if head and head > 0 and head < size then return head end
  return size
end

-- What the gateway makes of a request's JSON `text`: the reason it is refused (nil: it is not), and
-- with `wanted`, the arm key parameter's value.
local function inspect(text, wanted)
  if too_deep(text) then return "JSON nested deeper than " .. MAX_DEPTH .. " levels" end
  if wanted == nil then return nil end
  local value, bad = json_parameter(text, wanted)
  if bad then return string.format(arm.KEY_PROBLEM, wanted) end
  return nil, value
end

-- Whether the start of a Triton 500's body says the client's JSON was at fault.
local function client_error(text)
  for _, mark in ipairs(MARKS) do
    if string.find(text, mark, 1, true) then return true end
  end
  return false
end

local function route(handle, value)
  local release = arm.arm_of(handle, value)
  if release ~= nil and handle:metadata():get("path") ~= nil then
    handle:headers():replace(":path", handle:metadata():get("path") .. release .. "/infer")
  end
end

local function envoy_on_request(handle)
  -- header values first: a header object is no longer valid once body() has waited for the body
  -- (headers fetched again after it can still be changed: they have not gone on yet)
  local wanted = arm.key_wanted(handle)
  if wanted == nil then route(handle, nil) end
  local post = handle:headers():get(":method") == "POST"
  local header = handle:headers():get("inference-header-content-length")
  local body = post and handle:body() or nil
  local size = body and body:length() or 0
  local length = json_length(size, header)
  local problem, value = inspect(length > 0 and body:getBytes(0, length) or "", wanted)
  if problem ~= nil then
    handle:respond({[":status"] = "400", ["content-type"] = "text/plain"}, "refused at the gateway: " .. problem .. "\n")
    return
  end
  if wanted ~= nil then route(handle, value) end
end

local function envoy_on_response(handle)
  if handle:headers():get(":status") ~= "500" then return end
  local body = handle:body()
  if body == nil then return end
  if client_error(body:getBytes(0, math.min(body:length(), 256))) then
    handle:headers():replace(":status", "400")
  end
end

return {too_deep = too_deep, utf8_char = utf8_char, json_string = json_string, string_end = string_end,
        json_member = json_member, json_parameter = json_parameter, json_length = json_length, inspect = inspect,
        client_error = client_error, envoy_on_request = envoy_on_request, envoy_on_response = envoy_on_response}
