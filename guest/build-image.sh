#!/usr/bin/env bash
# Builds tandem's guest image from Debian packages already installed on this host:
#   OUT/vmlinuz          Debian cloud kernel (linux-image-cloud-amd64)
#   OUT/initramfs.cpio.gz busybox + virtio modules; mounts the apps disk and switch_roots to it
#   OUT/apps.img         read-only ext4 root: busybox, redis-server, sqlite3, gcc/make/binutils,
#                        Lua 5.1-5.4 sources (from crates.io's lua-src), memtouch, workload scripts
# Usage: build-image.sh OUT_DIR LUA_SRC_DIR
# Called by `tandem setup`, which checks packages first and skips this when the stamp matches.
set -euo pipefail
out=${1:?usage: build-image.sh OUT_DIR LUA_SRC_DIR}
lua_src=${2:?usage: build-image.sh OUT_DIR LUA_SRC_DIR}
here=$(cd "$(dirname "$0")" && pwd)

kver=$(ls /lib/modules | grep -E 'cloud-amd64$' | sort -V | tail -n 1 || true)
[ -n "$kver" ] || { echo "error: no Debian cloud kernel under /lib/modules; install linux-image-cloud-amd64" >&2; exit 1; }
[ -f "/boot/vmlinuz-$kver" ] || { echo "error: /boot/vmlinuz-$kver missing; reinstall linux-image-cloud-amd64" >&2; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-image.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

step() { echo "  [image] $*"; }

# ---------- initramfs ----------
step "initramfs: busybox + virtio modules for $kver"
ird=$work/initramfs
mkdir -p "$ird"/{bin,dev,proc,sys,newroot,lib/modules}
cp /bin/busybox "$ird/bin/busybox"
: > "$ird/modules.order"
for m in virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci failover net_failover virtio_net virtio_blk; do
  f=$(modinfo -k "$kver" -n "$m")
  case "$f" in
    *.ko) cp "$f" "$ird/lib/modules/$m.ko" ;;
    *.ko.xz) xz -dc "$f" > "$ird/lib/modules/$m.ko" ;;
    *.ko.zst) zstd -qdc "$f" > "$ird/lib/modules/$m.ko" ;;
    *) echo "error: module $m not found for $kver" >&2; exit 1 ;;
  esac
  echo "$m" >> "$ird/modules.order"
done
install -m 0755 "$here/initramfs-init" "$ird/init"
(cd "$ird" && find . -print0 | cpio --null -o -H newc --quiet) | gzip -1 > "$work/initramfs.cpio.gz"

# ---------- apps root ----------
step "apps root: busybox, redis, sqlite, gcc toolchain, Lua sources"
root=$work/root
mkdir -p "$root"/{bin,sbin,dev,proc,sys,tmp,run,data,etc,root,usr/bin,usr/lib/tandem,usr/lib64,usr/src}
# merged /usr, as on the host: /lib and /lib64 are links into /usr
ln -s usr/lib "$root/lib"; ln -s usr/lib64 "$root/lib64"
cp /bin/busybox "$root/bin/busybox"
for a in $(/bin/busybox --list); do
  [ "$a" = busybox ] || ln -sf busybox "$root/bin/$a"
done

# copy a file, keeping its path, resolving symlinks to the real file too
copy_path() {
  local p=$1
  [ -e "$p" ] || { echo "error: $p missing; run tandem setup" >&2; exit 1; }
  mkdir -p "$root$(dirname "$p")"
  cp -a "$p" "$root$p"
  if [ -L "$p" ]; then
    local t; t=$(readlink -f "$p"); mkdir -p "$root$(dirname "$t")"; cp -a "$t" "$root$t"
  fi
}
# copy an ELF program or library with its shared-library closure
copy_elf() {
  copy_path "$1"
  ldd "$1" 2>/dev/null | grep -oE '/[^ ]+' | while read -r lib; do copy_path "$lib"; done
}

for b in /usr/bin/redis-server /usr/bin/sqlite3 /usr/bin/make /usr/bin/gcc-12 \
         /usr/bin/x86_64-linux-gnu-as /usr/bin/x86_64-linux-gnu-ld.bfd /usr/bin/x86_64-linux-gnu-ar; do
  copy_elf "$b"
