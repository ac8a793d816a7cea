#!/usr/bin/env bash
# Brings a machine to the point where sandbox-host runs: Debian packages, the guest kernel, the
# stock image, the guest image (as root) and the sandbox-host binary. Every step is cached; a second run takes seconds.
# Prints the path of the sandbox-host binary on its last line.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
. "$root/scripts/phase.sh"
cache=$(sandbox_cache_dir)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
log() { printf '[prepare %s] %s\n' "$(date +%T)" "$*" >&2; }

command -v cargo >/dev/null || { log "cargo is not installed: install Rust (https://rustup.rs) and run this again"; exit 1; }
if [ "$(uname -s)" = Darwin ]; then
  # macOS: Homebrew's QEMU runs the guests (HVF); the kernel and images are Linux builds, made in
  # a Linux container when they are missing (scripts/build-images-in-container.sh again rebuilds).
  command -v qemu-system-aarch64 >/dev/null && command -v qemu-img >/dev/null \
    || { log "QEMU is missing: brew install qemu"; exit 1; }
  store=$(sandbox_image_dir)
  if [ ! -f "$store/stock/manifest.json" ] || [ ! -f "$store/vantik-guest/latest/manifest.json" ]; then
    bash "$root/scripts/build-images-in-container.sh" >&2
  fi
else
  # SANDBOX_HOST_ARCH=aarch64 on an x86_64 host: the cross compilers and QEMU of that guest too.
  arch=$(sandbox_guest_arch)
  if [ "$arch" = "$(SANDBOX_HOST_ARCH=auto sandbox_guest_arch)" ]; then
    phase "Debian packages" bash "$root/scripts/install-deps.sh" >&2
  else
    phase "Debian packages" bash "$root/scripts/install-deps.sh" --aarch64 >&2
  fi
  # The guest image's tree (debootstrap, npm: the network and one processor) while the kernel
  # compiles; the image is assembled from it once the stock image exists.
  tree_pid=""
  if [ "$(id -u)" -eq 0 ]; then
    phase "guest image tree $arch (background)" python3 "$root/rootfs/build-guest.py" --tree-only >/dev/null &
    tree_pid=$!
  fi
  phase "kernel $arch" bash "$root/guest-kernel/build.sh" "$arch" >/dev/null
  phase "stock image $arch" bash "$root/rootfs/build-stock.sh" >/dev/null
  # The default image of a create request; building it needs root (debootstrap, chroot, mounts).
  [ -z "$tree_pid" ] || wait "$tree_pid" || { log "building the guest image's tree failed (its log is above)"; exit 1; }
  if [ "$(id -u)" -eq 0 ]; then
    phase "guest image $arch" python3 "$root/rootfs/build-guest.py" >/dev/null
  else
    log "not root, so the guest image vantik-guest:latest is not built and sandboxes get the stock image; build it with: sudo python3 rootfs/build-guest.py"
  fi
fi
# What operators run is an optimised build; the test suite builds its own (dev profile, faster to
# build) and sets SANDBOX_HOST_BUILD_PROFILE=dev so it does not pay for a second one.
profile=${SANDBOX_HOST_BUILD_PROFILE:-release}
case "$profile" in
  release) log "building sandbox-host and its VM and network programs sandbox-vm and sandbox-net (release; the first time takes a few minutes)"
           phase "cargo build (release)" bash -c 'cd "$1" && cargo build --quiet --release -p sandbox-host -p sandbox-vm -p sandbox-net --bins' _ "$root" >&2
           echo "$CARGO_TARGET_DIR/release/sandbox-host" ;;
  dev)     log "building sandbox-host, sandbox-vm and sandbox-net (dev profile)"
           phase "cargo build (dev)" bash -c 'cd "$1" && cargo build --quiet -p sandbox-host -p sandbox-vm -p sandbox-net --bins' _ "$root" >&2
           echo "$CARGO_TARGET_DIR/debug/sandbox-host" ;;
  *)       log "SANDBOX_HOST_BUILD_PROFILE must be release or dev, not $profile"; exit 2 ;;
esac
