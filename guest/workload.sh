#!/bin/sh
# Guest workloads. Each prints "TANDEM-READY workload=NAME" once it is running.
wl=$1
ready() { echo "TANDEM-READY workload=$wl"; }
case "$wl" in
  idle)
    ready ;;
  memtouch)
    # 64 MiB buffer, 256 pages every 20 ms, known pattern (see guest/memtouch.c)
    exec /usr/lib/tandem/memtouch 64 256 20 ;;
  memheavy)
    # A large, busy guest (issue 39; give it >= 2 GiB): 1 GiB buffer, 2048 pages every 10 ms
    exec /usr/lib/tandem/memtouch 1024 2048 10 ;;
  kvheavy)
    # A large, busy guest that also serves requests (issue 39; give it >= 2 GiB): redis as
    # in kv, and beside it a 1 GiB buffer rewritten at 512 pages every 10 ms (2 048, as
    # memheavy, leaves the guest deaf to its network under TCG).
    # redis starts once the buffer is allocated and being rewritten (its ready line).
    /usr/lib/tandem/memtouch 1024 512 10 >/tmp/memtouch.log 2>&1 &
    i=0
    while ! grep -q TANDEM-READY /tmp/memtouch.log 2>/dev/null && [ $i -lt 1200 ]; do
      sleep 0.1; i=$((i+1))
    done
    exec /usr/lib/tandem/workload.sh kv ;;
  kv)
    # With a data disk, redis also keeps an append-only file there (disk writes every second).
    aof="--appendonly no"
    # (rewritten when it reaches 16 MiB, so a long run does not fill the 64 MiB disk).
    grep -q " /data " /proc/mounts && aof="--appendonly yes --appendfsync everysec --dir /data --auto-aof-rewrite-min-size 16mb"
    redis-server --bind 0.0.0.0 --port 6379 --protected-mode no --save "" $aof \
      --maxmemory 64mb --maxmemory-policy allkeys-lru --logfile /tmp/redis.log --daemonize no &
    i=0
    while ! grep -q ':18EB 00000000:0000 0A' /proc/net/tcp 2>/dev/null && [ $i -lt 600 ]; do
      sleep 0.1; i=$((i+1))
    done
    ready ;;
  disk)
    # Sequential writes to the data disk, each round fsynced: MB/s per round (needs /data).
    ready
    n=0
    while :; do
      t0=$(cut -d' ' -f1 /proc/uptime)
      dd if=/dev/zero of=/data/disk.bin bs=1M count=16 conv=fsync 2>/dev/null
      t1=$(cut -d' ' -f1 /proc/uptime)
      n=$((n+1))
      echo "disk mbps=$(awk "BEGIN{printf \"%.1f\", 16/($t1-$t0+0.001)}") rounds=$n"
    done ;;
  sqlite)
    db=/tmp/bench.db
    sqlite3 "$db" "PRAGMA journal_mode=WAL; CREATE TABLE kv(k INTEGER PRIMARY KEY, v TEXT, n INTEGER); CREATE INDEX kv_n ON kv(n);" >/dev/null
    ready
    n=0
    while :; do
      sqlite3 "$db" "BEGIN;
        INSERT OR REPLACE INTO kv(k, v, n)
          WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 400)
          SELECT abs(random()) % 20000, hex(randomblob(48)), $n FROM c;
        UPDATE kv SET n = n + 1 WHERE k % 7 = $((n % 7));
        DELETE FROM kv WHERE k % 13 = $((n % 13)) AND n < $n - 5;
        COMMIT;
        SELECT count(*), sum(n) FROM kv;" > /tmp/sqlite.out
      n=$((n+1))
      [ $((n % 10)) -eq 0 ] && echo "sqlite txns=$n rows=$(cut -d'|' -f1 /tmp/sqlite.out)"
    done ;;
  compile)
    rm -rf /tmp/build && cp -r /usr/src /tmp/build && cd /tmp/build || exit 1
    # A compiler wrapper counts compiled objects (the workload's throughput unit).
    printf '#!/bin/sh\ngcc "$@" || exit 1\nn=$(( $(cat /tmp/objs 2>/dev/null || echo 0) + 1 ))\necho $n > /tmp/objs\necho "compile objs=$n" >/dev/console\nexit 0\n' > /tmp/cc
    chmod +x /tmp/cc
    ready
    n=0
    while :; do
      make -s clean >/dev/null 2>&1
      if make -s CC=/tmp/cc >/tmp/make.log 2>&1; then
        n=$((n+1)); echo "compile rounds=$n $(./luarun)"
      else
        echo "TANDEM-ERROR compile failed"; tail -5 /tmp/make.log; sleep 5
      fi
    done ;;
  luatext)
    # An interpreted-language text-processing job: log lines parsed into hash tables, sorted,
    # reported and compressed each round (guest/luatext.lua).
    ready
    exec /usr/lib/tandem/luaexec /usr/lib/tandem/luatext.lua ;;
  luagc)
    # A garbage-collected runtime churning its heap (guest/luagc.lua).
    ready
    exec /usr/lib/tandem/luaexec /usr/lib/tandem/luagc.lua ;;
  alloc)
    # A memory-churning allocator test (guest/allocchurn.c; it prints the ready line).
    exec /usr/lib/tandem/allocchurn ;;
  awktext)
    # Log aggregation with awk, sort and uniq: a log generated, counted by path and status,
    # the top lines sorted and the report compressed, each round.
    ready
    n=0
    while :; do
      awk -v seed=$n 'BEGIN { srand(seed); for (i = 0; i < 20000; i++)
        printf "10.0.%d.%d - - [27/Nov/2026] \"GET /item/%d HTTP/1.1\" %d %d\n",
          int(rand()*8), int(rand()*250), int(rand()*700), (rand() < 0.9 ? 200 : 404), int(rand()*90000) }' >/tmp/access.log
      awk '{ hits[$7]++; bytes[$7] += $10; st[$9]++ } END { for (p in hits) print hits[p], bytes[p], p; for (s in st) print "status", s, st[s] }' \
        /tmp/access.log | sort -rn | gzip -1 >/tmp/report.gz
      cut -d' ' -f1 /tmp/access.log | sort | uniq -c | sort -rn | head -50 >/tmp/clients.txt
      n=$((n+1))
      echo "awktext rounds=$n"
    done ;;
  archive)
    # Compression and archiving: the apps disk's sources packed with tar and gzip, unpacked
    # and compared, each round.
    ready
    n=0
    while :; do
      tar -C /usr/src -cf - . | gzip -6 >/tmp/src.tar.gz
      rm -rf /tmp/unpacked && mkdir -p /tmp/unpacked
      gzip -dc /tmp/src.tar.gz | tar -C /tmp/unpacked -xf -
      n=$((n+1))
      echo "archive rounds=$n bytes=$(wc -c </tmp/src.tar.gz)"
    done ;;
  httpd)
    # A web server under load: busybox httpd serving 300 files of 2-60 KiB, four clients in
    # the guest fetching them in a loop.
    mkdir -p /tmp/www
    i=0
    while [ $i -lt 300 ]; do
      head -c $(( (i * 7919) % 59000 + 2048 )) /dev/urandom >/tmp/www/f$i
      i=$((i+1))
    done
    ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up
    httpd -p 127.0.0.1:8080 -h /tmp/www
    ready
    for c in 1 2 3; do
      ( while :; do wget -q -O /dev/null "http://127.0.0.1:8080/f$((RANDOM % 300))"; done ) &
    done
    n=0
    while :; do
      wget -q -O /dev/null "http://127.0.0.1:8080/f$((RANDOM % 300))"
      n=$((n+1))
      [ $((n % 200)) -eq 0 ] && echo "httpd gets=$n"
    done ;;
  *)
    echo "TANDEM-ERROR unknown workload $wl" ;;
esac
