-- A pyperformance-style workload for the Lua 5.4 interpreter (lua.c/onelua.c from the PyPI
-- sdist of `lupa`, built by scripts/fetch-programs.sh): tables, strings, closures, recursion,
-- sorting. No coroutines or caught errors (this build aborts on a Lua error: WASI p1 has no
-- setjmp). usage: lua bench.lua [steps]
local steps = tonumber(arg and arg[1]) or 6

local function fib(n) if n < 2 then return n end return fib(n - 1) + fib(n - 2) end

local function checksum(s)
  local h = 2166136261
  for i = 1, #s do h = ((h ~ s:byte(i)) * 16777619) & 0xffffffff end
  return h
end

local words = {"ferry", "snapshot", "resume", "memory", "stack", "frame", "wasm", "engine"}
local seed = 12345
local function rand(n)
  seed = (seed * 1103515245 + 12345) & 0x7fffffff
  return seed % n
end

for step = 1, steps do
  -- tables and closures
  local counts, adders = {}, {}
  for i = 1, 20 do adders[i] = function(x) return x + i end end
  for i = 1, 200000 do
    local w = words[rand(#words) + 1]
    counts[w] = adders[(i % 20) + 1](counts[w] or 0)
  end
  -- strings
  local parts = {}
  for i = 1, 20000 do parts[#parts + 1] = string.format("%s-%d", words[(i % #words) + 1], i * step) end
  local joined = table.concat(parts, ",")
  local upper = joined:upper():gsub("FERRY", "ferry")
  -- sorting
  local nums = {}
  for i = 1, 50000 do nums[i] = rand(1000000) end
  table.sort(nums)
  -- recursion
  local f = fib(20 + step % 3)
  local keys = {}
  for k, v in pairs(counts) do keys[#keys + 1] = k .. "=" .. v end
  table.sort(keys)
  print(string.format("step %d fib %d min %d max %d len %d sum %08x counts %s", step, f, nums[1],
    nums[#nums], #upper, checksum(upper), table.concat(keys, " ")))
end
print("done")
