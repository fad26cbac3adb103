#!/usr/bin/env bash
# OPERATIONS.md's "One unit per VM", followed under a real systemd on two hosts:
#   dist/deb/test-systemd.sh ROOT GUEST_DIR
# ROOT is a Debian 12 root with the tandem package installed (dist/deb/test-install.sh makes
# it, with systemd, dbus and etcd-server). Two hosts, host-a and host-b, boot from it under
# systemd-nspawn (host-b from a copy), each in its own network namespace, joined by a veth
# pair (10.213.77.1 and .2, names in /etc/hosts): a real network between two systemds. etcd
# runs on host-b (etcd-server's own unit, also listening on its address). The lab guest of
# GUEST_DIR is bound read-only into both and booted by its kernel.
#
# host-a alone: the runbook's commands as an operator types them (the example configuration
# copied to /etc/tandem and edited, `tandem run --dry-run`, `systemctl daemon-reload`,
# `systemctl enable --now tandem@web1`); the unit is active (READY=1 once the guest runs),
# `tandem status` answers on its socket, the journal has the daemon's lines with priorities
# (`journalctl -p warning` finds the missing backup), `systemctl stop` shuts the guest down
# and etcd's record says stopped, `systemctl start` runs it again.
#
# Both hosts, one file /etc/tandem/web2.toml the same on both (each host's name picks its
# node): `systemctl enable --now tandem@web2` on both; a restart of the running node during
# the first copy hands the guest over; `tandem switchover` hands it back; host-a, running the
# guest, is lost (its link cut, every process killed): host-b fails over, and host-a, booted
# again, serves as its backup from boot; SIGKILL to host-b's daemon fails over to host-a and
# systemd restarts the unit as the backup; SIGKILL to the running node's daemon during the
# backup's first copy (slowed with tc) ends in exit status 3 and the operator's override.
# Needs root. Prints its steps on stderr; exit status 0 when every check passes.
set -euo pipefail
root=$(realpath "${1:?usage: $0 ROOT GUEST_DIR}")
guest=$(realpath "${2:?usage: $0 ROOT GUEST_DIR}")
say() { printf '==> systemd: %s\n' "$*" >&2; }
fail() { echo "error: $*" >&2; exit 1; }
command -v systemd-nspawn >/dev/null || fail "systemd-nspawn is missing: run tandem-lab setup (systemd-container)"
command -v tc >/dev/null || fail "tc is missing: run tandem-lab setup (iproute2)"
[ -x "$root/lib/systemd/systemd" ] || fail "$root has no systemd (dist/deb/test-install.sh builds the root with it)"
for f in vmlinuz initramfs.cpio.gz apps.img; do
  [ -f "$guest/$f" ] || fail "$guest/$f missing: run tandem-lab setup (the lab guest)"
done

net=10.213.77
declare -A rootdir=([a]="$root") ns=() nspawn=() leader=() log=()
declare -A ifname=([a]="tdm$$a" [b]="tdm$$b") addr=([a]="$net.1" [b]="$net.2")
rootdir[b]=$(mktemp -d /var/tmp/tandem-host-b-XXXXXX)
for h in a b; do ns[$h]=tandem-host-$h-$$; done
# Ends host H's container (SIGTERM to nspawn: systemd shuts down; SIGKILL after 20 s).
halt() {
  local h=$1
  [ -n "${nspawn[$h]:-}" ] || return 0
  kill -TERM "${nspawn[$h]}" 2>/dev/null || true
  for _ in $(seq 100); do kill -0 "${nspawn[$h]}" 2>/dev/null || break; sleep 0.2; done
  kill -KILL "${nspawn[$h]}" 2>/dev/null || true
  wait "${nspawn[$h]}" 2>/dev/null || true
  nspawn[$h]=
}
cleanup() {
  halt a
  halt b
  for h in a b; do
    rm -f "${log[$h]:-}"
    ip netns del "${ns[$h]}" 2>/dev/null || true
  done
  rm -rf "${rootdir[b]}"
}
trap cleanup EXIT

say "two hosts: host-a and host-b (a copy of the root), a veth pair between their namespaces"
cp -a "$root/." "${rootdir[b]}/"
ip netns add "${ns[a]}"
ip netns add "${ns[b]}"
ip link add "${ifname[a]}" type veth peer name "${ifname[b]}"
for h in a b; do
  ip link set "${ifname[$h]}" netns "${ns[$h]}"
  ip -n "${ns[$h]}" link set lo up
  ip -n "${ns[$h]}" addr add "${addr[$h]}/24" dev "${ifname[$h]}"
  ip -n "${ns[$h]}" link set "${ifname[$h]}" up
  r=${rootdir[$h]}
  echo "host-$h" >"$r/etc/hostname"
  printf '127.0.0.1 localhost\n::1 localhost ip6-localhost\n%s host-a\n%s host-b\n' \
    "${addr[a]}" "${addr[b]}" >"$r/etc/hosts"
