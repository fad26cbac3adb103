# The two-host half of dist/deb/test-systemd.sh (sourced by it: its hosts, `on`, `boot`,
# `halt`, `say`, `fail`): VM 2 on host-a and host-b, each host's unit tandem@web2 configured
# by the same /etc/tandem/web2.toml. See test-systemd.sh's head for the steps.

say "both hosts, OPERATIONS.md: the same /etc/tandem/web2.toml on each; the VM runs already"
inside env etcd="$etcd" net="$net" sh -euc '
  cat > /etc/tandem/web2.vm.toml <<EOF
mem = 256
ready = "TANDEM-READY"
shutdown_timeout_s = 5
# started by hand with plain -m RAM (tandem vm qemu-command)
ram_block = "pc.ram"
[boot]
kernel = "/var/lib/tandem-guest/vmlinuz"
initrd = "/var/lib/tandem-guest/initramfs.cpio.gz"
cmdline = "console=ttyS0 quiet panic=-1 tandem.workload=idle"
[[disk]]
path = "/var/lib/tandem-guest/apps.img"
format = "raw"
readonly = true
EOF
  cat > /etc/tandem/web2.toml <<EOF
vm_id = 2
primary = "host-a"
vm_config = "/etc/tandem/web2.vm.toml"
[nodes]
host-a = "$net.1:7100"
host-b = "$net.2:7100"
[paths]
mirror_dir = "/dev/shm/tandem-web2"
state_dir = "/var/lib/tandem/web2"
[adopt]
qmp = "/run/web2-by-hand/qmp.sock"
[fencing]
etcd = ["$etcd"]
[replication]
timeout_ms = 500
epoch_ms = 100
[control]
socket = "/run/tandem/web2.sock"
EOF'
# The same files on host-b (as an operator copies them).
for f in web2.toml web2.vm.toml; do
  inside cat "/etc/tandem/$f" | on b sh -c "mkdir -p /etc/tandem && cat > /etc/tandem/$f"
done
# The VM as a person started it on host-a, before tandem: a plain QEMU under systemd.
inside sh -euc '
  mkdir -p /run/web2-by-hand
  cmd=$(tandem vm qemu-command --vm-config /etc/tandem/web2.vm.toml \
    --qmp /run/web2-by-hand/qmp.sock --serial /run/web2-by-hand/console.log)
  systemd-run --quiet --unit=web2-by-hand --collect sh -c "exec $cmd"
' >&2 || fail "cannot start the VM by hand on host-a"
for _ in $(seq 600); do
  inside grep -q TANDEM-READY /run/web2-by-hand/console.log 2>/dev/null && break
  sleep 0.2
done
inside grep -q TANDEM-READY /run/web2-by-hand/console.log ||
  { inside systemctl status web2-by-hand >&2 || true; fail "the VM started by hand on host-a did not boot"; }

