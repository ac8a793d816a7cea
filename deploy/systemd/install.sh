#!/usr/bin/env bash
# Installs the sandbox host as a systemd service on a native Linux host. Run as root from the
# checkout; run it again after an update (it rebuilds what changed and restarts the service).
#   1. installs the Debian packages and builds everything as root (scripts/prepare.sh: the guest
#      kernel, the stock image, the guest image vantik-guest:latest, the release binaries);
#   2. hands the runtime files to the user sandbox-host under /var/lib/sandbox-host
#      (scripts/service-user.sh);
#   3. writes /etc/sandbox-host/env (root:sandbox-host, 0640) from the checkout's .env, making a
#      token when there is none, unless it exists (then it is kept: edit it there);
#   4. installs deploy/systemd/sandbox-host.service and, where systemd runs, enables and
#      (re)starts it.
#
#   sudo deploy/systemd/install.sh [--no-start]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
log() { printf '[install-systemd %s] %s\n' "$(date +%T)" "$*" >&2; }
[ "$(id -u)" -eq 0 ] || { log "run as root (sudo): it builds the guest image and installs a system unit"; exit 1; }
start=1
[ "${1:-}" = --no-start ] && start=0

binary=$(bash "$root/scripts/prepare.sh" | tail -1)
# The unit's SupplementaryGroups=kvm fails the start (status 216/GROUP) when the group does not
# exist, as on a machine whose udev never made it: make it, and put the user in it.
getent group kvm >/dev/null || groupadd --system kvm
id -nG sandbox-host | grep -qw kvm || usermod -aG kvm sandbox-host
rt=/var/lib/sandbox-host
bash "$root/scripts/service-user.sh" "$rt" "$binary" >/dev/null

install -d -m 0750 -o root -g sandbox-host /etc/sandbox-host
if [ ! -f /etc/sandbox-host/env ]; then
  if [ -L "$root/.env" ]; then
    log "$root/.env is a symbolic link: refusing to copy it; write /etc/sandbox-host/env yourself"; exit 1
  elif grep -qs '^SANDBOX_HOST_TOKEN=' "$root/.env"; then
    # The settings only: where the service finds its binaries, images and state is the unit's
    # (an EnvironmentFile wins over the unit's Environment=), so those keys are left out.
    log "writing /etc/sandbox-host/env from $root/.env (without path settings)"
    (umask 027; grep -vE '^(export )?SANDBOX_HOST_(IMAGE_DIR|STATE_DIR|CACHE|VM_BINARY|DOTENV|RUNTIME_DIR)=' "$root/.env" \
       > /etc/sandbox-host/env.new)
    chown root:sandbox-host /etc/sandbox-host/env.new
    mv -f /etc/sandbox-host/env.new /etc/sandbox-host/env
  else
    log "writing /etc/sandbox-host/env with a new SANDBOX_HOST_TOKEN; give the Vantik server the same value"
    (umask 027; echo "SANDBOX_HOST_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n')" > /etc/sandbox-host/env)
    chown root:sandbox-host /etc/sandbox-host/env
  fi
fi

install -m 0644 "$root/deploy/systemd/sandbox-host.service" /etc/systemd/system/sandbox-host.service
if [ "$start" -eq 1 ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
  systemctl enable sandbox-host.service
  systemctl restart sandbox-host.service
  log "started: journalctl -u sandbox-host -f shows its log; bin/sandbox-host health asks it"
else
  log "installed /etc/systemd/system/sandbox-host.service (not started: systemd does not run here, or --no-start)"
fi
