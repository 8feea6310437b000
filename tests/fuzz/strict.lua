-- Gives a chunk an environment in which it may read the standard globals but write none and read no
-- other: a missing `local` or a misspelt name fails where it happens, instead of reading nil or
-- leaking into the Lua state that Envoy shares between requests. The tests and the fuzzer load the
-- gateway's files this way.
return function(chunk)
  local env = setmetatable({}, {
    __index = function(_, name)
      local value = _G[name]
      if value == nil then error("read of undeclared global '" .. tostring(name) .. "'", 2) end
      return value
    end,
    __newindex = function(_, name)
      error("assignment to global '" .. tostring(name) .. "'", 2)
    end,
  })
  return setfenv(chunk, env)
end
