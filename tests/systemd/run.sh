#!/usr/bin/env bash
# The systemd unit deploy/systemd/sandbox-host.service, in two steps:
#   1. `systemd-analyze verify` against a real hand-over: scripts/service-user.sh fills a runtime
#      directory with the binaries the test build made, the unit's paths are pointed there, and
#      every warning fails the test but one (DelegateSubgroup= is unknown to systemd before 254,
#      such as Debian 12's 252, which ignores it);
#   2. the unit run by a real systemd: systemd does not run as PID 1 on the CI machines, so it boots
#      as PID 1 of a podman container (tests/systemd/Containerfile: the runtime image, prepared as
#      deploy/systemd/install.sh prepares a host). There the unit must start, with every part of the
#      jail (SANDBOX_HOST_JAIL=required); the service runs as sandbox-host with no_new_privs off
#      (newuidmap needs it off), its VM under a uid of its own; a sandbox runs a command; the
#      upgrade path and a crash each restart the service, which takes the sandbox on again; and
#      `systemctl stop` disposes of it and the service exits cleanly.
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

# The root-run cgroup step refuses names that would reach outside its subtree.
for bad in / ../x a/../b . 'a b'; do
  if sh "$root/scripts/service-cgroup.sh" --v1-only "$bad" sandbox-host 2>/dev/null; then
    log "FAILED: service-cgroup.sh accepted the cgroup name '$bad'"; exit 1
  fi
done

# 2. Under systemd, in a container.
fail() { log "FAILED: $*"; podman logs sdtest-unit 2>&1 | tail -5 >&2 || true; exit 1; }
bash "$root/scripts/install-deps.sh" --container >&2
export CONTAINERS_CONF=$root/deploy/container/containers.conf
bash "$root/deploy/container/local-bases.sh" --runtime-only
base=$(bash "$root/deploy/container/build.sh" --prebuilt --profile dev --tag localhost/sandbox-host:latest)
token=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')
ctx=$work/ctx
mkdir -p "$ctx/deploy/systemd"
cp -a "$root/scripts" "$ctx/"
cp "$root/deploy/systemd/sandbox-host.service" "$ctx/deploy/systemd/"
podman build -q -f "$root/tests/systemd/Containerfile" --build-arg BASE="$base" --build-arg TOKEN="$token" \
  -t localhost/sandbox-host-systemd-test:latest "$ctx" >/dev/null
podman rm -f -t 5 sdtest-unit >/dev/null 2>&1 || true
trap 'podman rm -f -t 5 sdtest-unit >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
# As the container deployment: the cgroup tree writable, /proc unmasked for the jail's own /proc.
podman run -d --name sdtest-unit --systemd=always -v /sys/fs/cgroup:/sys/fs/cgroup:rw \
  --security-opt systempaths=unconfined localhost/sandbox-host-systemd-test:latest >/dev/null
inside() { podman exec sdtest-unit "$@"; }
line=""
for _ in $(seq 1 90); do
  line=$(inside journalctl -u sandbox-host --no-pager -o cat 2>/dev/null | grep -m1 '"Listening on' || true)
  [ -n "$line" ] && break
  sleep 2
done
[ -n "$line" ] || fail "the unit did not log 'Listening on' within 180 s: $(inside systemctl status sandbox-host --no-pager 2>&1 | tail -5)"
echo "$line" | grep -q '"available":true' || fail "the service under systemd is not available: $line"
# The log line carries the jail as a JSON string, its quotes escaped.
echo "$line" | grep -qE 'missing\\?":\[\]' || fail "the jail under systemd is incomplete: $line"
pid=$(inside systemctl show -p MainPID --value sandbox-host)
inside grep -q "^Uid:[[:space:]]*$(inside id -u sandbox-host)[[:space:]]" "/proc/$pid/status" || fail "the service does not run as sandbox-host"
inside grep -q '^NoNewPrivs:[[:space:]]*0' "/proc/$pid/status" || fail "the unit sets no_new_privs, which breaks newuidmap"
api() { inside curl -sS --max-time 300 -H "Authorization: Bearer $token" "$@"; }
id=$(api -H 'content-type: application/json' -d '{"run_id":"systemd-test","time_limit_ms":600000,"review":false,"memory_mib":256}' \
       http://127.0.0.1:3004/v1/sandboxes | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
[ -n "$id" ] || fail "create under systemd gave no sandbox id"
out=$(api -H 'content-type: application/json' -d '{"argv":["uname","-m"]}' "http://127.0.0.1:3004/v1/sandboxes/$id/exec")
echo "$out" | grep -q "\"stdout\":\"$(printf 'x86_64\n' | base64)\"" || fail "exec under systemd: $out"
# The first QEMU's (the service may be building a template beside the sandbox: two of them). No
# `| head` here: with pipefail, the writer's SIGPIPE would fail the run.
vm_uid=$(inside sh -c 'for p in /proc/[0-9]*; do [ "$(cat $p/comm 2>/dev/null)" = qemu-system-x86 ] && { stat -c %u $p; break; }; done; true')
case "$vm_uid" in 16000*) ;; *) fail "the VM process runs as uid '${vm_uid}', not one of the jail's (1600000000-1600065535)" ;; esac
# A restart keeps the run (issue 32): the upgrade path (SIGUSR2 to the service alone: it hands
# over and exits 75, which the unit restarts on) and a crash (SIGKILL: KillMode=process leaves the
# VM running, Restart=on-failure starts the service again); each time the new service takes the
# sandbox on again, and its file is still there.
api -H 'content-type: application/json' -d '{"command":"echo kept > /workspace/file"}' \
  "http://127.0.0.1:3004/v1/sandboxes/$id/exec" >/dev/null
n=0
for how in SIGUSR2 SIGKILL; do
  n=$((n + 1))
  old=$(inside systemctl show -p MainPID --value sandbox-host)
  inside systemctl kill --kill-whom=main --signal="$how" sandbox-host
  took=0
  for _ in $(seq 1 90); do
    took=$(inside journalctl -u sandbox-host --no-pager -o cat 2>/dev/null | grep -c 'Took on again a sandbox' || true)
    now=$(inside systemctl show -p MainPID --value sandbox-host)
    [ "$took" -ge "$n" ] && [ "$now" != "$old" ] && [ "$now" != 0 ] && break
    sleep 2
  done
  [ "$took" -ge "$n" ] || fail "after $how the unit's new service did not take $id on again: $(inside systemctl status sandbox-host --no-pager 2>&1 | tail -5)"
  out=""
  for _ in $(seq 1 30); do
    out=$(api -H 'content-type: application/json' -d '{"command":"cat /workspace/file"}' \
      "http://127.0.0.1:3004/v1/sandboxes/$id/exec" 2>/dev/null || true)
    echo "$out" | grep -q "\"stdout\":\"$(printf 'kept\n' | base64)\"" && break
    sleep 1
  done
  echo "$out" | grep -q "\"stdout\":\"$(printf 'kept\n' | base64)\"" || fail "after $how the run's file is gone: $out"
  log "after $how the unit's service took $id on again, with its file"
done
inside systemctl stop sandbox-host
inside journalctl -u sandbox-host --no-pager -o cat > "$work/journal"
grep 'Disposed of sandbox' "$work/journal" | grep "$id" >/dev/null \
  || fail "systemctl stop did not dispose of $id"
result=$(inside systemctl show -p Result --value sandbox-host)
[ "$result" = success ] || fail "the service's stop result is $result, not success"
log "systemd $version ran the unit: available with the full jail, VM uid $vm_uid, exec ok, kept across a hand-over and a crash, stop disposed of $id"
