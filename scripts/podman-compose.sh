#!/usr/bin/env bash
# podman-compose at a pinned version from PyPI (Debian 12's own, 1.0.3, lacks profiles), in a
# virtualenv under the cache directory; the first call installs it. Every argument goes to it.
# podman 4.3 (Debian 12) has no `podman compose`; where it has, that works with
# docker-compose.yaml as well.
#
#   scripts/podman-compose.sh --profile sandbox up -d --no-deps --force-recreate server sandbox-host
#   scripts/podman-compose.sh --path     # installs it if needed, prints the program's path
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
# Pinned: the test reads its labels (io.podman.compose.project, com.docker.compose.service).
version=1.5.0
venv=$(sandbox_cache_dir)/podman-compose/venv-$version
if [ ! -f "$venv/.installed" ]; then
  echo "[podman-compose.sh] installing podman-compose $version from PyPI into $venv" >&2
  rm -rf "$venv"; mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install -q "podman-compose==$version" "python-dotenv==1.2.4" "PyYAML==6.0.4" >&2
  touch "$venv/.installed"
fi
if [ "${1:-}" = --path ]; then echo "$venv/bin/podman-compose"; exit 0; fi
exec "$venv/bin/podman-compose" "$@"
