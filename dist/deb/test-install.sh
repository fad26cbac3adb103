#!/usr/bin/env bash
# Installs a tandem .deb into a fresh Debian 12 root and runs it there:
#   dist/deb/test-install.sh target/deb/tandem_*.deb [GUEST_DIR]
# The root is made with debootstrap (minbase bookworm plus the package's dependencies, as the
# Debian test VM is built) once and cached as a tarball in $TANDEM_CACHE (~/.cache/tandem);
# every run unpacks a fresh copy, installs the package with dpkg (which checks its
# dependencies), and in a private mount namespace runs `tandem --help`, a man page, the
# completions and `tandem doctor --json` (whose JSON is printed on stdout). With GUEST_DIR (the
# lab guest's kernel and initramfs) it then boots the root under systemd and follows
# OPERATIONS.md's "One unit per VM" there (dist/deb/test-systemd.sh). Needs root.
set -euo pipefail
deb=$(realpath "${1:?usage: $0 PACKAGE.deb}")
cache=${TANDEM_CACHE:-$HOME/.cache/tandem}/package-root
mirror=${MIRROR:-http://deb.debian.org/debian}
tarball=$cache/bookworm.tar.zst
say() { printf '==> %s\n' "$*" >&2; }
[ "$(id -u)" = 0 ] || { echo "error: $0 needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
for tool in debootstrap zstd unshare chroot dpkg-deb; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing: run tandem-lab setup" >&2; exit 1; }
done

# The package's own dependencies go into the cached root (its Depends line, version bounds
# dropped), so the install below needs no network; dpkg still checks them.
depends=$(dpkg-deb -f "$deb" Depends | sed 's/([^)]*)//g; s/ //g')
# systemd, dbus and etcd: the root boots under systemd-nspawn for the unit's runbook test.
extra="man-db,bash-completion,systemd,systemd-sysv,dbus,etcd-server"
stamp="bookworm minbase $depends $extra"
if [ ! -f "$tarball" ] || [ "$(cat "$cache/stamp" 2>/dev/null)" != "$stamp" ]; then
  say "building a fresh Debian 12 root with debootstrap (once; cached in $cache)"
  mkdir -p "$cache"
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  if ! debootstrap --variant=minbase --include="$depends,$extra" \
      bookworm "$work/root" "$mirror" >"$cache/debootstrap.log" 2>&1; then
    tail -20 "$cache/debootstrap.log" >&2
    echo "error: debootstrap failed (log: $cache/debootstrap.log); check the network and MIRROR=$mirror" >&2
    exit 1
  fi
  rm -rf "$work/root/var/cache/apt/archives/"*.deb
  tar -C "$work/root" -cf - . | zstd -q -T0 -3 -o "$tarball.tmp"
  mv "$tarball.tmp" "$tarball"
  echo "$stamp" >"$cache/stamp"
  rm -rf "$work"
  trap - EXIT
fi

root=$(mktemp -d /var/tmp/tandem-package-test-XXXXXX)
trap 'rm -rf "$root"' EXIT
say "unpacking a fresh root"
zstd -q -dc "$tarball" | tar -C "$root" -xf -
cp "$deb" "$root/tmp/tandem.deb"
say "installing $(basename "$deb") with dpkg"
chroot "$root" dpkg -i /tmp/tandem.deb >&2
chroot "$root" dpkg -s tandem | grep -q '^Status: install ok installed' ||
  { echo "error: dpkg did not install tandem" >&2; exit 1; }

say "running tandem inside the root (private mount namespace)"
unshare --mount --fork sh -c '
  set -e
  root=$1
  mount -t proc proc "$root/proc"
  mount --rbind /dev "$root/dev"
  mount --rbind /sys "$root/sys"
  mount -t tmpfs -o size=2g tmpfs "$root/dev/shm"
  mount -t tmpfs tmpfs "$root/run"
  chroot "$root" sh -c "
    set -e
    tandem --version >&2
    tandem --help >/dev/null
    tandem primary --help >/dev/null
    man -P cat tandem-primary 2>/dev/null | grep -q \"Replicate a VM\"
    bash -n /usr/share/bash-completion/completions/tandem
    test -x /usr/bin/tandem && test -f /usr/lib/tandem/libtandem_preload.so
    test -f /lib/systemd/system/tandem@.service
    tandem doctor --json
  "
' sh "$root"

if [ -n "${2:-}" ]; then
  "$(dirname "$0")/test-systemd.sh" "$root" "$(realpath "$2")"
fi
