#!/usr/bin/env bash
# OPERATIONS.md's "One unit per VM", followed under a real systemd:
#   dist/deb/test-systemd.sh ROOT GUEST_DIR
# ROOT is a Debian 12 root with the tandem package installed (dist/deb/test-install.sh makes
# it, with systemd, dbus and etcd-server). It boots under systemd-nspawn (its own network
# namespace: loopback only; etcd-server's own unit serves on localhost:2379), and there the
# runbook's commands run as an operator types them: the example configuration copied to
# /etc/tandem and edited (this host's node, a backup address nobody answers, the lab guest of
# GUEST_DIR (bound read-only) booted by its kernel, etcd without TLS), `tandem run --dry-run`, `systemctl
# daemon-reload`, `systemctl enable --now tandem@web1`. Then it checks what the runbook
# promises: the unit is active (READY=1 once the guest runs), `tandem status` answers on the
# unit's control socket, the journal carries the daemon's lines with priorities (`journalctl
# -p warning` finds the missing backup), `systemctl stop` shuts the guest down and etcd's
# record says stopped, and `systemctl start` runs it again. Then two nodes of one VM as two
# units: a restart of the running node hands the guest over, SIGKILL fails it over and systemd
# restarts the killed unit as the backup, and a SIGKILL during the backup's first copy ends in
# exit status 3 (nobody can take over) and the operator's override. Needs root. Prints its
# steps on stderr; exit status 0 when every check passes.
set -euo pipefail
root=$(realpath "${1:?usage: $0 ROOT GUEST_DIR}")
guest=$(realpath "${2:?usage: $0 ROOT GUEST_DIR}")
say() { printf '==> systemd: %s\n' "$*" >&2; }
fail() { echo "error: $*" >&2; exit 1; }
command -v systemd-nspawn >/dev/null || fail "systemd-nspawn is missing: run tandem-lab setup (systemd-container)"
[ -x "$root/lib/systemd/systemd" ] || fail "$root has no systemd (dist/deb/test-install.sh builds the root with it)"
for f in vmlinuz initramfs.cpio.gz; do
  [ -f "$guest/$f" ] || fail "$guest/$f missing: run tandem-lab setup (the lab guest)"
done

for f in apps.img; do
  [ -f "$guest/$f" ] || fail "$guest/$f missing: run tandem-lab setup (the lab guest)"
done

# A host's own names (debootstrap leaves /etc/hosts empty; etcd-server listens on localhost).
printf '127.0.0.1 localhost\n::1 localhost ip6-localhost\n' >"$root/etc/hosts"

machine=tandem-runbook-$$
log=$(mktemp /tmp/tandem-nspawn-XXXXXX.log)
say "booting the root under systemd-nspawn (log $log)"
# --keep-unit/--register=no: no host systemd or machined to talk to; userfaultfd for the
# dirty log (nspawn's default system-call filter leaves it out).
systemd-nspawn --quiet --keep-unit --register=no --private-network -M "$machine" \
  --system-call-filter=userfaultfd --bind-ro="$guest:/var/lib/tandem-guest" \
  -D "$root" --boot --console=pipe >"$log" 2>&1 &
nspawn=$!
cleanup() {
  kill -TERM "$nspawn" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "$nspawn" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "$nspawn" 2>/dev/null || true
  wait "$nspawn" 2>/dev/null || true
  rm -f "$log"
}
trap cleanup EXIT

# The container's PID 1 (systemd) is nspawn's child.
leader=
for _ in $(seq 100); do
  leader=$(pgrep -P "$nspawn" -x systemd || true)
  [ -n "$leader" ] && break
  sleep 0.2
done
[ -n "$leader" ] || { cat "$log" >&2; fail "systemd did not start in the container"; }
inside() { nsenter -t "$leader" -m -u -i -n -p -r -w -- "$@"; }
# Until systemd has booted (degraded is fine: a container lacks some hardware units).
for _ in $(seq 150); do
  state=$(inside systemctl is-system-running 2>/dev/null || true)
  case $state in running|degraded) break ;; esac
  sleep 0.2
done
case $state in running|degraded) ;; *) fail "systemd in the container did not finish booting (state: $state)" ;; esac
for _ in $(seq 50); do inside systemctl is-active --quiet etcd && break; sleep 0.2; done
inside systemctl is-active --quiet etcd || { inside systemctl status etcd >&2 || true; fail "etcd-server's unit is not active in the container"; }
say "systemd booted ($state); etcd active"

say "OPERATIONS.md, One unit per VM: config, dry run, daemon-reload, enable --now"
inside sh -euc '
  mkdir -p /etc/tandem
  cp /usr/share/doc/tandem/examples/tandem.toml.example /etc/tandem/web1.toml
  # edit: nodes, VM, etcd (as the example file says)
  cat > /etc/tandem/web1.toml <<EOF
