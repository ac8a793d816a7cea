#!/usr/bin/env bash
# Gives the user sandbox-host what the service needs to run as that user, the documented setup
# (docs/operator-guide.md, "Running as the user sandbox-host"): run as root after the build (which
# may need root), before starting the service. bin/up and the API tests use it.
#
#   scripts/service-user.sh [--cgroup NAME] RUNTIME_DIR SANDBOX_HOST_BINARY
#
# RUNTIME_DIR (bin/up: /var/lib/sandbox-host) ends up as:
#   bin/       root's, 0755: hard links (copies across file systems) of sandbox-host and sandbox-vm
#   images/    root's, 0755: the image store, hard-linked; the service reads it and cannot change it
#   cache/     the user's, 0700: start-up probe records
#   state/     the user's, 0700: the sandboxes' files (SANDBOX_HOST_STATE_DIR)
# The user gets the cgroup parent NAME (default sandbox-host): under each cgroup v1 controller
# (memory, pids, cpu), or on cgroup v2 a delegated subtree whose leaf NAME/service the caller moves
# the service into before dropping to the user.
# Prints the service's environment as KEY=VALUE lines, then SERVICE_BINARY=... and, on cgroup v2,
# SERVICE_CGROUP_PROCS=... (where to write the service's pid).
set -euo pipefail
cgroup=sandbox-host
if [ "${1:-}" = --cgroup ]; then cgroup=$2; shift 2; fi
[ $# -eq 2 ] || { echo "usage: $0 [--cgroup NAME] RUNTIME_DIR SANDBOX_HOST_BINARY" >&2; exit 2; }
rt=$1 binary=$2
user=sandbox-host
say() { echo "service-user: $*" >&2; }
[ "$(id -u)" -eq 0 ] || { say "run this as root: it hands files and a cgroup to the user $user"; exit 1; }
id "$user" >/dev/null 2>&1 || { say "no user $user: run scripts/install-deps.sh (it adds it)"; exit 1; }
[ -x "$binary" ] || { say "no sandbox-host binary at $binary: build it first (scripts/prepare.sh)"; exit 1; }
vm=$(dirname "$binary")/sandbox-vm
[ -x "$vm" ] || { say "no sandbox-vm beside $binary: cargo build -p sandbox-vmm --bins"; exit 1; }
. "$(dirname "$0")/cache-dir.sh"
store=${SANDBOX_HOST_IMAGE_DIR:-$(sandbox_cache_dir)/images}

# A runtime directory somebody else could have made (it may sit in /var/tmp) is refused.
if [ -L "$rt" ] || { [ -e "$rt" ] && [ "$(stat -c %u "$rt")" != 0 ]; }; then
  say "$rt exists and is not root's own directory: remove it, or pick another"; exit 1
fi
install -d -m 0755 -o root -g root "$rt" "$rt/bin"
install -d -m 0700 -o "$user" -g "$user" "$rt/cache" "$rt/state"

# Links replace the old ones by rename: a running service keeps the files it has open.
link() {
  [ "$1" -ef "$2" ] && return 0
  ln -f "$1" "$2.new.$$" 2>/dev/null || cp -f "$1" "$2.new.$$"
  chmod 0755 "$2.new.$$"
  mv -f "$2.new.$$" "$2"
}
link "$binary" "$rt/bin/sandbox-host"
link "$vm" "$rt/bin/sandbox-vm"

# The image store: a fresh tree of links swapped in whole. Directories become 0755; files keep
# their modes (the build makes them world-readable), and one that is not is named.
if [ -d "$store" ]; then
  rm -rf "$rt/images.new.$$"
  cp -al "$store" "$rt/images.new.$$" 2>/dev/null || { rm -rf "$rt/images.new.$$"; cp -a "$store" "$rt/images.new.$$"; }
  find "$rt/images.new.$$" -type d -exec chmod 0755 {} +
  find "$rt/images.new.$$" -type f ! -perm -o=r -printf '%P\n' | while read -r f; do
    say "the image file $store/$f is not readable by $user; make it world-readable (chmod a+r) or rebuild it"
  done
  [ -e "$rt/images" ] && mv "$rt/images" "$rt/images.old.$$"
  mv "$rt/images.new.$$" "$rt/images"
  rm -rf "$rt/images.old.$$"
else
  install -d -m 0755 "$rt/images"
  say "no image store at $store: build the stock image (bash rootfs/build-stock.sh)"
fi

# The cgroup the jail makes each VM's group under.
procs=""
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  d=/sys/fs/cgroup/$cgroup
  mkdir -p "$d/service"
  for c in memory pids cpu; do echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true; done
  for f in "$d" "$d/cgroup.procs" "$d/cgroup.subtree_control" "$d/cgroup.threads" \
           "$d/service" "$d/service/cgroup.procs" "$d/service/cgroup.threads"; do
    chown "$user:$user" "$f"
  done
  procs=$d/service/cgroup.procs
else
  for c in memory pids cpu; do
    [ -d "/sys/fs/cgroup/$c" ] || { say "no cgroup v1 controller $c under /sys/fs/cgroup: the service will name it as missing"; continue; }
    mkdir -p "/sys/fs/cgroup/$c/$cgroup"
    chown -R "$user:$user" "/sys/fs/cgroup/$c/$cgroup"
  done
fi

echo "SANDBOX_HOST_CACHE=$rt/cache"
echo "SANDBOX_HOST_IMAGE_DIR=$rt/images"
echo "SANDBOX_HOST_STATE_DIR=$rt/state"
echo "SANDBOX_HOST_CGROUP=$cgroup"
echo "SANDBOX_HOST_VM_BINARY=$rt/bin/sandbox-vm"
echo "SERVICE_BINARY=$rt/bin/sandbox-host"
[ -z "$procs" ] || echo "SERVICE_CGROUP_PROCS=$procs"
