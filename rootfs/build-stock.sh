#!/usr/bin/env bash
# Builds the stock image: the guest kernel plus an initramfs of Debian's static busybox, the
# static guest agent and /init. Installs it as `stock` in the image store and prints its path.
# Cached: the initramfs is rebuilt only when the agent, busybox, /init or this script change.
# Environment: SANDBOX_HOST_ARCH (the guest's architecture: auto, x86_64 or aarch64; another
# than the host's is cross-built, into its own store), SANDBOX_HOST_IMAGE_DIR (image store),
# SANDBOX_HOST_CACHE, CARGO_TARGET_DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[stock-image %s] %s\n' "$(date +%T)" "$*" >&2; }

cache=$(sandbox_cache_dir)
arch=$(sandbox_guest_arch)
store=$(sandbox_image_dir)
target_dir=${CARGO_TARGET_DIR:-$root/target}
native=0
[ "$arch" = "$(SANDBOX_HOST_ARCH=auto sandbox_guest_arch)" ] && native=1
# Runs a guest-architecture program on this host: directly, or under qemu-user when foreign.
guest_run() { if [ $native = 1 ]; then "$@"; else qemu-aarch64-static "$@"; fi; }

if [ ! -x /bin/busybox ] || ! /bin/busybox --list >/dev/null 2>&1 || ! command -v cpio >/dev/null; then
  log "installing busybox-static and cpio"
  bash "$root/scripts/install-deps.sh" >&2
fi
if [ $native = 1 ]; then
  busybox=/bin/busybox
elif [ "$arch" != aarch64 ]; then
  log "an $arch guest on a $(uname -m) host is not built here: only aarch64 guests are cross-built (on x86_64)"
  exit 2
else
  # Debian's busybox-static for the guest's architecture (install-deps.sh --aarch64 adds arm64 to
  # dpkg's architectures), the same version as this host's.
  command -v qemu-aarch64-static >/dev/null && dpkg --print-foreign-architectures | grep -qx arm64 \
    || bash "$root/scripts/install-deps.sh" --aarch64 >&2
  version=$(dpkg-query -W -f='${Version}' busybox-static)
  busybox="$cache/busybox/arm64-$version/busybox"
  if [ ! -x "$busybox" ]; then
    log "fetching busybox-static:arm64 $version"
    tmpd=$(mktemp -d)
    chmod 755 "$tmpd"  # apt-get download writes as _apt when run as root
    # The host's version; when the archive no longer has it, the archive's own.
    (cd "$tmpd" && { apt-get download -q "busybox-static:arm64=$version" >&2 \
        || apt-get download -q "busybox-static:arm64" >&2; } && dpkg-deb -x busybox-static_*_arm64.deb x)
    mkdir -p "${busybox%/*}"
    install -m 0755 "$tmpd/x/bin/busybox" "$busybox"
    rm -rf "$tmpd"
  fi
fi
# Static: nothing else of the host may be needed in the guest.
readelf -l "$busybox" | grep -q INTERP && { log "$busybox is not static; install Debian's busybox-static"; exit 1; }

kernel=$(bash "$root/guest-kernel/build.sh" "$arch")

log "building the guest agent for $arch (static, release)"
# --target keeps these flags off the host build and its cache.
case "$arch" in
  # crt-static on the gnu target gives a static binary, as the x86_64 agent always was.
  x86_64) triple=x86_64-unknown-linux-gnu; flags="-C target-feature=+crt-static" ;;
  # musl with Rust's own linker: static, and built the same way from any host (Linux x86_64,
  # aarch64, macOS) with nothing but `rustup target add`.
  aarch64) triple=aarch64-unknown-linux-musl; flags="-C target-feature=+crt-static -C linker=rust-lld" ;;
esac
# The target's standard library, from rustup when it is not there yet.
if [ ! -d "$(rustc --print sysroot)/lib/rustlib/$triple" ]; then
  command -v rustup >/dev/null || { log "Rust has no $triple target and there is no rustup to add it: install Rust with rustup (https://rustup.rs)"; exit 1; }
  rustup target add "$triple" >&2
fi
RUSTFLAGS="$flags" CARGO_TARGET_DIR="$target_dir" \
  cargo build --quiet --release --manifest-path "$root/Cargo.toml" -p sandbox-agent --target "$triple" >&2
agent="$target_dir/$triple/release/sandbox-agent"
readelf -l "$agent" | grep -q INTERP && { log "$agent is not static"; exit 1; }

key=$(cat "$here/stock/init" "$here/build-stock.sh" "$busybox" "$agent" "$kernel" | sha256sum | cut -c1-16)
dir="$store/.stock-$key"
if [ -f "$dir/manifest.json" ] && [ "$(readlink "$store/stock" 2>/dev/null)" = ".stock-$key" ]; then
  log "cached: $store/stock"
  echo "$store/stock"
  exit 0
fi

log "assembling the initramfs"
mkdir -p "$store"
tmp=$(mktemp -d "$store/.tmp-stock.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
tree="$tmp/tree"
mkdir -p "$tree"/{bin,sbin,usr/bin,usr/sbin,etc,proc,sys,dev,tmp,root,workspace,run,var/tmp}
cp "$busybox" "$tree/bin/busybox"
for applet in $(guest_run "$busybox" --list-full); do
  [ -e "$tree/$applet" ] || ln -s /bin/busybox "$tree/$applet"
done
install -m 0755 "$agent" "$tree/sbin/sandbox-agent"
install -m 0755 "$here/stock/init" "$tree/init"
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$tree/etc/passwd"
printf 'root:x:0:\ntty:x:5:\n' > "$tree/etc/group"
printf '127.0.0.1 localhost sandbox\n::1 localhost\n' > "$tree/etc/hosts"
chmod 1777 "$tree/tmp" "$tree/var/tmp"
# An uncompressed cpio: the kernel unpacks it without decompressing, which is what costs time
# under software emulation.
(cd "$tree" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc --owner=0:0) > "$tmp/initramfs.cpio"
kernel_name=${kernel##*/}
cp "$kernel" "$tmp/$kernel_name"
agent_version=$(guest_run "$agent" --version | awk '{print $2}')
cat > "$tmp/manifest.json" <<JSON
{"name": "stock", "arch": "$arch", "kind": "initramfs", "kernel": "$kernel_name", "initrd": "initramfs.cpio",
 "agent_version": "$agent_version", "key": "$key", "built_at": "$(date -u +%FT%TZ)"}
JSON
rm -rf "$tree" "$dir"
mv "$tmp" "$dir"
trap - EXIT
# Swap the tag atomically: a VM starting now sees the old image or the new one, never half of one.
ln -sfn ".stock-$key" "$store/.stock-link-$key"
mv -T "$store/.stock-link-$key" "$store/stock"
# Older builds of the stock image are no longer referenced.
for old in "$store"/.stock-*; do
  [ "$old" = "$dir" ] || [ -L "$old" ] || rm -rf "$old"
done
log "stock image: $store/stock ($(du -sh "$dir/initramfs.cpio" | cut -f1) initramfs, $(du -sh "$dir/$kernel_name" | cut -f1) kernel)"
echo "$store/stock"
