#!/usr/bin/env bash
# Runs schemathesis, the OpenAPI contract tester, at a pinned version from PyPI. The first call
# installs it (with its dependencies at the versions of scripts/schemathesis-constraints.txt) into
# a virtualenv under the cache directory, <cache>/schemathesis/venv-<version>; later calls reuse
# it. Every argument goes to schemathesis. api/tests/api_contract.rs runs it against the service;
# by hand, against a running service:
#
#   SANDBOX_HOST_TOKEN=... SANDBOX_HOST_CONTRACT_ID=sbx-... \
#     scripts/schemathesis.sh --config-file api/tests/contract/schemathesis.toml \
#     run docs/openapi.json --url http://127.0.0.1:3004
#
#   scripts/schemathesis.sh --version    # installs it if needed, prints the version
#
# Exit status: schemathesis's own, or 3 when it cannot be installed (no python3 3.11 or newer with
# venv, or PyPI cannot be reached), with the reason on stderr.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"

# Pinned: the checks, the configuration keys and the report that the contract test reads are
# this version's.
version=4.32.5
venv=$(sandbox_cache_dir)/schemathesis/venv-$version
log() { printf '[schemathesis.sh] %s\n' "$*" >&2; }
fail_install() {
  log "cannot install schemathesis $version: $*"
  exit 3
}

# The stamp is written last: a venv without it is a half-done install, made again.
if [ ! -f "$venv/.installed" ]; then
  python=${SANDBOX_HOST_PYTHON:-python3}
  command -v "$python" >/dev/null ||
    fail_install "no $python on PATH; install Python 3.11 or newer (Debian: apt-get install python3 python3-venv)"
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail_install "schemathesis $version needs Python 3.11 or newer, and $python is $("$python" --version 2>&1); set SANDBOX_HOST_PYTHON to a newer one"
  log "installing schemathesis $version from PyPI into $venv"
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv" >&2 ||
    fail_install "$python -m venv failed (Debian: apt-get install python3-venv)"
  # pip reads the proxy from the environment; bounded retries, so a machine without PyPI fails
  # in about a minute instead of waiting on the default retries.
  if ! "$venv/bin/pip" install --quiet --disable-pip-version-check --timeout 20 --retries 2 \
      --constraint "$root/scripts/schemathesis-constraints.txt" "schemathesis==$version" >&2; then
    rm -rf "$venv"
    fail_install "pip could not fetch it from PyPI (pip's messages say why); check the network or the proxy settings (HTTPS_PROXY)"
  fi
  touch "$venv/.installed"
fi
exec "$venv/bin/schemathesis" "$@"
