#!/usr/bin/env bash
# Builds the stock image: the guest kernel plus an initramfs of Debian's static busybox, the
# static guest agent and /init. Installs it as `stock` in the image store and prints its path.
# Cached: the initramfs is rebuilt only when the agent, busybox, /init or this script change.
# Environment: SANDBOX_HOST_IMAGE_DIR (image store), SANDBOX_HOST_CACHE, CARGO_TARGET_DIR.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[stock-image %s] %s\n' "$(date +%T)" "$*" >&2; }

cache=$(sandbox_cache_dir)
store=${SANDBOX_HOST_IMAGE_DIR:-$cache/images}
target_dir=${CARGO_TARGET_DIR:-$root/target}
triple=x86_64-unknown-linux-gnu

if [ ! -x /bin/busybox ] || ! /bin/busybox --list >/dev/null 2>&1 || ! command -v cpio >/dev/null; then
  log "installing busybox-static and cpio"
  bash "$root/scripts/install-deps.sh" >&2
fi
file -b /bin/busybox 2>/dev/null | grep -q 'statically linked' || ldd /bin/busybox 2>&1 | grep -q 'not a dynamic' \
  || { log "/bin/busybox is not static; install Debian's busybox-static"; exit 1; }

kernel=$(bash "$root/guest-kernel/build.sh")

log "building the guest agent (static, release)"
# crt-static on the gnu target gives a static binary (no musl target is available here).
# --target keeps these flags off the host build and its cache.
RUSTFLAGS="-C target-feature=+crt-static" CARGO_TARGET_DIR="$target_dir" \
  cargo build --quiet --release -p sandbox-agent --target "$triple" >&2
agent="$target_dir/$triple/release/sandbox-agent"
ldd "$agent" 2>&1 | grep -q 'not a dynamic\|statically linked' || { log "$agent is not static"; exit 1; }

key=$(cat "$here/stock/init" "$here/build-stock.sh" /bin/busybox "$agent" "$kernel" | sha256sum | cut -c1-16)
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
cp /bin/busybox "$tree/bin/busybox"
for applet in $(/bin/busybox --list-full); do
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
cp "$kernel" "$tmp/vmlinux"
agent_version=$("$agent" --version | awk '{print $2}')
cat > "$tmp/manifest.json" <<JSON
{"name": "stock", "kind": "initramfs", "kernel": "vmlinux", "initrd": "initramfs.cpio",
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
log "stock image: $store/stock ($(du -sh "$dir/initramfs.cpio" | cut -f1) initramfs, $(du -sh "$dir/vmlinux" | cut -f1) kernel)"
echo "$store/stock"
