-- luagc: a garbage-collected runtime churning its heap. A ring of objects (records with
-- strings, arrays and nested tables of random sizes) is replaced slot by slot, so the
-- collector frees and the allocator reuses memory all the time (about 40 MB live).
math.randomseed(41)
local SLOTS = 4000
local ring = {}
local function object(n)
  local o = { id = n, name = string.rep(string.char(97 + n % 26), 8 + n % 120), tags = {}, values = {} }
  for i = 1, math.random(1, 24) do o.tags[i] = "tag" .. (n * 31 + i) % 997 end
  for i = 1, math.random(16, 1200) do o.values[i] = (n * i) % 65521 + 0.5 end
  if n % 5 == 0 then o.child = { parent = n, blob = string.rep("x", math.random(64, 4096)) } end
  return o
end
for i = 1, SLOTS do ring[i] = object(i) end
local n, t0 = SLOTS, os.clock()
while true do
  for _ = 1, 2000 do
    n = n + 1
    ring[math.random(SLOTS)] = object(n)
  end
  if os.clock() - t0 >= 1 then
    t0 = os.clock()
    io.write(string.format("luagc objects=%d kb=%d\n", n, math.floor(collectgarbage("count"))))
    io.flush()
  end
end
