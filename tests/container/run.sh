#!/usr/bin/env bash
# The container deployment, tested as operators run it (docs/operator-guide.md, "On Linux, in a
# container"), with podman and podman-compose on this machine:
#   - the base image is made locally (deploy/container/local-bases.sh: no registry is reachable),
#     the runtime image is assembled from the binaries and stock image the host build made
#     (deploy/container/build.sh --prebuilt), the server stand-in from its own Containerfile;
#   - without /dev/kvm mapped: the log says `No /dev/kvm in this container`, the service still runs
#     sandboxes (QEMU/TCG), and the health's warning says why;
#   - with the guide's command (`--profile sandbox up -d --no-deps --force-recreate server
#     sandbox-host`): `Listening on 0.0.0.0:3004` with its backend, no published port;
#   - in both: the service runs as the user sandbox-host (not root), each VM process under a uid of
#     its own with every part of the jail (SANDBOX_HOST_JAIL=required), and from the server's
#     container, over the compose network, a client creates a sandbox, runs an exec, puts and gets
#     an archive and deletes it; SIGTERM to the container disposes of every sandbox within the
#     grace period, and the container exits 0.
# Needs root (podman's root storage, debootstrap). Every wait is bounded.
#
#   tests/container/run.sh [--prebuilt-profile release|dev] [--prepare-only]
#     (default dev: what bin/test built; --prepare-only builds the images and stops, so that
#     bin/test can make them beside the other tests)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
. "$root/scripts/cache-dir.sh"
profile=dev prepare_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt-profile) profile=$2; shift 2 ;;
    --prepare-only) prepare_only=1; shift ;;
    *) echo "usage: $0 [--prebuilt-profile release|dev] [--prepare-only]" >&2; exit 2 ;;
  esac
done
log() { printf '[container-test %s] %s\n' "$(date +%T)" "$*" >&2; }
fail() { log "FAILED: $*"; exit 1; }
[ "$(id -u)" -eq 0 ] || { log "skipped: needs root (podman's root storage and debootstrap)"; exit 77; }

bash "$root/scripts/install-deps.sh" --container >&2
export CONTAINERS_CONF=$root/deploy/container/containers.conf
compose=$(bash "$root/scripts/podman-compose.sh" --path)
bash "$root/deploy/container/local-bases.sh" --runtime-only
image=$(bash "$root/deploy/container/build.sh" --prebuilt --profile "$profile" --tag localhost/sandbox-host:latest)
# Built every time (podman's layer cache makes an unchanged one instant).
podman build -q -f "$root/deploy/container/server.Containerfile" -t localhost/sandbox-host-server:latest \
  "$root/deploy/container" >/dev/null
if [ $prepare_only = 1 ]; then
  log "images ready: $image, localhost/sandbox-host-server:latest"
  exit 0
fi

project=sbxtest
work=$(mktemp -d "${TMPDIR:-/tmp}/container-test.XXXXXX")
cleanup() {
  # By label and name, not through compose: a stale project from a run that died is removed too.
  podman ps -aq --filter "label=io.podman.compose.project=$project" | xargs -r podman rm -f -t 5 >/dev/null 2>&1 || true
  podman rm -f -t 5 "$project-nokvm" "$project-gw" >/dev/null 2>&1 || true
  podman volume rm -f "${project}_sandbox-images" "${project}_sandbox-state" \
    "$project-nokvm-state" "$project-nokvm-images" >/dev/null 2>&1 || true
  podman pod rm -f "pod_$project" >/dev/null 2>&1 || true
  rm -rf "$work"
  # Each run's image replaces the last: drop the untagged ones it leaves.
  podman image prune -f >/dev/null 2>&1 || true
}
trap cleanup EXIT
cleanup; mkdir -p "$work"
cp "$root/docker-compose.yaml" "$work/"
mkdir -p "$work/deploy/container"
cp "$root/deploy/container/server.Containerfile" "$work/deploy/container/"
# A base64 token with '=' at its end: the service and the server must see it whole.
token=$(od -An -tx1 -N30 /dev/urandom | tr -d ' \n')==
# The guide's .env, with a memory budget for the two sandboxes a run of this test holds at most,
# and every part of the jail required (a part the container cannot give fails the test).
cat > "$work/.env" <<EOF
SANDBOX_HOST_TOKEN=$token
SANDBOX_HOST_CONTAINER_URL=http://sandbox-host:3004
SANDBOX_HOST_JAIL=required
SANDBOX_HOST_MEMORY_LIMIT_MIB=1024
SANDBOX_HOST_PROBE_TIMEOUT_S=120
EOF

