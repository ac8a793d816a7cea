#!/usr/bin/env bash
# Checks the systemd unit deploy/systemd/sandbox-host.service with `systemd-analyze verify`,
# against a real hand-over: scripts/service-user.sh fills a runtime directory with the binaries the
# test build made, the unit's paths are pointed there, and every warning fails the test but one
# (DelegateSubgroup= is unknown to systemd before 254, such as Debian 12's 252, which ignores it).
# systemd does not run as PID 1 on the CI machines, so the unit is verified, not started.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[systemd-test %s] %s\n' "$(date +%T)" "$*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "skipped: needs root (scripts/service-user.sh hands files to another user)"; exit 77; }
command -v systemd-analyze >/dev/null || { log "FAILED: no systemd-analyze (Debian: apt-get install systemd)"; exit 1; }
target=${CARGO_TARGET_DIR:-$(sandbox_cache_dir)/target}
work=$(mktemp -d /tmp/systemd-test.XXXXXX)
trap 'rm -rf "$work"' EXIT
chmod 0755 "$work"
rt=$work/rt
bash "$root/scripts/service-user.sh" --cgroup sandbox-host-unit-test "$rt" "$target/debug/sandbox-host" >/dev/null
unit=$work/sandbox-host.service
sed "s|/var/lib/sandbox-host|$rt|g" "$root/deploy/systemd/sandbox-host.service" > "$unit"
out=$(systemd-analyze verify "$unit" 2>&1 || true)
version=$(systemd --version | awk 'NR == 1 { print $2 }')
bad=$(printf '%s\n' "$out" | grep -v '^$' | grep -v "Unknown key 'DelegateSubgroup'" || true)
if [ "$version" -ge 254 ] && printf '%s\n' "$out" | grep -q DelegateSubgroup; then
  bad=$out
fi
if [ -n "$bad" ]; then
  log "FAILED: systemd-analyze verify (systemd $version) says:"; printf '%s\n' "$bad" >&2; exit 1
fi
log "systemd $version verifies the unit (${out:+only: $out})"
for c in memory pids cpu; do rmdir "/sys/fs/cgroup/$c/sandbox-host-unit-test" 2>/dev/null || true; done