vm_id = 1
primary = "host-a"
node = "host-a"
[nodes]
host-a = "127.0.0.1:7000"
host-b = "127.0.0.2:7000"
[paths]
mirror_dir = "/dev/shm/tandem-web1"
state_dir = "/var/lib/tandem/web1"
[vm]
mem = 256
ready = "TANDEM-READY"
shutdown_timeout_s = 5
[vm.boot]
kernel = "/var/lib/tandem-guest/vmlinuz"
initrd = "/var/lib/tandem-guest/initramfs.cpio.gz"
cmdline = "console=ttyS0 quiet panic=-1 tandem.workload=idle"
[[vm.disk]]
path = "/var/lib/tandem-guest/apps.img"
format = "raw"
readonly = true
[fencing]
etcd = ["http://127.0.0.1:2379"]
[replication]
timeout_ms = 500
epoch_ms = 100
[metrics]
listen = "127.0.0.1:9471"
[control]
socket = "/run/tandem/web1.sock"
EOF
  tandem run --config /etc/tandem/web1.toml --dry-run
  systemctl daemon-reload
  systemctl enable --now tandem@web1
' >&2 || fail "the runbook's commands failed"

say "the unit is active, tandem status answers"
inside systemctl is-active --quiet tandem@web1 ||
  { inside journalctl -u tandem@web1 --no-pager -n 50 >&2 || true; fail "tandem@web1 is not active after enable --now"; }
status=$(inside tandem status --socket /run/tandem/web1.sock --json) ||
  fail "tandem status on /run/tandem/web1.sock failed"
echo "$status" | grep -q '"role": *"primary"' || fail "tandem status does not say primary: $status"

say "journald: the daemon's lines, with priorities"
for _ in $(seq 50); do
  warnings=$(inside journalctl -u tandem@web1 -p warning --no-pager -o cat 2>/dev/null || true)
  [ -n "$warnings" ] && break
  sleep 0.2
done
[ -n "$warnings" ] || { inside journalctl -u tandem@web1 --no-pager -n 40 >&2 || true; fail "journalctl -p warning finds no line of tandem@web1 (the backup is unreachable)"; }
printf '%s\n' "$warnings" | head -3 >&2
inside journalctl -u tandem@web1 --no-pager -o cat | grep -q $'\e\[' && fail "ANSI escapes in the journal"

