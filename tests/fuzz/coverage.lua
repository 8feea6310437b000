-- Line coverage of the gateway's Lua while the fuzzer runs: a line hook records the lines run in each
-- file, and the lines that hold code are the active lines of every function reachable from a file's
-- returned table (its own functions, and the local ones they call, through their upvalues).
local hit = {}

local function start()
  debug.sethook(function(_, line)
    local source = debug.getinfo(2, "S").source
    local lines = hit[source]
    if lines == nil then
      lines = {}
      hit[source] = lines
    end
    lines[line] = true
  end, "l")
end

local function stop()
  debug.sethook()
end

-- source -> {line = true} of the code reachable from `roots` (tables or functions)
local function code_lines(roots)
  local code, seen = {}, {}
  local function visit(value)
    if seen[value] then return end
    local kind = type(value)
    if kind == "table" then
      seen[value] = true
      for _, item in pairs(value) do visit(item) end
    elseif kind == "function" then
      seen[value] = true
      local info = debug.getinfo(value, "SL")
      if info.what == "Lua" and info.activelines then
        code[info.source] = code[info.source] or {}
        for line in pairs(info.activelines) do code[info.source][line] = true end
      end
      local i = 1
      while true do
        local name, upvalue = debug.getupvalue(value, i)
        if name == nil then break end
        visit(upvalue)
        i = i + 1
      end
    end
  end
  for _, root in ipairs(roots) do visit(root) end
  return code
end

-- {source, lines of code, lines run, the lines not run (a sorted list)} for each file reachable from `roots`
local function report(roots)
  local rows = {}
  for source, lines in pairs(code_lines(roots)) do
    local total, run, missed = 0, 0, {}
    for line in pairs(lines) do
      total = total + 1
      if hit[source] and hit[source][line] then run = run + 1 else missed[#missed + 1] = line end
    end
    table.sort(missed)
    rows[#rows + 1] = {source, total, run, missed}
  end
  table.sort(rows, function(a, b) return a[1] < b[1] end)
  return rows
end

return {start = start, stop = stop, report = report}
