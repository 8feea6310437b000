-- A stand-in for the `handle` Envoy's Lua filter passes to envoy_on_request and envoy_on_response,
-- with the calls the gateway's filters make (headers, metadata, body, respond) and a record of what
-- they did. It is a test harness, not Envoy: the filters also run in real Envoy in the integration
-- tests (tests/integration/test_door.py, test_experiments.py, test_fleet_release.py).
--
-- The chunk returns new(headers, metadata, body): `headers` a list of {name, value} pairs (names in
-- lower case, as Envoy gives them to Lua), `metadata` the route's filter metadata (a table of
-- strings), `body` the whole body or nil. The handle's `responded` is {headers, body} once the
-- filter answered itself.

local function header_map(pairs)
  local entries = {}
  for _, pair in ipairs(pairs) do entries[#entries + 1] = {pair[1], pair[2]} end
  local map = {entries = entries}
  -- Envoy joins the values of a repeated header with ","
  function map:get(name)
    local found = {}
    for _, e in ipairs(entries) do
      if e[1] == name then found[#found + 1] = e[2] end
    end
    if #found == 0 then return nil end
    return table.concat(found, ",")
  end
  function map:add(name, value)
    entries[#entries + 1] = {name, value}
  end
  function map:remove(name)
    for i = #entries, 1, -1 do
      if entries[i][1] == name then table.remove(entries, i) end
    end
  end
  function map:replace(name, value)
    for _, e in ipairs(entries) do
      if e[1] == name then
        e[2] = value
        return
      end
    end
    entries[#entries + 1] = {name, value}
  end
  return map
end

local function buffer(bytes)
  local b = {bytes = bytes}
  function b:length() return #self.bytes end
  -- Envoy's getBytes(index, length) reads from a zero-based index and refuses a range past the end
  function b:getBytes(index, length)
    index, length = math.floor(index), math.floor(length)
    if index < 0 or length < 0 or index + length > #self.bytes then error("index out of range") end
    return string.sub(self.bytes, index + 1, index + length)
  end
  function b:setBytes(new) self.bytes = new end
  return b
end

local function new(headers, metadata, body)
  local handle = {responded = nil, bodies_read = 0, headers_map = header_map(headers), body_buffer = nil}
  if body ~= nil then handle.body_buffer = buffer(body) end
  function handle:headers() return self.headers_map end
  function handle:metadata()
    return {get = function(_, key) return metadata[key] end}
  end
  function handle:body()
    self.bodies_read = self.bodies_read + 1
    return self.body_buffer
  end
  function handle:respond(answer_headers, answer_body)
    self.responded = {headers = answer_headers, body = answer_body}
  end
  return handle
end

return new
