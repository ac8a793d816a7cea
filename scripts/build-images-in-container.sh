#!/usr/bin/env bash
# Builds the guest kernel, the stock image and the Vantik guest image in a Linux container, into
# this machine's image store: how a Mac gets its images (podman machine or Docker Desktop run an
# arm64 Linux VM on Apple silicon, so the build is native aarch64 there), and any host that has no
# Debian tooling. The same scripts as on a Debian host run inside (install-deps.sh,
# rootfs/build-stock.sh, rootfs/build-guest.py), as root in a privileged container, because the
# guest image's debootstrap, chroot and mounts need it; the container is removed afterwards.
# The cache directory is shared, so a second run rebuilds nothing and takes a minute (the
# container's packages).
#
#   scripts/build-images-in-container.sh [--stock-only]
#
# Environment: SANDBOX_HOST_CONTAINER_ENGINE (podman, else docker), SANDBOX_HOST_CACHE,
# SANDBOX_HOST_BUILD_IMAGE (the Rust image it runs in: the Containerfile's rust:<version>-slim-bookworm).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[images-in-container %s] %s\n' "$(date +%T)" "$*" >&2; }
stock_only=0
[ "${1:-}" = --stock-only ] && stock_only=1

engine=${SANDBOX_HOST_CONTAINER_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v podman >/dev/null; then engine=podman
  elif command -v docker >/dev/null; then engine=docker
  else
    log "needs podman or docker (macOS: brew install podman && podman machine init && podman machine start)"
    exit 1
  fi
fi
rust_version=$(sed -n 's/^ARG RUST_VERSION=//p' "$root/Containerfile")
image=${SANDBOX_HOST_BUILD_IMAGE:-docker.io/library/rust:$rust_version-slim-bookworm}
cache=$(sandbox_cache_dir)
store=$(sandbox_image_dir)
mkdir -p "$cache" "$store"
# The builds inside see the cache at /cache and this machine's image store at /images (links in
# the store are relative, so they resolve on both sides).
# Cargo's output of the container's platform stays apart from this machine's own builds.
steps='bash /src/scripts/install-deps.sh && bash /src/rootfs/build-stock.sh'
[ $stock_only = 1 ] || steps="$steps && python3 /src/rootfs/build-guest.py"
log "building the images with $engine in $image (the first time: 15 to 30 minutes)"
"$engine" run --rm --privileged \
  -v "$root:/src" -v "$cache:/cache" -v "$store:/images" \
  -e SANDBOX_HOST_CACHE=/cache -e SANDBOX_HOST_IMAGE_DIR=/images -e CARGO_TARGET_DIR=/cache/target-linux \
  -e SANDBOX_HOST_ARCH -e DEBIAN_FRONTEND=noninteractive \
  "$image" bash -c "set -e; $steps >/dev/null"
log "images in $store: $(ls "$store" | tr '\n' ' ')"