done
# etcd on host-b, for both hosts; host-a runs none.
printf 'ETCD_LISTEN_CLIENT_URLS=http://127.0.0.1:2379,http://%s:2379\nETCD_ADVERTISE_CLIENT_URLS=http://%s:2379\n' \
  "${addr[b]}" "${addr[b]}" >>"${rootdir[b]}/etc/default/etcd"
ln -sf /dev/null "${rootdir[a]}/etc/systemd/system/etcd.service"
etcd=http://host-b:2379

on() { local h=$1; shift; nsenter -t "${leader[$h]}" -m -u -i -n -p -r -w -- "$@"; }
inside() { on a "$@"; }
# Boots host H (its root, its network namespace) and waits until its systemd has booted.
boot() {
  local h=$1 state=
  [ -n "${log[$h]:-}" ] || log[$h]=$(mktemp /tmp/tandem-nspawn-XXXXXX.log)
  # --keep-unit/--register=no: no host systemd or machined to talk to; userfaultfd for the
  # dirty log (nspawn's default system-call filter leaves it out).
  systemd-nspawn --quiet --keep-unit --register=no -M "tandem-host-$h-$$" \
    --network-namespace-path="/run/netns/${ns[$h]}" \
    --system-call-filter=userfaultfd --bind-ro="$guest:/var/lib/tandem-guest" \
    -D "${rootdir[$h]}" --boot --console=pipe >>"${log[$h]}" 2>&1 &
  nspawn[$h]=$!
  # The container's PID 1 (systemd) is nspawn's child.
  leader[$h]=
  for _ in $(seq 100); do
    leader[$h]=$(pgrep -P "${nspawn[$h]}" -x systemd || true)
    [ -n "${leader[$h]}" ] && break
    sleep 0.2
  done
  [ -n "${leader[$h]}" ] || { cat "${log[$h]}" >&2; fail "systemd did not start on host-$h"; }
  # Until systemd has booted (degraded is fine: a container lacks some hardware units).
  for _ in $(seq 150); do
    state=$(on "$h" systemctl is-system-running 2>/dev/null || true)
    case $state in running|degraded) break ;; esac
    sleep 0.2
  done
  case $state in running|degraded) ;; *) fail "systemd on host-$h did not finish booting (state: $state)" ;; esac
}

say "booting both hosts under systemd-nspawn"
boot b
boot a
for _ in $(seq 50); do on b systemctl is-active --quiet etcd && break; sleep 0.2; done
on b systemctl is-active --quiet etcd || { on b systemctl status etcd >&2 || true; fail "etcd-server's unit is not active on host-b"; }
for _ in $(seq 50); do inside tandem fence show --etcd "$etcd" --vm-id 1 >/dev/null 2>&1 && break; sleep 0.2; done
inside tandem fence show --etcd "$etcd" --vm-id 1 >/dev/null || fail "host-a cannot reach etcd on host-b"
say "both booted; etcd on host-b, reached from host-a over the veth link"

say "host-a, OPERATIONS.md, One unit per VM: config, dry run, daemon-reload, enable --now"
inside env etcd="$etcd" net="$net" sh -euc '
  mkdir -p /etc/tandem
  cp /usr/share/doc/tandem/examples/tandem.toml.example /etc/tandem/web1.toml
  # edit: nodes, VM, etcd (as the example file says)
  cat > /etc/tandem/web1.toml <<EOF
vm_id = 1
primary = "host-a"
[nodes]
host-a = "$net.1:7000"
host-b = "$net.2:7000"
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
etcd = ["$etcd"]
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
record=$(inside tandem fence show --etcd "$etcd" --vm-id 1 --json) ||
  fail "tandem fence show failed"
echo "$record" | grep -q '"stopped"' || fail "etcd's record is not stopped after systemctl stop: $record"

say "systemctl start: the node runs the guest again"
inside systemctl start tandem@web1
inside systemctl is-active --quiet tandem@web1 || fail "tandem@web1 did not start again"
# A dry run while the unit runs the guest says so (and exits 0).
dry=$(inside tandem run --config /etc/tandem/web1.toml --dry-run) ||
  fail "tandem run --dry-run failed while the unit runs: $dry"
echo "$dry" | grep -q 'etcd says this node runs the guest' || fail "tandem run --dry-run: $dry"
inside systemctl disable --now tandem@web1 2>/dev/null

. "$(dirname "$0")/test-systemd-two-hosts.sh"
say "OK"
