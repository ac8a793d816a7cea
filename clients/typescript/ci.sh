#!/usr/bin/env bash
# The TypeScript client's CI, which bin/test calls with the cache directory it uses:
#
#   bash clients/typescript/ci.sh CACHE_DIR
#
# Node.js from scripts/install-node.sh (CACHE_DIR/node), `npm ci` with its downloads kept in
# CACHE_DIR/npm (a warm run fetches nothing), the generated types checked against
# docs/openapi.json, then `npm test`: the unit tests and the flow test against the real service,
# SANDBOX_HOST_BIN=${CARGO_TARGET_DIR:-CACHE_DIR/target}/debug/sandbox-host (built beforehand, with
# sandbox-vm and sandbox-net beside it). Under SANDBOX_HOST_REQUIRE_E2E=1 (bin/test sets it) the
# flow test fails, rather than skips, without the binary or the images; as root it runs the
# service as the user sandbox-host, as the Rust tests do. Each step's seconds go to stderr.
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 CACHE_DIR" >&2; exit 2; }
cache=$(mkdir -p "$1" && cd "$1" && pwd)
pkg=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$pkg/../.." && pwd)

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
say() { echo "ts-client: $*" >&2; }
began=$(now)
trap 'say "all: $(since "$began") s"' EXIT
# step NAME COMMAND...: runs it, then says how long it took, and whether it failed.
step() {
  local name=$1 t rc=0
  shift
  t=$(now)
  say "$name ..."
  "$@" || rc=$?
  if [ "$rc" -eq 0 ]; then say "$name: $(since "$t") s"; else say "$name: $(since "$t") s, failed (exit $rc)"; fi
  return "$rc"
}

# Node.js on PATH (the function runs in this shell, so PATH stays set).
node_on_path() {
  local bin
  bin=$(cd "$root" && bash scripts/install-node.sh "$cache/node") || return
  PATH="$bin:$PATH"
}
step "node" node_on_path
say "node $(node --version), npm $(npm --version)"

export npm_config_update_notifier=false
cd "$pkg"
step "npm ci" npm ci --no-audit --no-fund --prefer-offline --cache "$cache/npm"
step "check-types" npm run check-types
export SANDBOX_HOST_BIN="${CARGO_TARGET_DIR:-$cache/target}/debug/sandbox-host"
say "SANDBOX_HOST_BIN=$SANDBOX_HOST_BIN"
step "npm test" npm test
