#!/bin/bash
# The container's entrypoint. It starts as root only to do what needs root, then runs the sandbox
# host as the unprivileged user sandbox-host with the group that owns /dev/kvm:
#   1. finds the group of /dev/kvm (the host's gid, whatever its name is in this image), or logs
#      `No /dev/kvm in this container` (the service then runs its VMs on QEMU/TCG and says so);
#   2. gives the user the cgroup parent its VMs' groups go under (scripts/service-cgroup.sh);
#   3. makes the user's directories and brings the images this container image carries into the
#      image store (a volume), leaving the images an operator put there alone;
#   4. execs the service, as the user, with no capability and only its own settings.
# Any other command than `serve` (health, ls, ...) runs as the user too.
set -euo pipefail

user=sandbox-host
rt=/var/lib/sandbox-host
builtin=/opt/sandbox-host/images
store=${SANDBOX_HOST_IMAGE_DIR:-$rt/images}

# One JSON object per line, as the service logs.
log() {
  level=$1; shift
  msg=$(printf '%s' "$*" | sed 's/\\/\\\\/g; s/"/\\"/g')
  printf '{"timestamp":"%s","level":"%s","message":"%s","target":"entrypoint"}\n' \
    "$(date -u +%Y-%m-%dT%H:%M:%S.%6NZ)" "$level" "$msg" >&2
}

