#!/usr/bin/env bash
# Makes, on a machine that cannot pull from a container registry, the two base images the
# Containerfile names, from Debian's packages: `debian:bookworm-slim` (a debootstrap minbase tree)
# and `rust:<version>-slim-bookworm` (that tree plus this machine's Rust toolchain, laid out as the
# official image lays it out: /usr/local/rustup, /usr/local/cargo, and the CA certificates this
# machine adds, so that cargo reaches the registry through the same proxy). Imported under the names the
# Containerfile uses, so the same file builds here and where the registry is reachable. Cached:
# an image already present is kept (remove it with `podman rmi` to make it again).
#
#   deploy/container/local-bases.sh [--runtime-only]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[local-bases %s] %s\n' "$(date +%T)" "$*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "run as root: debootstrap and podman's root storage need it"; exit 1; }
command -v debootstrap >/dev/null && command -v podman >/dev/null \
  || { log "needs debootstrap and podman: bash scripts/install-deps.sh --container"; exit 1; }

suite=bookworm
base=docker.io/library/debian:$suite-slim
rust_version=$(sed -n 's/^ARG RUST_VERSION=//p' "$root/Containerfile")
rust=docker.io/library/rust:$rust_version-slim-$suite
work=$(sandbox_cache_dir)/container
mkdir -p "$work"

if ! podman image exists "$base"; then
  tree=$work/$suite-minbase
  if [ ! -f "$tree/.complete" ]; then
    log "debootstrap $suite (minbase) into $tree"
    rm -rf "$tree"
    debootstrap --variant=minbase "$suite" "$tree" http://deb.debian.org/debian >&2
    # As the slim image: the security and updates suites, no apt caches, no documentation.
    cat > "$tree/etc/apt/sources.list" <<SOURCES
deb http://deb.debian.org/debian $suite main
deb http://deb.debian.org/debian $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SOURCES
    rm -rf "$tree"/var/cache/apt/archives/*.deb "$tree"/var/lib/apt/lists/* "$tree"/usr/share/doc/* "$tree"/usr/share/man/*
    touch "$tree/.complete"
  fi
  log "importing it as $base"
  tar -C "$tree" --exclude=./.complete -c . | podman import --change 'CMD ["bash"]' - "$base" >/dev/null
fi

[ "${1:-}" = --runtime-only ] && exit 0
if ! podman image exists "$rust"; then
  toolchain=$(rustup toolchain list | sed -n "s/^\($rust_version[^ ]*\).*/\1/p" | head -1)
  if [ -z "$toolchain" ]; then
    log "installing Rust $rust_version with rustup"
    rustup toolchain install "$rust_version" --profile minimal >&2
    toolchain=$(rustup toolchain list | sed -n "s/^\($rust_version[^ ]*\).*/\1/p" | head -1)
  fi
  home=$(rustup +"$toolchain" show home 2>/dev/null || echo "${RUSTUP_HOME:-$HOME/.rustup}")
  log "adding Rust $toolchain from $home to $base as $rust"
  ctx=$work/rust-context
  rm -rf "$ctx"; mkdir -p "$ctx/usr/local/rustup/toolchains" "$ctx/usr/local/cargo/bin"
  # The toolchain directory itself, not a link to it (rustup names a pinned version by a link to
  # the channel's directory).
  cp -a "$(readlink -f "$home/toolchains/$toolchain")" "$ctx/usr/local/rustup/toolchains/$toolchain"
  for b in cargo rustc rustdoc; do
    ln -s "../../rustup/toolchains/$toolchain/bin/$b" "$ctx/usr/local/cargo/bin/$b"
  done
  # The CA certificates this machine adds to Debian's (a proxy that inspects TLS, as on the CI
  # machines): cargo in the build stage reaches the crate registry through it.
  mkdir -p "$ctx/usr/local/share/ca-certificates"
  cp /usr/local/share/ca-certificates/*.crt "$ctx/usr/local/share/ca-certificates/" 2>/dev/null || true
  cat > "$ctx/Containerfile" <<FILE
FROM $base
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      ca-certificates gcc libc6-dev && rm -rf /var/lib/apt/lists/*
COPY usr /usr
RUN update-ca-certificates
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN cargo --version
FILE
  podman build \
    -t "$rust" "$ctx" >&2
  rm -rf "$ctx"
fi
