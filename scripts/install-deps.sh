#!/usr/bin/env bash
# Installs the Debian packages sandbox-host needs to build its guest kernel and images and to run
# its QEMU backend. Safe to run again: it installs only what is missing.
set -euo pipefail

need=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# Packages from the main suite.
for p in qemu-system-x86 qemu-utils seabios busybox-static cpio flex bison bc make gcc libelf-dev libssl-dev \
         xz-utils e2fsprogs python3 git debootstrap openssl; do
  have "$p" || need+=("$p")
done
# The guest kernel source lives in bookworm-backports (linux-source-6.12).
have linux-source-6.12 || need+=(linux-source-6.12)

if [ ${#need[@]} -eq 0 ]; then
  echo "install-deps: every Debian package is present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo; missing: ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi

. /etc/os-release
if [ "${VERSION_CODENAME:-}" = bookworm ] && ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  echo "install-deps: adding bookworm-backports (for linux-source-6.12)"
  echo "deb http://deb.debian.org/debian bookworm-backports main" | $sudo tee /etc/apt/sources.list.d/sandbox-host-backports.list >/dev/null
fi

echo "install-deps: installing ${need[*]}"
$sudo apt-get update -q
src=()
[ "${VERSION_CODENAME:-}" = bookworm ] && src=(-t bookworm-backports)
# On bookworm, QEMU and the kernel source come from backports (QEMU 10, linux-source-6.12), so that
# qemu-system-x86 matches a qemu-utils that may already be there from backports; the rest from main.
main=(); bpo=()
for p in "${need[@]}"; do
  case "$p" in
    linux-source-6.12|qemu-system-x86|qemu-utils) bpo+=("$p") ;;
    *) main+=("$p") ;;
  esac
done
if [ ${#main[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${main[@]}"
fi
if [ ${#bpo[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${src[@]}" "${bpo[@]}"
fi
