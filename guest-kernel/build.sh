#!/usr/bin/env bash
# Builds the sandbox-host guest kernel (an uncompressed vmlinux with a PVH entry on x86_64, an
# uncompressed Image on aarch64) from Debian's linux-source-6.12 and caches it keyed by a hash of
# its config, so a second run is instant.
#   guest-kernel/build.sh [VARIANT]  build (or reuse) and print the path of the kernel
# Environment: SANDBOX_HOST_CACHE (cache root), JOBS (parallel make jobs, default: all cores).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/.." && pwd)
. "$root/scripts/cache-dir.sh"

# Variants: x86_64 (the guest kernel, which is also the nested test host's: it has KVM built in,
# inert in a sandbox), aarch64 (the guest kernel of QEMU's `virt` machine, cross-built with
# Debian's gcc-aarch64-linux-gnu on an x86_64 host, natively on an aarch64 one). nested-host is
# another name for x86_64, kept for scripts that still use it.
variant=${1:-x86_64}
[ "$variant" = nested-host ] && variant=x86_64
make_args=()
image=vmlinux
case "$variant" in
  x86_64) fragments=("$here/x86_64.config") ;;
  aarch64)
    # The architecture-neutral part of x86_64.config, then what arm64 needs: one list of what a
    # guest kernel holds, whatever its architecture.
    neutral=$(mktemp)
    trap 'rm -f "$neutral"' EXIT
    grep -v -F -w -f <(grep -v '^#' "$here/aarch64.exclude") "$here/x86_64.config" > "$neutral"
    fragments=("$neutral" "$here/aarch64.config")
    make_args=(ARCH=arm64)
    if [ "$(uname -m)" != aarch64 ]; then
      command -v aarch64-linux-gnu-gcc >/dev/null || bash "$root/scripts/install-deps.sh" --aarch64 >&2
      make_args+=(CROSS_COMPILE=aarch64-linux-gnu-)
    fi
    image=Image ;;
  *) echo "guest-kernel: unknown variant '$variant' (x86_64 or aarch64; nested-host is x86_64)" >&2; exit 2 ;;
esac
arch=$variant
tarball=/usr/src/linux-source-6.12.tar.xz
log() { printf '[guest-kernel %s] %s\n' "$(date +%T)" "$*" >&2; }

if [ ! -f "$tarball" ] || ! command -v flex >/dev/null || ! command -v bison >/dev/null || ! command -v bc >/dev/null; then
  log "installing linux-source-6.12 and the kernel build dependencies"
  bash "$root/scripts/install-deps.sh" >&2
fi

src_version=$(dpkg-query -W -f='${Version}' linux-source-6.12 2>/dev/null || stat -c %s "$tarball")
# The key covers what decides the output: the fragments, the source version, and BUILD_REV, which
# is bumped when a change to this script changes what it builds (edits that do not, keep the cache).
BUILD_REV=2
key=$( { cat "${fragments[@]}"; echo "$src_version rev $BUILD_REV"; } | sha256sum | cut -c1-16)
cache=$(sandbox_cache_dir)
out="$cache/kernel/$arch-$key"
if [ -f "$out/$image" ]; then
  log "cached: $out/$image"
  echo "$out/$image"
  exit 0
fi

# One source tree per variant, so switching variants does not rebuild everything.
work="$cache/kernel-build/$variant"
tree="$work/linux-source-6.12"
mkdir -p "$work"
if [ "$(cat "$work/.extracted" 2>/dev/null)" != "$src_version" ]; then
  log "extracting $tarball (linux-source $src_version)"
  rm -rf "$tree"
  tar -xJf "$tarball" -C "$work"
  echo "$src_version" > "$work/.extracted"
fi

cd "$tree"
log "configuring: tinyconfig + ${fragments[*]##*/}"
make -s "${make_args[@]}" tinyconfig >/dev/null
scripts/kconfig/merge_config.sh -m .config "${fragments[@]}" >/dev/null
make -s "${make_args[@]}" olddefconfig >/dev/null

# Every option the fragment asks for must have survived olddefconfig: a silently dropped option
# (a typo, a missing dependency) would give a kernel that boots but lacks a feature.
bad=0
while IFS= read -r line; do
  case "$line" in
    CONFIG_*=n) opt=${line%%=*}; grep -q "^$opt=" .config && { log "option $opt is set, fragment wants it off"; bad=1; } ;;
    CONFIG_*=*) grep -qx "$line" .config || { log "option ${line%%=*} did not take (wanted ${line#*=}; got: $(grep "^${line%%=*}=\|^# ${line%%=*} is not set" .config || echo absent))"; bad=1; } ;;
  esac
done < <(cat "${fragments[@]}" | grep -E '^CONFIG_')
[ "$bad" = 0 ] || { log "the config fragments did not apply cleanly; fix ${fragments[*]}"; exit 1; }

jobs=${JOBS:-$(nproc)}
log "building $image with $jobs jobs (about 5 minutes on 2 cores); progress every 100 objects"
start=$(date +%s)
n=0
make -j"$jobs" "${make_args[@]}" "$image" 2>&1 | while IFS= read -r line; do
  case "$line" in
    *" CC "*|*" AS "*|*" LD "*|*" AR "*)
      n=$((n + 1))
      [ $((n % 100)) -eq 0 ] && log "$n objects, $(( $(date +%s) - start ))s" ;;
    *error*|*Error*|*warning:*) printf '%s\n' "$line" >&2 ;;
  esac
done
[ "${PIPESTATUS[0]}" -eq 0 ] || { log "make $image failed"; exit 1; }
log "built in $(( $(date +%s) - start ))s"

mkdir -p "$cache/kernel"
tmp=$(mktemp -d "$cache/kernel/.tmp.XXXXXX")
case "$image" in
  vmlinux) cp vmlinux "$tmp/vmlinux" ;;
  Image) cp arch/arm64/boot/Image "$tmp/Image" ;;
esac
cp .config "$tmp/config"
rm -rf "$out"
mv "$tmp" "$out"
log "$image: $out/$image ($(du -h "$out/$image" | cut -f1))"
echo "$out/$image"