[ $# -gt 0 ] || set -- serve

# A fleet's host name (SANDBOX_HOST_NAME) from its node's (the Helm chart passes
# SANDBOX_HOST_NODE_NAME): the first label, lowercased, without what a host name cannot hold,
# at most 40 characters.
if [ -z "${SANDBOX_HOST_NAME:-}" ] && [ -n "${SANDBOX_HOST_NODE_NAME:-}" ]; then
  SANDBOX_HOST_NAME=$(printf '%s' "${SANDBOX_HOST_NODE_NAME%%.*}" | tr 'A-Z' 'a-z' | tr -c 'a-z0-9-' '-' | cut -c1-40 | sed 's/^-*//; s/-*$//')
  export SANDBOX_HOST_NAME
fi

if [ "$(id -u)" -ne 0 ]; then
  # Started as another user (docker run --user, rootless setups): nothing here can be prepared.
  log WARN "The entrypoint runs as uid $(id -u), not root: it cannot find the group of /dev/kvm or prepare the cgroup; starting the sandbox host as this user"
  exec /opt/sandbox-host/bin/sandbox-host "$@"
fi

groups=""
if [ "$1" = gateway ]; then
  # A fleet's gateway starts no VM: no /dev/kvm, no cgroup, no image store to prepare.
  :
elif [ -c /dev/kvm ]; then
  gid=$(stat -c %g /dev/kvm)
  name=$(getent group "$gid" | cut -d: -f1)
  if [ "$gid" -lt 100 ] || [ "$gid" -eq 65534 ] || { [ -n "$name" ] && [ "$name" != kvm ] && [ "$name" != "$user" ]; }; then
    # Root's group, another system group of this image (shadow, utmp, ...) or the overflow group
    # of a user namespace would give the service more than /dev/kvm, or nothing.
    log WARN "/dev/kvm in this container belongs to the group ${name:-$gid} (gid $gid), which the sandbox host does not take: give /dev/kvm a group of its own on the host (Debian: root:kvm, mode 0660); VMs run on QEMU/TCG meanwhile"
  else
    groups=$gid
  fi
else
  # The service, started with SANDBOX_HOST_CONTAINER=1, words its own reason the same way.
  log WARN "No /dev/kvm in this container: QEMU emulates the processor (TCG), so runs work but are very slow. Map /dev/kvm into the container (docker-compose.yaml does: devices: /dev/kvm)"
fi

if [ "$1" = serve ]; then
  # The cgroup parent of the VMs' groups, given to the user.
  procs=$(sh /opt/sandbox-host/lib/service-cgroup.sh "${SANDBOX_HOST_CGROUP:-sandbox-host}" "$user" |
            sed -n 's/^SERVICE_CGROUP_PROCS=//p')
  # On cgroup v2 the service moves into the delegated leaf. That fails in a private cgroup
  # namespace (podman-compose ignores `cgroup: host`; set cgroupns = "host" in containers.conf):
  # the service then names the cgroup as missing.
  if [ -n "$procs" ] && ! echo $$ 2>/dev/null > "$procs"; then
    log WARN "Cannot move into $procs (a private cgroup namespace?): run the container with the host's cgroup namespace (compose: cgroup: host; podman: cgroupns = \"host\" in containers.conf)"
  fi

  install -d -m 0755 -o root -g root "$rt" "$store"
  install -d -m 0700 -o "$user" -g "$user" "${SANDBOX_HOST_STATE_DIR:-$rt/state}" "${SANDBOX_HOST_CACHE:-$rt/cache}"

  # The images this container image carries: each image's content directory (`.stock-KEY`,
  # `.vantik-guest-latest-...`) is copied into the store when it is not there yet, then its tag
  # (`stock`, `vantik-guest/latest`) is switched to it atomically. Content directories no tag
  # refers to any more, from an earlier container image, are removed; an operator's own images
  # (tagged in the store, not here) are left as they are.
  if [ -d "$builtin" ]; then
    # One start at a time changes a store that containers may share.
    exec 9>"$store/.entrypoint.lock"
    flock 9
    for src in "$builtin"/.[!.]*; do
      [ -d "$src" ] && [ ! -L "$src" ] || continue
      name=${src##*/}
      [ -e "$store/$name" ] && continue
      log INFO "Copying the image $name into the image store $store"
      rm -rf "$store/.copy-$name"
      cp -a "$src" "$store/.copy-$name"
      # Readable by the service, writable by root alone (image builds make their directories 0700).
      chown -R root:root "$store/.copy-$name"
      chmod -R u+rwX,go+rX,go-w "$store/.copy-$name"
      mv -T "$store/.copy-$name" "$store/$name"
    done
    find "$builtin" -mindepth 1 -maxdepth 2 -type l | while read -r link; do
      rel=${link#"$builtin"/}
      mkdir -p "$store/$(dirname "$rel")"
      ln -sfn "$(readlink "$link")" "$store/$rel.new"
      mv -T "$store/$rel.new" "$store/$rel"
    done
    used=$(find "$store" -mindepth 1 -maxdepth 2 -type l -exec readlink {} \; | sed 's|^\.\./||' | sort -u)
    while read -r link; do
      tag=${link#"$builtin"/}
      for dir in "$store/.${tag%%/*}-"*; do
        [ -d "$dir" ] && [ ! -L "$dir" ] && [ -f "$dir/manifest.json" ] || continue
        grep -qxF "${dir##*/}" <<< "$used" && continue
        log INFO "Removing the image ${dir##*/}, which no tag uses any more"
        rm -rf "$dir"
      done
    done <<< "$(find "$builtin" -mindepth 1 -maxdepth 2 -type l)"
    exec 9>&-
  fi
fi

# TLS (SANDBOX_HOST_TLS_CERT and SANDBOX_HOST_TLS_KEY, the Helm chart's `tls`): a key the
# service's user cannot read (a Secret mounted root's, 0400) is copied for it, readable by it
# alone; one root cannot read either is left for the service to name.
if { [ "$1" = serve ] || [ "$1" = gateway ]; } &&
   [ -n "${SANDBOX_HOST_TLS_KEY:-}" ] && [ -n "${SANDBOX_HOST_TLS_CERT:-}" ] &&
   [ -r "$SANDBOX_HOST_TLS_KEY" ] && [ -r "$SANDBOX_HOST_TLS_CERT" ] &&
   ! setpriv --reuid "$user" --regid "$user" --clear-groups test -r "$SANDBOX_HOST_TLS_KEY"; then
  tls=/run/sandbox-host-tls
  install -d -m 0700 -o "$user" -g "$user" "$tls"
  install -m 0400 -o "$user" -g "$user" "$SANDBOX_HOST_TLS_KEY" "$tls/key.pem"
  install -m 0444 -o "$user" -g "$user" "$SANDBOX_HOST_TLS_CERT" "$tls/cert.pem"
  export SANDBOX_HOST_TLS_KEY=$tls/key.pem SANDBOX_HOST_TLS_CERT=$tls/cert.pem
fi

# Only the service's own settings reach it (SANDBOX_HOST_*, and PATH, LANG, LC_ALL, TZ, RUST_LOG,
# RUST_BACKTRACE, HOME): none of root's environment. Values are passed exactly as they are.
keep=()
for k in $(compgen -e); do
  case "$k" in
    SANDBOX_HOST_*|PATH|LANG|LC_ALL|TZ|RUST_LOG|RUST_BACKTRACE) keep+=("$k=${!k}") ;;
  esac
done
# The service keeps in its bounding set only what newuidmap and newgidmap need (their file
# capabilities, CAP_SETUID and CAP_SETGID, for each VM's id maps); no_new_privs stays off for the
# same reason. The service itself holds no capability: it is an ordinary uid.
if [ -n "$groups" ]; then grouparg=(--groups "$groups"); else grouparg=(--clear-groups); fi
exec setpriv --reuid "$user" --regid "$user" "${grouparg[@]}" \
  --inh-caps=-all --bounding-set=-all,+setuid,+setgid -- \
  env -i "${keep[@]}" HOME="$rt" /opt/sandbox-host/bin/sandbox-host "$@"