# Waits (bounded) until the container's log has a line matching $2; prints that line.
wait_log() {
  local ctr=$1 pattern=$2 limit=${3:-240} t=0 line
  while [ $t -lt "$limit" ]; do
    line=$(podman logs "$ctr" 2>&1 | grep -m1 -E "$pattern" || true)
    [ -n "$line" ] && { echo "$line"; return 0; }
    if [ "$(podman inspect -f '{{.State.Running}}' "$ctr" 2>/dev/null)" != true ]; then
      podman logs "$ctr" 2>&1 | tail -20 >&2
      fail "$ctr stopped before logging /$pattern/"
    fi
    sleep 2; t=$((t + 2))
  done
  podman logs "$ctr" 2>&1 | tail -20 >&2
  fail "$ctr did not log /$pattern/ within ${limit}s"
}

# curl from the server's container, over the compose network, with the shared token (from the
# header file the stand-in writes from its environment: never in an argument list).
api() {
  podman exec -i "$server" curl -sS --max-time 300 -H @/tmp/auth "$@"
}

# The service runs as sandbox-host; its VM processes as uids of their own from its subordinate ids.
check_users() {
  local ctr=$1 top
  top=$(podman top "$ctr" huser user comm)
  echo "$top" >&2
  echo "$top" | awk '$3 == "sandbox-host" && $2 == "sandbox-host" { ok = 1 } END { exit !ok }' \
    || fail "the service in $ctr does not run as the user sandbox-host"
  # Nothing runs as root but the init (and, for an instant, a health check's setpriv).
  echo "$top" | awk 'NR > 1 && $2 == "root" && $3 !~ /^(podman-init|catatonit|setpriv)$/ { bad = 1 } END { exit bad }' \
    || fail "a process in $ctr runs as root"
  # The VM process: QEMU, or sandbox-vm on the KVM backend.
  echo "$top" | awk '$3 ~ /^(qemu-system|sandbox-vm)/ && $2 !~ /^16000[0-9]+$/ { bad = 1 } $3 ~ /^(qemu-system|sandbox-vm)/ { n++ }
                     END { exit bad || n == 0 }' \
    || fail "no VM process in $ctr, or one outside the jail's ids (1600000000-1600065535)"
  # The service holds no capability, and its bounding set only what newuidmap/newgidmap need.
  top=$(podman top "$ctr" comm capeff capbnd)
  echo "$top" >&2
  echo "$top" | awk '$1 == "sandbox-host" { n++; if ($2 != "none" || $3 != "SETGID,SETUID") bad = 1 } END { exit bad || n == 0 }' \
    || fail "the service in $ctr holds capabilities, or more than SETGID,SETUID in its bounding set"
}

