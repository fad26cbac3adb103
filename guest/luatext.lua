-- luatext: an interpreted-language text-processing job (issue 40's kind of workload). Each
-- round generates web-server log lines, parses them into hash tables, aggregates by path,
-- status and client, sorts, formats a report and compresses it with gzip.
math.randomseed(40)
local paths = {}
for i = 1, 600 do
  paths[i] = string.format("/shop/%s/item-%d.html", ({ "books", "music", "garden", "tools" })[i % 4 + 1], i)
end
local agents = { "Mozilla/5.0 (X11; Linux x86_64)", "curl/7.88.1", "Wget/1.21.3", "python-requests/2.28" }
local round = 0
while true do
  round = round + 1
  local lines = {}
  for i = 1, 12000 do
    local p = paths[math.random(#paths)]
    lines[i] = string.format('10.%d.%d.%d - - [27/Nov/2026:12:%02d:%02d +0000] "GET %s HTTP/1.1" %d %d "-" "%s"',
      math.random(0, 3), math.random(0, 255), math.random(1, 254), i % 60, round % 60, p,
      ({ 200, 200, 200, 304, 404, 500 })[math.random(6)], math.random(200, 90000), agents[math.random(#agents)])
  end
  local by_path, by_status, by_client, bytes = {}, {}, {}, 0
  for _, l in ipairs(lines) do
    local ip, path, status, size = l:match('^(%S+) %S+ %S+ %[.-%] "GET (%S+) [^"]*" (%d+) (%d+)')
    if ip then
      local e = by_path[path]
      if not e then
        e = { path = path, hits = 0, bytes = 0 }
        by_path[path] = e
      end
      e.hits = e.hits + 1
      e.bytes = e.bytes + tonumber(size)
      by_status[status] = (by_status[status] or 0) + 1
      by_client[ip] = (by_client[ip] or 0) + 1
      bytes = bytes + tonumber(size)
    end
  end
  local rows = {}
  for _, e in pairs(by_path) do rows[#rows + 1] = e end
  table.sort(rows, function(a, b) return a.hits > b.hits or (a.hits == b.hits and a.path < b.path) end)
  local out = {}
  for i, e in ipairs(rows) do
    out[i] = string.format("%6d %10d %s", e.hits, e.bytes, e.path)
  end
  for s, n in pairs(by_status) do out[#out + 1] = string.format("status %s %d", s, n) end
  local clients = 0
  for _ in pairs(by_client) do clients = clients + 1 end
  local gz = io.popen("gzip -1 > /tmp/report.gz", "w")
  gz:write(table.concat(lines, "\n"), "\n", table.concat(out, "\n"), "\n")
  gz:close()
  io.write(string.format("luatext rounds=%d clients=%d bytes=%d\n", round, clients, bytes))
  io.flush()
end
