#!/usr/bin/env bash
# Type-checks and lints the service for macOS on Apple silicon (`cargo clippy --target
# aarch64-apple-darwin`: sandbox-host, its QEMU backend, the jail's macOS side) on a Linux host, so that a change that breaks the macOS build fails here, where there is no Mac.
# A check runs no linker, but ring's build script still compiles its C and assembly with the
# target's C compiler, which needs Apple's SDK; its objects are never used by a check, so a
# stand-in compiler writes empty ones. Nothing built here runs anywhere.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$(sandbox_cache_dir)/target}
target=aarch64-apple-darwin
rustup target list --installed 2>/dev/null | grep -qx "$target" || rustup target add "$target" >&2
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
cat > "$stub/cc" <<'CC'
#!/bin/sh
# Stand-in C compiler for a check: clang (not clang-cl) to cc-rs's questions about the compiler's
# family, an empty object wherever one is asked for.
case " $* " in
  *" -E "*) echo '"clang"'; exit 0 ;;
  *" -? "*) exit 1 ;;  # not clang-cl
esac
while [ $# -gt 0 ]; do
  [ "$1" = -o ] && { : > "$2"; exit 0; }
  shift
done
CC
chmod +x "$stub/cc"
cd "$root"
# Warnings fail the check: code that only Linux uses must say so (cfg), or macOS carries it dead.
CC_aarch64_apple_darwin="$stub/cc" AR_aarch64_apple_darwin=ar \
  cargo clippy --quiet --target "$target" -p sandbox-host -p sandbox-vmm -p sandbox-control -p sandbox-net -p sandbox-jail --bins --lib "$@" -- -D warnings
echo "check-macos: sandbox-host, sandbox-vmm, sandbox-control, sandbox-net and sandbox-jail build for $target with no warning"
