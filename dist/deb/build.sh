#!/usr/bin/env bash
# Builds the Debian package of the product: dist/deb/build.sh [--debug] [--out DIR]
# (--debug: a quick unoptimised build, what the test suite installs)
# It holds /usr/bin/tandem (the product alone: no lab code, no fault hooks), the QEMU preload
# library at the fixed path the binary knows (/usr/lib/tandem/libtandem_preload.so), the
# systemd units, an example configuration, man pages and shell completions generated from the
# binary itself, the docs, and the Prometheus rules and Grafana dashboard (dist/).
# Needs cargo, dpkg-deb and dpkg-shlibdeps (Debian: dpkg-dev). Prints the .deb's path.
set -euo pipefail
cd "$(dirname "$0")/../.."

profile=release out=target/deb
while [ $# -gt 0 ]; do
  case "$1" in
    --debug) profile=package-test ;;
    --out) out=$2; shift ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
  shift
done
for tool in cargo dpkg-deb dpkg-shlibdeps; do
  command -v "$tool" >/dev/null || { echo "error: $tool is missing (apt-get install dpkg-dev; cargo from rustup)" >&2; exit 1; }
done

say() { printf '==> %s\n' "$*" >&2; }
say "building tandem and its preload library alone ($profile)"
# A target directory of its own: built with the rest of the workspace, the product would get
# the lab's features (cargo unifies them) and with them the hidden fault-injection flags.
target=target/product
flags=(--locked -q -p tandem-cli -p tandem-preload --target-dir "$target")
flags+=(--profile "$profile")
cargo build "${flags[@]}"
bin=$target/$profile/tandem
lib=$target/$profile/libtandem_preload.so

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/root
say "staging tandem $version ($arch)"
install -D -m 755 "$bin" "$root/usr/bin/tandem"
install -D -m 644 "$lib" "$root/usr/lib/tandem/libtandem_preload.so"
strip --strip-debug "$root/usr/bin/tandem" "$root/usr/lib/tandem/libtandem_preload.so"
for u in dist/systemd/*.service; do
  install -D -m 644 "$u" "$root/lib/systemd/system/$(basename "$u")"
done
install -d -m 755 "$root/usr/share/doc/tandem/examples"
install -m 644 dist/systemd/tandem.env.example dist/systemd/tandem.toml.example "$root/usr/share/doc/tandem/examples/"
install -m 644 README.md docs/*.md "$root/usr/share/doc/tandem/"
install -D -m 644 dist/prometheus/tandem.rules.yml "$root/usr/share/tandem/prometheus/tandem.rules.yml"
install -D -m 644 dist/grafana/tandem.json "$root/usr/share/tandem/grafana/tandem.json"
# libvirt's qemu hook (not installed into /etc/libvirt/hooks by the package: a host may have
# its own hook; docs/OPERATIONS.md says how to install or chain it).
install -D -m 755 dist/libvirt/qemu "$root/usr/share/tandem/libvirt/qemu-hook"
"$bin" manpages "$stage/man"
install -d -m 755 "$root/usr/share/man/man1"
for m in "$stage"/man/*.1; do gzip -9n <"$m" >"$root/usr/share/man/man1/$(basename "$m").gz"; done
"$bin" completions bash >"$stage/tandem.bash"
"$bin" completions zsh >"$stage/_tandem"
"$bin" completions fish >"$stage/tandem.fish"
install -D -m 644 "$stage/tandem.bash" "$root/usr/share/bash-completion/completions/tandem"
install -D -m 644 "$stage/_tandem" "$root/usr/share/zsh/vendor-completions/_tandem"
install -D -m 644 "$stage/tandem.fish" "$root/usr/share/fish/vendor_completions.d/tandem.fish"
cat >"$root/usr/share/doc/tandem/copyright" <<COPY
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: tandem
Files: *
License: Apache-2.0
 On Debian systems the full text is in /usr/share/common-licenses/Apache-2.0.
COPY
printf 'tandem (%s-1) bookworm; urgency=medium\n\n  * Built from %s.\n\n -- tandem <tandem@localhost>  %s\n' \
  "$version" "$(git rev-parse --short HEAD 2>/dev/null || echo source)" "$(date -R)" |
  gzip -9n >"$root/usr/share/doc/tandem/changelog.Debian.gz"

# Shared-library dependencies of the binaries, as Debian computes them.
mkdir -p "$stage/debian"
touch "$stage/debian/control"
shlibs=$(cd "$stage" && dpkg-shlibdeps -O root/usr/bin/tandem root/usr/lib/tandem/libtandem_preload.so 2>/dev/null |
  sed -n 's/^shlibs:Depends=//p')
install -d -m 755 "$root/DEBIAN"
cat >"$root/DEBIAN/control" <<CONTROL
Package: tandem
Version: $version-1
Architecture: $arch
Maintainer: tandem <tandem@localhost>
Installed-Size: $(du -sk "$root" | cut -f1)
Depends: $shlibs, qemu-system-x86, qemu-utils, iproute2
Recommends: etcd-client, nftables
Suggests: prometheus, etcd-server
Section: admin
Priority: optional
Description: high availability and frequent checkpoints for unmodified QEMU VMs
 tandem checkpoints a running QEMU virtual machine many times a second (changed
 guest RAM, device state, disk writes) and ships each checkpoint to a backup
 host that applies it transactionally; network output and disk writes are
 released only after the backup acknowledged them. If the primary host dies, the
 backup resumes the VM from the last committed checkpoint. Fencing uses an etcd
 ownership record per VM.
CONTROL
mkdir -p "$out"
deb=$out/tandem_${version}-1_${arch}.deb
dpkg-deb --build --root-owner-group -Zxz "$root" "$deb" >/dev/null
say "built $deb"
echo "$deb"