# A sandbox's life from the server's container: create, exec, archive in and out, delete.
# Leaves one more sandbox running for the SIGTERM check; prints its id.
exercise() {
  local ctr=$1 id out kept
  api "$SANDBOX_HOST_URL/v1/health" | tee "$work/health.json" >&2; echo >&2
  grep -q '"available":true' "$work/health.json" || fail "the sandbox host in $ctr is not available"
  grep -q '"missing":\[\]' "$work/health.json" || fail "the jail in $ctr is incomplete"
  id=$(api -H 'content-type: application/json' -d '{"run_id":"container-test","time_limit_ms":600000,"review":false,"memory_mib":256}' \
         "$SANDBOX_HOST_URL/v1/sandboxes" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
  [ -n "$id" ] || fail "create in $ctr gave no sandbox id"
  log "created $id in $ctr"
  check_users "$ctr"
  out=$(api -H 'content-type: application/json' -d '{"command":"echo hello from $(uname -m); exit 3"}' \
          "$SANDBOX_HOST_URL/v1/sandboxes/$id/exec")
  echo "$out" | grep -q "\"stdout\":\"$(printf 'hello from x86_64\n' | base64)\"" || fail "exec output: $out"
  echo "$out" | grep -q '"exit_code":3' || fail "exec exit: $out"
  podman exec -i "$server" sh -c 'mkdir -p /tmp/in/sub && echo archived > /tmp/in/sub/file.txt && tar -C /tmp/in -cf /tmp/in.tar .'
  api -X PUT --data-binary @/tmp/in.tar -H 'content-type: application/x-tar' -o /dev/null -w '%{http_code}\n' \
    "$SANDBOX_HOST_URL/v1/sandboxes/$id/archive?path=/workspace/put" | grep -qx 204 || fail "archive put"
  out=$(api -H 'content-type: application/json' -d '{"argv":["cat","/workspace/put/sub/file.txt"]}' \
          "$SANDBOX_HOST_URL/v1/sandboxes/$id/exec")
  echo "$out" | grep -q "\"stdout\":\"$(printf 'archived\n' | base64)\"" || fail "the archive's file in the guest: $out"
  podman exec -i "$server" sh -c "curl -sS --max-time 60 -H @/tmp/auth '$SANDBOX_HOST_URL/v1/sandboxes/$id/archive?path=/workspace/put' -o /tmp/out.tar && tar -xOf /tmp/out.tar sub/file.txt" \
    | grep -qx archived || fail "archive get"
  api -X DELETE -o /dev/null -w '%{http_code}\n' "$SANDBOX_HOST_URL/v1/sandboxes/$id" | grep -qx 204 || fail "delete"
  api "$SANDBOX_HOST_URL/v1/sandboxes/$id" -o /dev/null -w '%{http_code}\n' | grep -qx 404 || fail "the deleted sandbox is still there"
  log "create, exec, archive in and out, delete: ok in $ctr"
  kept=$(api -H 'content-type: application/json' -d '{"run_id":"container-test-kept","time_limit_ms":600000,"review":false,"memory_mib":256}' \
           "$SANDBOX_HOST_URL/v1/sandboxes" | sed -n 's/.*"id":"\([^"]*\)".*/\1/p')
  [ -n "$kept" ] || fail "second create in $ctr"
  echo "$kept"
}

# SIGTERM: every sandbox disposed of within the grace period, exit status 0.
check_stop() {
  local ctr=$1 kept=$2 start secs code
  shift 2
  start=$(date +%s)
  "$@" >/dev/null 2>&1
  secs=$(( $(date +%s) - start ))
  code=$(podman inspect -f '{{.State.ExitCode}}' "$ctr")
  local logs
  logs=$(podman logs "$ctr" 2>&1)
  grep -E 'Disposed of sandbox' <<<"$logs" | grep -c -- "$kept" >/dev/null \
    || { tail -10 <<<"$logs" >&2; fail "$ctr did not log the disposal of $kept on SIGTERM"; }
  [ "$code" = 0 ] || fail "$ctr exited with $code on SIGTERM (137: killed at the end of the grace period)"
  log "SIGTERM: $ctr disposed of $kept and exited 0 in ${secs}s (grace period 60 s)"
}

# 1. Without /dev/kvm: the same image, on the compose network, no device mapped.
cd "$work"
timeout 300 "$compose" -p "$project" up -d --no-build server >&2
server=$(podman ps -q --filter "label=io.podman.compose.project=$project" --filter "label=com.docker.compose.service=server")
[ -n "$server" ] || fail "the server container did not start"
for _ in $(seq 1 30); do podman exec "$server" test -s /tmp/auth && break; sleep 1; done
network=$(podman inspect -f '{{range $k, $v := .NetworkSettings.Networks}}{{$k}}{{end}}' "$server")
podman run -d --name "$project-nokvm" --network "$network" --network-alias sandbox-host-nokvm \
  --env-file "$work/.env" -e SANDBOX_HOST_NODE_NAME=NoKVM.example -v "$project-nokvm-images:/var/lib/sandbox-host/images" \
  -v "$project-nokvm-state:/var/lib/sandbox-host/state" -v /sys/fs/cgroup:/sys/fs/cgroup:rw \
  --security-opt systempaths=unconfined --cap-drop ALL --cap-add CHOWN,DAC_OVERRIDE,FOWNER,SETUID,SETGID,SETPCAP,KILL \
  --init --stop-signal SIGTERM --stop-timeout 60 "$image" >/dev/null
wait_log "$project-nokvm" 'No /dev/kvm in this container' 60 >&2
line=$(wait_log "$project-nokvm" 'Listening on 0.0.0.0:3004')
echo "$line" >&2
echo "$line" | grep -q '"available":true' || fail "not available without /dev/kvm: $line"
echo "$line" | grep -q 'No /dev/kvm in this container' || fail "the Listening line does not say why it emulates: $line"
SANDBOX_HOST_URL=http://sandbox-host-nokvm:3004
kept=$(exercise "$project-nokvm")

# A fleet's gateway in the same image (`gateway`), in front of that host, serving https with a
# key only root can read (as the Helm chart mounts its Secret): the entrypoint gives the service's
# user a copy of its own, and the operator command reaches it over https, checking the
# certificate against the authority's file.
mkdir -m 0755 "$work/certs"
(
  cd "$work/certs"
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
    -days 2 -subj "/CN=container test CA" 2>/dev/null
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout srv.key -out srv.csr \
    -subj /CN=localhost 2>/dev/null
  echo "subjectAltName=DNS:localhost" > ext.cnf
  openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out srv.pem -days 2 \
    -extfile ext.cnf 2>/dev/null
  chmod 0400 srv.key ca.key; chmod 0444 srv.pem ca.pem
)
podman run -d --name "$project-gw" --network "$network" --env-file "$work/.env" \
  -e SANDBOX_HOST_GATEWAY_HOSTS=nokvm=http://sandbox-host-nokvm:3004 -e SANDBOX_HOST_BIND=0.0.0.0 \
  -e SANDBOX_HOST_TLS_CERT=/certs/srv.pem -e SANDBOX_HOST_TLS_KEY=/certs/srv.key \
  -v "$work/certs:/certs:ro" --cap-drop ALL --cap-add CHOWN,DAC_OVERRIDE,FOWNER,SETUID,SETGID,SETPCAP \
  --init "$image" gateway >/dev/null
wait_log "$project-gw" 'Listening on 0.0.0.0:3004' 60 >&2
gw_health=$(podman exec -e SANDBOX_HOST_URL=https://localhost:3004 -e SANDBOX_HOST_CA_FILE=/certs/ca.pem \
  "$project-gw" /opt/sandbox-host/bin/sandbox-host health) || fail "the gateway's health over https failed: $gw_health"
echo "$gw_health" >&2
tr -d ' \n' <<<"$gw_health" | grep -q '"available":true.*"role":"gateway"' \
  || fail "the gateway over https does not serve its host: $gw_health"
podman top "$project-gw" user comm | awk '$2 == "sandbox-host" && $1 != "sandbox-host" { bad = 1 } END { exit bad }' \
  || fail "the gateway does not run as sandbox-host: $(podman top "$project-gw" user comm)"
podman rm -f -t 5 "$project-gw" >/dev/null
log "gateway: https with a root-only key, its host served through it"

check_stop "$project-nokvm" "$kept" podman stop -t 60 "$project-nokvm"

# 2. The guide's command, with /dev/kvm mapped.
[ -c /dev/kvm ] || fail "this machine has no /dev/kvm, which docker-compose.yaml maps"
timeout 300 "$compose" -p "$project" --profile sandbox up -d --no-build --no-deps --force-recreate server sandbox-host >&2
server=$(podman ps -q --filter "label=io.podman.compose.project=$project" --filter "label=com.docker.compose.service=server")
host=$(podman ps -q --filter "label=io.podman.compose.project=$project" --filter "label=com.docker.compose.service=sandbox-host")
[ -n "$host" ] && [ -n "$server" ] || fail "compose did not start both services"
for _ in $(seq 1 30); do podman exec "$server" test -s /tmp/auth && break; sleep 1; done
[ -z "$(podman port "$host")" ] || fail "the sandbox-host container publishes a port: $(podman port "$host")"
line=$(wait_log "$host" 'Listening on 0.0.0.0:3004')
echo "$line" >&2
echo "$line" | grep -q '"backend":"' || fail "the Listening line names no backend"
# The entrypoint does not hand the service root's group: on this machine /dev/kvm is root:root.
if [ "$(stat -c %g /dev/kvm)" = 0 ]; then
  # The log read whole first: `podman logs | grep -q` under pipefail fails when grep, done at the
  # entrypoint's early line, leaves podman writing into a closed pipe (a warm run saw it).
  logs=$(podman logs "$host" 2>&1)
  grep -q '/dev/kvm in this container belongs to the group root' <<<"$logs" \
    || fail "the entrypoint took /dev/kvm's group root without a warning"
  podman top "$host" comm group | awk '$1 == "sandbox-host" && $2 == "root" { bad = 1 } END { exit bad }' \
    || fail "the service runs with the group root"
fi
SANDBOX_HOST_URL=http://sandbox-host:3004
podman healthcheck run "$host" >&2 || fail "the compose health check of $host fails"
kept=$(exercise "$host")
# As an operator stops it: compose sends SIGTERM and waits the service's stop_grace_period.
check_stop "$host" "$kept" timeout 120 "$compose" -p "$project" --profile sandbox stop sandbox-host
# 3. A second start on the same volumes: the image store is kept (nothing copied again) and the
# service is available again.
timeout 300 "$compose" -p "$project" --profile sandbox start sandbox-host >&2
for _ in $(seq 1 120); do
  [ "$(podman logs "$host" 2>&1 | grep -c 'Listening on 0.0.0.0:3004')" -ge 2 ] && break; sleep 2
done
[ "$(podman logs "$host" 2>&1 | grep -c 'Listening on 0.0.0.0:3004')" -ge 2 ] || fail "$host did not start again"
[ "$(podman logs "$host" 2>&1 | grep -c 'Copying the image')" -eq 1 ] || fail "the second start copied the images again"
api "$SANDBOX_HOST_URL/v1/health" | grep -q '"available":true' || fail "not available after a restart"
log "a restart on the same volumes: available, images kept"
log "passed"