# etcd's record of VM 2 (JSON), its generation and its session.
record() { on b tandem fence show --etcd http://127.0.0.1:2379 --vm-id 2 --json 2>/dev/null || true; }
gen() { record | grep -o '"gen": [0-9]*' | grep -o '[0-9]*$'; }
session() { record | grep -o '"session": "[0-9a-f]*"' | grep -o '[0-9a-f]\{16\}' || true; }
journals() {
  for h in a b; do
    echo "--- host-$h" >&2
    on "$h" journalctl -u tandem@web2 --no-pager -n 40 -o cat >&2 || true
  done
}
# Until etcd's record of VM 2 says STATE on NODE.
wait_record() {
  local state=$1 node=$2 r=
  for _ in $(seq 600); do
    r=$(record)
    if printf '%s' "$r" | grep -q "\"state\": \"$state\"" &&
       printf '%s' "$r" | grep -q "\"node\": \"$node\""; then
      return 0
    fi
    sleep 0.2
  done
  journals
  fail "etcd's record of VM 2 is not '$state' on $node after 120 s: $r"
}
status_of() { on "$1" tandem status --socket /run/tandem/web2.sock --json 2>/dev/null || true; }
# Until host H, the backup, says it can take the guest over (it committed an epoch of the
# current session: etcd's record names the session from its start, before that).
wait_backup() {
  local st=
  for _ in $(seq 600); do
    st=$(status_of "$1")
    printf '%s' "$st" | grep -q '"state": "protecting:' && return 0
    sleep 0.2
  done
  journals
  fail "host-$1 is not a backup ready to take the guest over after 120 s: $st"
}
say "the guest runs (started by hand); enable --now tandem@web2 on both hosts: host-a adopts it"
on b systemctl enable --now tandem@web2 2>/dev/null
inside systemctl enable --now tandem@web2 2>/dev/null
wait_record protected host-a
inside journalctl -u tandem@web2 --no-pager -o cat | grep -q 'adopts the running guest' ||
  { journals; fail "host-a did not adopt the running VM"; }
for _ in $(seq 100); do inside systemctl is-active --quiet web2-by-hand || break; sleep 0.2; done
inside systemctl is-active --quiet web2-by-hand && fail "the QEMU started by hand still runs after the adoption"
say "adopted and protected on host-a (generation $(gen)), the QEMU started by hand gone; systemctl restart on host-a hands it over"
# At once: a restart during the initial copy finishes it and then hands the guest over.
inside systemctl restart tandem@web2
wait_record protected host-b
wait_backup a

say "protected on host-b, host-a its backup; tandem switchover on host-b hands it back"
on b tandem switchover --vm-id 2 --socket /run/tandem/web2.sock >&2 ||
  { journals; fail "tandem switchover on host-b failed"; }
wait_record protected host-a
wait_backup b

say "protected on host-a (generation $(gen)); host-a is lost: its link cut, every process killed"
g=$(gen)
ip -n "${ns[a]}" link set "${ifname[a]}" down
kill -KILL "${leader[a]}"
wait "${nspawn[a]}" 2>/dev/null || true
nspawn[a]=
# host-b takes the guest over (one more generation) and runs it without a replica.
wait_record unprotected host-b
[ "$(gen)" -gt "$g" ] || fail "no takeover recorded after host-a was lost: $(record)"
on b systemctl is-active --quiet tandem@web2 || fail "tandem@web2 on host-b is not active after the failover"
say "host-b runs the guest (generation $(gen)), unprotected; host-a boots again"
ip -n "${ns[a]}" link set "${ifname[a]}" up
boot a
# Its unit starts at boot (enabled) and serves as the backup; host-b protects the guest onto it.
wait_record protected host-b
wait_backup a
say "host-a serves as the backup from boot, the guest protected again on host-b"

say "SIGKILL to host-b's daemon"
g=$(gen)
on b systemctl kill --kill-who=main -s SIGKILL tandem@web2
# host-a fails over (a takeover: one more generation), systemd restarts host-b's unit
# (Restart=on-failure) and it comes back as the backup: protected again on host-a.
wait_record protected host-a
wait_backup b
[ "$(gen)" -gt "$g" ] || fail "no takeover recorded after the SIGKILL (generation $(gen))"
on b systemctl is-active --quiet tandem@web2 || fail "systemd did not restart tandem@web2 on host-b"
n=$(on b systemctl show -p NRestarts --value tandem@web2)
[ "$n" -ge 1 ] || fail "tandem@web2 on host-b was not restarted by systemd (NRestarts=$n)"
say "failed over to host-a (generation $(gen)); host-b restarted by systemd ($n restart), its backup again"

# The node running the guest dies while its backup still receives the first copy: the backup
# cannot take over, and the restarted node must not wait as a backup forever (nor boot a
# fresh guest): it exits 3 and a human decides. host-a's link to host-b's replication port is
# slowed to 1 Mbit/s so that the copy is still running.
s0=$(session)
ip netns exec "${ns[a]}" sh -euc "
  tc qdisc add dev ${ifname[a]} root handle 1: htb
  tc class add dev ${ifname[a]} parent 1: classid 1:10 htb rate 1mbit
  tc filter add dev ${ifname[a]} parent 1: protocol ip u32 \
    match ip dst ${addr[b]}/32 match ip dport 7100 0xffff flowid 1:10
" || fail "cannot slow the replication link with tc (htb, u32)"
say "restart host-b's unit (the backup): host-a copies the guest to it anew, slowly"
on b systemctl restart tandem@web2
for _ in $(seq 600); do
  s1=$(session)
  [ -n "$s1" ] && [ "$s1" != "$s0" ] && break
  sleep 0.2
done
[ -n "$s1" ] && [ "$s1" != "$s0" ] || fail "host-a did not begin a new session with host-b: $(record)"
st=$(status_of b)
printf '%s' "$st" | grep -q '"state": "protecting:' && fail "host-b committed an epoch of the slowed copy already: $st"
g=$(gen)
say "session $s1 recorded, host-b still copying; SIGKILL to host-a's daemon"
inside systemctl kill --kill-who=main -s SIGKILL tandem@web2
# systemd restarts it (5 s); it waits for a takeover that cannot come (10 s), then exits 3.
for _ in $(seq 300); do
  inside systemctl is-failed --quiet tandem@web2 && break
  sleep 0.2
done
inside systemctl is-failed --quiet tandem@web2 ||
  { journals; fail "tandem@web2 on host-a did not stop with a refusal after dying during the first copy"; }
code=$(inside systemctl show -p ExecMainStatus --value tandem@web2)
[ "$code" = 3 ] || fail "tandem@web2 on host-a exited with status $code, not 3"
inside journalctl -u tandem@web2 --no-pager -o cat | grep 'did not take the guest over' | tail -1 >&2 ||
  fail "the journal of tandem@web2 on host-a does not say why it refused"
on b systemctl is-active --quiet tandem@web2 || fail "tandem@web2 on host-b (the backup) ended"
[ "$(gen)" = "$g" ] || fail "the record changed although nobody could take over: $(record)"
say "host-a refused with status 3 (nobody runs the guest); the operator declares it gone and starts host-a"
ip netns exec "${ns[a]}" tc qdisc del dev "${ifname[a]}" root
inside tandem fence stop --etcd "$etcd" --vm-id 2 --generation "$g" >&2
inside systemctl start tandem@web2
wait_record protected host-a
wait_backup b
say "host-a runs the guest again (generation $(gen)), host-b its backup"
# tandem list (from either host) says so once the daemons' reports (every 2 s) caught up:
# every VM of the cluster from etcd.
listed() {
  on b tandem list --etcd http://127.0.0.1:2379 --json | python3 -c '
import json, sys
vm = {d["vm_id"]: d for d in json.load(sys.stdin)}
assert vm[1]["runs_on"] is None, vm[1]
assert (vm[2]["runs_on"], vm[2]["backup"], vm[2]["protected"]) == ("host-a", "host-b", True), vm[2]
' 2>"${log[a]}.list"
}
for _ in $(seq 50); do listed && break; sleep 0.2; done
listed || { cat "${log[a]}.list" >&2; fail "tandem list does not show VM 2 protected on host-a with host-b its backup"; }
rm -f "${log[a]}.list"
inside tandem list --etcd "$etcd" >&2
on b systemctl stop tandem@web2
inside systemctl stop tandem@web2
