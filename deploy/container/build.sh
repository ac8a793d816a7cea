#!/usr/bin/env bash
# Builds the sandbox host's container image with podman (or docker) from the Containerfile.
#
#   deploy/container/build.sh [--prebuilt [--profile release|dev]] [--with-guest] [--tag NAME]
#
# Without --prebuilt: the full multi-stage build from source (the build stage compiles the
# workspace in release, the guest kernel and the stock image), as `podman build .` does.
# --prebuilt: the runtime stage takes the binaries and the stock image this machine built
#   (scripts/prepare.sh; bin/up builds them), so nothing is compiled twice; --profile dev takes
#   the test suite's debug binaries (CI).
# --with-guest: the image also carries the Vantik guest image vantik-guest:latest, built on this
#   machine (as root: sudo python3 rootfs/build-guest.py); implies --prebuilt.
# --tag: the image's name (default: localhost/sandbox-host:latest, with-guest: ...:guest).
# Environment: CONTAINER_ENGINE (podman or docker; default: podman if present).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[container-build %s] %s\n' "$(date +%T)" "$*" >&2; }
prebuilt=0 guest=0 profile=release tag=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) prebuilt=1; shift ;;
    --with-guest) guest=1 prebuilt=1; shift ;;
    --profile) profile=$2; shift 2 ;;
    --tag) tag=$2; shift 2 ;;
    *) echo "usage: $0 [--prebuilt [--profile release|dev]] [--with-guest] [--tag NAME]" >&2; exit 2 ;;
  esac
done
engine=${CONTAINER_ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
[ -n "$tag" ] || { tag=localhost/sandbox-host:latest; [ $guest -eq 0 ] || tag=localhost/sandbox-host:guest; }
case "$profile" in release) dir=release ;; dev) dir=debug ;; *) log "--profile is release or dev"; exit 2 ;; esac

if [ $prebuilt -eq 0 ]; then
  log "building $tag from source with $engine (the build stage compiles everything: 15-30 minutes on 2 cores)"
  "$engine" build -f "$root/Containerfile" -t "$tag" "$root" >&2
else
  cache=$(sandbox_cache_dir)
  target=${CARGO_TARGET_DIR:-$cache/target}
  store=${SANDBOX_HOST_IMAGE_DIR:-$cache/images}
  for f in "$target/$dir/sandbox-host" "$target/$dir/sandbox-vm" "$target/$dir/sandbox-net"; do
    [ -x "$f" ] || { log "no $f: build it first (scripts/prepare.sh builds the release binaries, bin/test the dev ones)"; exit 1; }
  done
  [ -L "$store/stock" ] || { log "no stock image in $store: bash rootfs/build-stock.sh"; exit 1; }
  if [ $guest -eq 1 ] && [ ! -L "$store/vantik-guest/latest" ]; then
    log "no vantik-guest:latest in $store: build it first (sudo python3 rootfs/build-guest.py)"; exit 1
  fi
  ctx=$(mktemp -d "${TMPDIR:-/tmp}/sandbox-host-container.XXXXXX")
  trap 'rm -rf "$ctx"' EXIT
  mkdir -p "$ctx/prebuilt/bin" "$ctx/prebuilt/images" "$ctx/scripts" "$ctx/deploy/container"
  cp "$root/Containerfile" "$ctx/"
  cp "$root/scripts/service-cgroup.sh" "$ctx/scripts/"
  cp "$root/deploy/container/entrypoint.sh" "$ctx/deploy/container/"
  # Hard links where the file system allows: the guest image is large.
  cp -al "$target/$dir/sandbox-host" "$target/$dir/sandbox-vm" "$target/$dir/sandbox-net" "$ctx/prebuilt/bin/" 2>/dev/null \
    || cp -a "$target/$dir/sandbox-host" "$target/$dir/sandbox-vm" "$target/$dir/sandbox-net" "$ctx/prebuilt/bin/"
  copy_tag() {  # TAG-LINK (relative to the store)
    local link=$1 content
    content=$(readlink "$store/$link"); content=${content#../}
    mkdir -p "$ctx/prebuilt/images/$(dirname "$link")"
    cp -al "$store/$content" "$ctx/prebuilt/images/" 2>/dev/null || cp -a "$store/$content" "$ctx/prebuilt/images/"
    cp -P "$store/$link" "$ctx/prebuilt/images/$link"
  }
  copy_tag stock
  [ $guest -eq 0 ] || copy_tag vantik-guest/latest
  log "building $tag with $engine from this machine's $profile binaries and images"
  "$engine" build -f "$ctx/Containerfile" --target runtime-prebuilt -t "$tag" "$ctx" >&2
fi
log "built $tag: $("$engine" image inspect --format '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')"
echo "$tag"
