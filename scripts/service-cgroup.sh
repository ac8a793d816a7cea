#!/bin/sh
# Gives the user USER the cgroup parent NAME that the jail makes each VM's group under: under each
# cgroup v1 controller (memory, pids, cpu) a group of the user's; on cgroup v2 a delegated subtree,
# whose leaf NAME/service the caller must move the service into before the uid changes (the path
# of its cgroup.procs is printed). Run as root. Used by scripts/service-user.sh (bin/up) and by the
# container's entrypoint. POSIX sh: a service manager runs it with /bin/sh.
#
#   scripts/service-cgroup.sh [--v1-only] NAME USER   # prints SERVICE_CGROUP_PROCS=... on cgroup v2
# --v1-only: do nothing on cgroup v2 (the systemd unit delegates its own group there).
set -eu
v1_only=0
if [ "${1:-}" = --v1-only ]; then v1_only=1; shift; fi
[ $# -eq 2 ] || { echo "usage: $0 [--v1-only] NAME USER" >&2; exit 2; }
cgroup=$1 user=$2
say() { echo "service-cgroup: $*" >&2; }
# Run as root on a name from the environment: only plain relative names (a/b), never the root of
# the hierarchy, `.` or `..`.
case "$cgroup" in
  ''|/*|*/|*//*|.|..|./*|../*|*/./*|*/../*|*/.|*/..|*[!A-Za-z0-9._/-]*)
    say "refusing the cgroup name '$cgroup': give a relative name such as sandbox-host"; exit 2 ;;
esac
if [ -f /sys/fs/cgroup/cgroup.controllers ] && [ $v1_only -eq 1 ]; then
  exit 0
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
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
