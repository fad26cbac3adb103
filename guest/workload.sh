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
  *)
    echo "TANDEM-ERROR unknown workload $wl" ;;
esac
