#!/bin/sh
# Gives the user USER the cgroup parent NAME that the jail makes each VM's group under: under each
# cgroup v1 controller (memory, pids, cpu) a group of the user's; on cgroup v2 a delegated subtree,
# whose leaf NAME/service the caller must move the service into before the uid changes (the path
# of its cgroup.procs is printed). Run as root. Used by scripts/service-user.sh (bin/up) and by the
# container's entrypoint; POSIX sh, since the container's runtime stage has no bash.
#
#   scripts/service-cgroup.sh NAME USER      # prints SERVICE_CGROUP_PROCS=... on cgroup v2
set -eu
[ $# -eq 2 ] || { echo "usage: $0 NAME USER" >&2; exit 2; }
cgroup=$1 user=$2
say() { echo "service-cgroup: $*" >&2; }
if [ -f /sys/fs/cgroup/cgroup.controllers ]; then
  d=/sys/fs/cgroup/$cgroup
  if ! mkdir -p "$d/service" 2>/dev/null; then
    say "cannot make $d (the cgroup tree is read-only here): the service will name the cgroup as missing"
    exit 0
  fi
  for c in memory pids cpu; do echo "+$c" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true; done
  for f in "$d" "$d/cgroup.procs" "$d/cgroup.subtree_control" "$d/cgroup.threads" \
           "$d/service" "$d/service/cgroup.procs" "$d/service/cgroup.threads"; do
    chown "$user:$user" "$f"
  done
  echo "SERVICE_CGROUP_PROCS=$d/service/cgroup.procs"
else
  for c in memory pids cpu; do
    [ -d "/sys/fs/cgroup/$c" ] || { say "no cgroup v1 controller $c under /sys/fs/cgroup: the service will name it as missing"; continue; }
    if ! mkdir -p "/sys/fs/cgroup/$c/$cgroup" 2>/dev/null; then
      say "cannot make /sys/fs/cgroup/$c/$cgroup (the cgroup tree is read-only here): the service will name it as missing"
      continue
    fi
    chown -R "$user:$user" "/sys/fs/cgroup/$c/$cgroup"
  done
fi
