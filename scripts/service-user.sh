#!/usr/bin/env bash
# Gives the user sandbox-host what the service needs to run as that user, the documented setup
# (docs/operator-guide.md, "Running as the user sandbox-host"): run as root after the build (which
# may need root), before starting the service. bin/up and the API tests use it.
#
#   scripts/service-user.sh [--cgroup NAME] RUNTIME_DIR SANDBOX_HOST_BINARY
#
# RUNTIME_DIR (bin/up: /var/lib/sandbox-host) ends up as:
#   bin/       root's, 0755: hard links (copies across file systems) of sandbox-host, sandbox-vm and
#              sandbox-net, and service-cgroup.sh
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
[ -x "$vm" ] || { say "no sandbox-vm beside $binary: cargo build -p sandbox-vm --bins"; exit 1; }
net=$(dirname "$binary")/sandbox-net
[ -x "$net" ] || { say "no sandbox-net beside $binary: cargo build -p sandbox-net --bins"; exit 1; }
. "$(dirname "$0")/cache-dir.sh"
store=$(sandbox_image_dir)

# Made first, then checked: a directory somebody else made (or a link) is refused, never adopted.
mkdir -m 0755 "$rt" 2>/dev/null || true
if [ -L "$rt" ] || [ ! -d "$rt" ] || [ "$(stat -c %u "$rt")" != 0 ] || [ -n "$(find "$rt" -maxdepth 0 -perm /022)" ]; then
  say "$rt is not a directory of root's that only root can write: remove it, or pick another"; exit 1
fi
# One hand-over at a time (bin/test runs test binaries side by side, each may hand over).
exec 9>"$rt/.hand-over.lock"
flock 9
install -d -m 0755 -o root -g root "$rt/bin"
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
link "$net" "$rt/bin/sandbox-net"
# The cgroup step, for a service manager that runs it as root before each start (the systemd
# unit's ExecStartPre): a copy of root's, never a link to a file of the checkout's owner.
install -m 0755 -o root -g root "$(dirname "$0")/service-cgroup.sh" "$rt/bin/service-cgroup.sh.new.$$"
mv -f "$rt/bin/service-cgroup.sh.new.$$" "$rt/bin/service-cgroup.sh"

# The image store: a fresh tree of links swapped in whole, without the temporary trees and locks
# of a build that may be running (one file system: no mount inside is followed). Directories
# become 0755; a file the user could not read, or could change (it is root's own cache file too),
# stops the hand-over.
if [ -d "$store" ]; then
  new=$rt/images.new.$$
  rm -rf "$new"
  mkdir -m 0755 "$new"
  find -H "$store" -mindepth 1 -maxdepth 1 ! -name '.tmp-*' ! -name '.build-*.lock' ! -name '.base-*' -print0 |
    while IFS= read -r -d '' e; do
      cp -alx "$e" "$new/" 2>/dev/null || cp -ax "$e" "$new/"
    done
  find "$new" -type d -exec chmod 0755 {} +
  bad=$(find "$new" -type f \( ! -perm -o=r -o -perm /022 \) -printf '%P\n' | head -5)
  if [ -n "$bad" ]; then
    rm -rf "$new"
    say "image files in $store that $user could not read, or that others could change: $(echo $bad); make them root's, mode 0644 (or rebuild the image)"
    exit 1
  fi
  # The same files already there (the same inodes): nothing to swap, and a service reading the
  # store never sees it missing for the instant between the two renames.
  listing() { (cd "$1" && find . -mindepth 1 \( -type d -printf '%P dir %m\n' \) -o -printf '%P %i %m %l\n' | sort); }
  if [ -d "$rt/images" ] && [ ! -L "$rt/images" ] && [ "$(listing "$new")" = "$(listing "$rt/images")" ]; then
    rm -rf "$new"
  else
    [ -e "$rt/images" ] && mv "$rt/images" "$rt/images.old.$$"
    mv "$new" "$rt/images"
    rm -rf "$rt/images.old.$$"
  fi
else
  install -d -m 0755 "$rt/images"
  say "no image store at $store: build the stock image (bash rootfs/build-stock.sh)"
fi

# The cgroup the jail makes each VM's group under (scripts/service-cgroup.sh).
procs=$(sh "$(dirname "$0")/service-cgroup.sh" "$cgroup" "$user" | sed -n 's/^SERVICE_CGROUP_PROCS=//p')

echo "SANDBOX_HOST_CACHE=$rt/cache"
echo "SANDBOX_HOST_IMAGE_DIR=$rt/images"
echo "SANDBOX_HOST_STATE_DIR=$rt/state"
echo "SANDBOX_HOST_CGROUP=$cgroup"
echo "SANDBOX_HOST_VM_BINARY=$rt/bin/sandbox-vm"
echo "SANDBOX_HOST_NET_BINARY=$rt/bin/sandbox-net"
echo "SERVICE_BINARY=$rt/bin/sandbox-host"
[ -z "$procs" ] || echo "SERVICE_CGROUP_PROCS=$procs"
