#!/bin/sh
# Builds tandem's Debian test VM: Debian 12 on a qcow2 disk with an MBR partition table, an ext4
# root and GRUB for BIOS boot (it boots through SeaBIOS like a cloud image), systemd,
# openssh-server and PostgreSQL 15. No loop devices or mounts: the root file system is made
# with `mke2fs -d` at the partition's offset and GRUB's core image is written to the gap after
# the MBR, as grub-install would.
#
# Usage: build-debian.sh OUT_DIR GUEST_CIDR
#   OUT_DIR/debian.qcow2   the disk          OUT_DIR/id_ed25519   root's SSH key
# Needs root (debootstrap chroots), debootstrap, grub-pc-bin, fdisk (sfdisk), e2fsprogs,
# qemu-utils. Progress goes to stderr as "step N/6 ..." lines.
set -eu
OUT=$1
CIDR=$2
SIZE_MB=${SIZE_MB:-3072}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
ROOT_UUID=6a1c9a3e-7d2f-4c1e-9a57-74616e64656d
WORK=$OUT/debian.work
ROOT=$WORK/root
step() { echo "step $1/6: $2" >&2; }

rm -rf "$WORK"
mkdir -p "$WORK" "$OUT"

step 1 "debootstrap bookworm (systemd, kernel, openssh-server, postgresql)"
debootstrap --variant=minbase \
  --include=systemd-sysv,udev,dbus,linux-image-cloud-amd64,initramfs-tools,openssh-server,postgresql,iproute2,procps,ca-certificates \
  bookworm "$ROOT" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 ||
  { tail -30 "$WORK/debootstrap.log" >&2; exit 1; }

step 2 "configure: fstab, network, serial console, ssh key, postgresql, ready marker"
echo tandem-debian >"$ROOT/etc/hostname"
echo "UUID=$ROOT_UUID / ext4 defaults,errors=remount-ro 0 1" >"$ROOT/etc/fstab"
mkdir -p "$ROOT/etc/systemd/network"
cat >"$ROOT/etc/systemd/network/10-tandem.network" <<EOF
[Match]
Name=en* eth*

[Network]
DHCP=ipv4
Address=$CIDR
EOF
chroot "$ROOT" systemctl enable systemd-networkd >/dev/null 2>&1
# No password for root on the console (a test VM); SSH by key only.
chroot "$ROOT" passwd -d root >/dev/null
rm -f "$OUT/id_ed25519" "$OUT/id_ed25519.pub"
ssh-keygen -q -t ed25519 -N '' -C tandem-test -f "$OUT/id_ed25519"
mkdir -p "$ROOT/root/.ssh"
cp "$OUT/id_ed25519.pub" "$ROOT/root/.ssh/authorized_keys"
chmod 700 "$ROOT/root/.ssh"
chmod 600 "$ROOT/root/.ssh/authorized_keys"
PGCONF=$(ls -d "$ROOT"/etc/postgresql/*/main)
echo "listen_addresses = '*'" >>"$PGCONF/postgresql.conf"
echo "host all all 0.0.0.0/0 trust" >>"$PGCONF/pg_hba.conf"
cat >"$ROOT/etc/systemd/system/tandem-ready.service" <<'EOF'
[Unit]
Description=Tell tandem the VM is ready (on the serial console)
After=postgresql.service ssh.service systemd-networkd.service
Wants=postgresql.service ssh.service

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'until pg_isready -q -h 127.0.0.1; do sleep 0.5; done; echo TANDEM-READY >/dev/ttyS0'

[Install]
WantedBy=multi-user.target
EOF
chroot "$ROOT" systemctl enable tandem-ready.service >/dev/null 2>&1
KVER=$(ls "$ROOT/lib/modules" | head -1)
mkdir -p "$ROOT/boot/grub"
cat >"$ROOT/boot/grub/grub.cfg" <<EOF
serial --unit=0 --speed=115200
terminal_input serial
terminal_output serial
set timeout=0
set default=0
menuentry "Debian 12 (tandem test VM)" {
  search --no-floppy --fs-uuid --set=root $ROOT_UUID
  linux /boot/vmlinuz-$KVER root=UUID=$ROOT_UUID ro console=ttyS0,115200 quiet
  initrd /boot/initrd.img-$KVER
}
EOF
rm -rf "$ROOT/var/cache/apt/archives"/*.deb "$ROOT/var/lib/apt/lists"/*

step 3 "partition table (MBR, one bootable partition from 1 MiB)"
RAW=$WORK/disk.raw
truncate -s "${SIZE_MB}M" "$RAW"
echo 'label: dos
start=2048, type=83, bootable' | sfdisk -q "$RAW"

step 4 "ext4 root file system from the tree (mke2fs -d)"
mke2fs -q -F -t ext4 -L tandem-root -U "$ROOT_UUID" -d "$ROOT" \
  -E offset=$((2048 * 512)) "$RAW" $(((SIZE_MB - 1) * 1024))k

step 5 "GRUB for BIOS boot: boot.img in the MBR, core.img after it"
grub-mkimage -O i386-pc -o "$WORK/core.img" -p "(hd0,msdos1)/boot/grub" \
  biosdisk part_msdos ext2 search search_fs_uuid normal linux configfile echo serial terminal test
dd if=/usr/lib/grub/i386-pc/boot.img of="$RAW" bs=440 count=1 conv=notrunc status=none
dd if="$WORK/core.img" of="$RAW" bs=512 seek=1 conv=notrunc status=none

step 6 "qcow2"
qemu-img convert -O qcow2 "$RAW" "$OUT/debian.qcow2.partial"
mv "$OUT/debian.qcow2.partial" "$OUT/debian.qcow2"
rm -rf "$WORK"