done
ln -sf gcc-12 "$root/usr/bin/gcc"; ln -sf gcc-12 "$root/usr/bin/cc"
ln -sf x86_64-linux-gnu-as "$root/usr/bin/as"; ln -sf x86_64-linux-gnu-ld.bfd "$root/usr/bin/ld"
ln -sf x86_64-linux-gnu-ar "$root/usr/bin/ar"
gccdir=/usr/lib/gcc/x86_64-linux-gnu/12
for f in cc1 collect2 liblto_plugin.so crtbegin.o crtbeginS.o crtend.o crtendS.o libgcc.a libgcc_eh.a libgcc_s.so; do
  copy_elf "$gccdir/$f" 2>/dev/null || copy_path "$gccdir/$f"
done
copy_path /lib/x86_64-linux-gnu/libgcc_s.so.1
for f in crt1.o Scrt1.o crti.o crtn.o libc.so libc_nonshared.a libm.so libmvec.so libdl.a; do
  copy_path "/usr/lib/x86_64-linux-gnu/$f"
done
copy_path /lib64/ld-linux-x86-64.so.2

# Lua sources, and exactly the headers their compile needs (found by the host's gcc -M)
for v in "$lua_src"/lua-5.*; do
  [ -d "$v" ] || continue
  cp -r "$v" "$root/usr/src/$(basename "$v")"
done
cp "$here/lua.mk" "$root/usr/src/Makefile"
cp "$here/luarun.c" "$root/usr/src/luarun.c"
for v in "$root"/usr/src/lua-5.*; do
  for c in "$v"/*.c; do gcc -M -O2 -DLUA_USE_LINUX -I"$v" "$c"; done
done | tr ' \\' '\n\n' | grep -E '^/usr/(include|lib/gcc)/' | sort -u | while read -r h; do copy_path "$h"; done
gcc -M -O2 -DLUA_USE_LINUX -I"$root/usr/src/lua-5.4.7" "$root/usr/src/luarun.c" | tr ' \\' '\n\n' | grep -E '^/usr/(include|lib/gcc)/' | sort -u | while read -r h; do copy_path "$h"; done

cp -a /usr/include/x86_64-linux-gnu/bits/. "$root/usr/include/x86_64-linux-gnu/bits/"

# memtouch: a static synthetic writer with a known pattern
gcc -O2 -static -o "$root/usr/lib/tandem/memtouch" "$here/memtouch.c"
# allocchurn (the alloc workload) and a Lua 5.4 interpreter for scripts (luatext, luagc)
gcc -O2 -static -o "$root/usr/lib/tandem/allocchurn" "$here/allocchurn.c"
lua54=$lua_src/lua-5.4.7
[ -f "$lua54/lua.h" ] || { echo "error: $lua54 missing (Lua 5.4.7 of crates.io's lua-src)" >&2; exit 1; }
gcc -O2 -static -w -DLUA_USE_LINUX -I"$lua54" -o "$root/usr/lib/tandem/luaexec" "$here/luaexec.c" "$lua54"/*.c -lm
install -m 0644 "$here/luatext.lua" "$here/luagc.lua" "$root/usr/lib/tandem/"
install -m 0755 "$here/tandem-init" "$root/sbin/tandem-init"
install -m 0755 "$here/workload.sh" "$root/usr/lib/tandem/workload.sh"
echo "root:x:0:0:root:/root:/bin/sh" > "$root/etc/passwd"
echo "root:x:0:" > "$root/etc/group"

size_mb=$(( $(du -sm "$root" | cut -f1) + 64 ))
step "apps.img: ext4, ${size_mb} MiB"
rm -f "$work/apps.img"
mkfs.ext4 -q -F -L tandem-apps -O ^has_journal -d "$root" "$work/apps.img" "${size_mb}M"

cp "/boot/vmlinuz-$kver" "$work/vmlinuz"
for f in vmlinuz initramfs.cpio.gz apps.img; do mv -f "$work/$f" "$out/$f"; done
echo "$kver" > "$out/kernel-version"
step "done: $out"