say "systemctl stop: the guest shut down, etcd's record stopped"
inside systemctl stop tandem@web1
record=$(inside tandem fence show --etcd http://127.0.0.1:2379 --vm-id 1 --json) ||
  fail "tandem fence show failed"
echo "$record" | grep -q '"stopped"' || fail "etcd's record is not stopped after systemctl stop: $record"

say "systemctl start: the node runs the guest again"
inside systemctl start tandem@web1
inside systemctl is-active --quiet tandem@web1 || fail "tandem@web1 did not start again"
inside systemctl stop tandem@web1

# Both roles under systemd: the two nodes of VM 2 are two units of this one container (their
# own files, directories, sockets and loopback addresses), as two hosts would run them.
say "two nodes (tandem@web2-a, tandem@web2-b): protect, restart the running node, SIGKILL it"
for n in a b; do
  inside sh -euc "
    cat > /etc/tandem/web2-$n.toml <<EOF
vm_id = 2
primary = \"host-a\"
node = \"host-$n\"
[nodes]
host-a = \"127.0.0.1:7100\"
host-b = \"127.0.0.2:7100\"
[paths]
mirror_dir = \"/dev/shm/tandem-web2-$n\"
state_dir = \"/var/lib/tandem/web2-$n\"
[vm]
mem = 256
ready = \"TANDEM-READY\"
shutdown_timeout_s = 5
[vm.boot]
kernel = \"/var/lib/tandem-guest/vmlinuz\"
initrd = \"/var/lib/tandem-guest/initramfs.cpio.gz\"
cmdline = \"console=ttyS0 quiet panic=-1 tandem.workload=idle\"
[[vm.disk]]
path = \"/var/lib/tandem-guest/apps.img\"
format = \"raw\"
readonly = true
[fencing]
etcd = [\"http://127.0.0.1:2379\"]
[replication]
timeout_ms = 500
epoch_ms = 100
[control]
socket = \"/run/tandem/web2-$n.sock\"
EOF"
done
# Until etcd's record of VM 2 says STATE on NODE (and the record's generation, for a check
# that the guest did not start anew).
record() { inside tandem fence show --etcd http://127.0.0.1:2379 --vm-id 2 --json 2>/dev/null || true; }
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
  inside journalctl -u 'tandem@web2-*' --no-pager -n 60 -o cat >&2 || true
  fail "etcd's record of VM 2 is not '$state' on $node after 120 s: $r"
}
gen() { record | grep -o '"gen": [0-9]*' | grep -o '[0-9]*$'; }
# Until node N, the backup, says it can take the guest over (it committed an epoch of the
# current session: etcd's record names the session from its start, before that).
wait_backup() {
  local st=
  for _ in $(seq 600); do
    st=$(inside tandem status --socket "/run/tandem/web2-$1.sock" --json 2>/dev/null || true)
    printf '%s' "$st" | grep -q '"state": "protecting:' && return 0
    sleep 0.2
  done
  inside journalctl -u 'tandem@web2-*' --no-pager -n 60 -o cat >&2 || true
  fail "host-$1 is not a backup ready to take the guest over after 120 s: $st"
}
inside systemctl enable --now tandem@web2-a tandem@web2-b >&2
wait_record protected host-a
say "recorded protected on host-a (generation $(gen)); systemctl restart tandem@web2-a hands it over"
# At once: a restart during the initial copy finishes it and then hands the guest over.
inside systemctl restart tandem@web2-a
wait_record protected host-b
wait_backup a
say "protected on host-b (generation $(gen)), host-a its backup; SIGKILL to host-b's daemon"
g=$(gen)
inside systemctl kill -s SIGKILL tandem@web2-b
# host-a fails over (a takeover: one more generation), systemd restarts host-b's unit
# (Restart=on-failure) and it comes back as the backup: protected again on host-a.
wait_record protected host-a
wait_backup b
[ "$(gen)" -gt "$g" ] || fail "no takeover recorded after the SIGKILL (generation $(gen))"
inside systemctl is-active --quiet tandem@web2-b || fail "systemd did not restart tandem@web2-b"
n=$(inside systemctl show -p NRestarts --value tandem@web2-b)
[ "$n" -ge 1 ] || fail "tandem@web2-b was not restarted by systemd (NRestarts=$n)"
say "failed over to host-a (generation $(gen)); host-b restarted by systemd ($n restart), its backup again"

# The node running the guest dies while its backup still receives the first copy: the backup
# cannot take over, and the restarted node must not wait as a backup forever (nor boot a
# fresh guest): it exits 3 and a human decides. The replication link to host-b is slowed
# (1 Mbit/s in the container's network namespace) so that the copy is still running.
session() { record | grep -o '"session": "[0-9a-f]*"' || true; }
s0=$(session)
nsenter -t "$leader" -n sh -euc '
  tc qdisc add dev lo root handle 1: htb
  tc class add dev lo parent 1: classid 1:10 htb rate 1mbit
  tc filter add dev lo parent 1: protocol ip u32 match ip dst 127.0.0.2/32 match ip dport 7100 0xffff flowid 1:10
' || fail "cannot slow the replication link with tc (htb, u32)"
say "restart host-b (the backup): host-a copies the guest to it anew, slowly"
inside systemctl restart tandem@web2-b
for _ in $(seq 600); do
  s1=$(session)
  [ -n "$s1" ] && [ "$s1" != "$s0" ] && break
  sleep 0.2
done
[ -n "$s1" ] && [ "$s1" != "$s0" ] || fail "host-a did not begin a new session with host-b: $(record)"
st=$(inside tandem status --socket /run/tandem/web2-b.sock --json 2>/dev/null || true)
printf '%s' "$st" | grep -q '"state": "protecting:' && fail "host-b committed an epoch of the slowed copy already: $st"
g=$(gen)
say "session $s1 recorded, host-b still copying; SIGKILL to host-a's daemon"
inside systemctl kill -s SIGKILL tandem@web2-a
# systemd restarts it (5 s); it waits for a takeover that cannot come (10 s), then exits 3.
for _ in $(seq 300); do
  inside systemctl is-failed --quiet tandem@web2-a && break
  sleep 0.2
done
inside systemctl is-failed --quiet tandem@web2-a ||
  { inside journalctl -u tandem@web2-a --no-pager -n 30 -o cat >&2 || true; fail "tandem@web2-a did not stop with a refusal after dying during the first copy"; }
code=$(inside systemctl show -p ExecMainStatus --value tandem@web2-a)
[ "$code" = 3 ] || fail "tandem@web2-a exited with status $code, not 3"
inside journalctl -u tandem@web2-a --no-pager -o cat | grep -q 'did not take the guest over' ||
  fail "the journal of tandem@web2-a does not say why it refused"
inside systemctl is-active --quiet tandem@web2-b || fail "tandem@web2-b (the backup) ended"
[ "$(gen)" = "$g" ] || fail "the record changed although nobody could take over: $(record)"
say "host-a refused with status 3 (nobody runs the guest); the operator declares it gone and starts host-a"
nsenter -t "$leader" -n tc qdisc del dev lo root
inside tandem fence stop --etcd http://127.0.0.1:2379 --vm-id 2 --generation "$g" >&2
inside systemctl start tandem@web2-a
wait_record protected host-a
wait_backup b
say "host-a runs the guest again (generation $(gen)), host-b its backup"
inside systemctl stop tandem@web2-b tandem@web2-a
say "OK"
