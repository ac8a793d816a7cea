#!/usr/bin/env bash
# Installs the Debian packages sandbox-host needs to build its guest kernel and images and to run
# its QEMU backend (python3-pip: rootfs/build-guest.py downloads its wheels with pip), and the
# user `sandbox-host` that the service runs as in the documented setup (with subordinate ids for
# its VMs' jails), and python3-venv for scripts/schemathesis.sh (the API contract test). Safe to run again: it adds only what is missing.
# --container: also podman and what it needs here (runc, catatonit for --init, the CNI plugins with
# name resolution between containers), for the container test (tests/container/run.sh).
# --aarch64: also what aarch64 guests need on this host: qemu-system-aarch64, qemu-user-static (to
# build the arm64 guest image) and, on a host that is not aarch64, the cross compiler of the kernel.
set -euo pipefail
container=0
aarch64=0
for arg in "$@"; do
  case "$arg" in
    --container) container=1 ;;
    --aarch64) aarch64=1 ;;
    *) echo "install-deps: unknown option $arg (--container, --aarch64)" >&2; exit 2 ;;
  esac
done

need=()
have() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'install ok installed'; }

# Packages from the main suite.
# QEMU for this host's guests: x86_64 guests on x86_64, aarch64 guests (virt) on aarch64.
case "$(uname -m)" in
  aarch64|arm64) qemu_system=qemu-system-arm ;;
  *) qemu_system=qemu-system-x86 ;;
esac
for p in $qemu_system qemu-utils seabios busybox-static cpio flex bison bc make gcc libelf-dev libssl-dev \
         xz-utils e2fsprogs python3 python3-venv python3-pip git debootstrap openssl uidmap; do
  have "$p" || need+=("$p")
done
if [ $container -eq 1 ]; then
  for p in podman runc catatonit containernetworking-plugins golang-github-containernetworking-plugin-dnsname; do
    have "$p" || need+=("$p")
  done
fi
if [ $aarch64 -eq 1 ]; then
  for p in qemu-system-arm qemu-user-static; do
    have "$p" || need+=("$p")
  done
  # The kernel's cross compiler, and a static libc for the tests' guest helper (tests/build.rs).
  if [ "$(uname -m)" != aarch64 ]; then
    for p in gcc-aarch64-linux-gnu libc6-dev-arm64-cross; do
      have "$p" || need+=("$p")
    done
  fi
fi
# The guest kernel source lives in bookworm-backports (linux-source-6.12).
have linux-source-6.12 || need+=(linux-source-6.12)

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: run as root or install sudo; missing: ${need[*]}" >&2; exit 1; }
  sudo=sudo
fi

# The service's own user: an ordinary user whose subordinate ids give each VM a uid of its own
# (newuidmap, package uidmap), in the kvm group where there is one. See "The jail" in the
# operator guide.
service_user() {
  if ! id sandbox-host >/dev/null 2>&1; then
    echo "install-deps: adding the user sandbox-host"
    $sudo useradd --system --no-create-home --shell /usr/sbin/nologin sandbox-host
  fi
  grep -qs '^sandbox-host:' /etc/subuid || $sudo usermod --add-subuids 1600000000-1600065535 sandbox-host
  grep -qs '^sandbox-host:' /etc/subgid || $sudo usermod --add-subgids 1600000000-1600065535 sandbox-host
  if getent group kvm >/dev/null && ! id -nG sandbox-host | grep -qw kvm; then
    $sudo usermod -aG kvm sandbox-host
  fi
}

# The arm64 busybox-static of the aarch64 stock image comes from Debian like the host's: dpkg must
# know the architecture for `apt-get download busybox-static:arm64`.
foreign_arm64() {
  [ $aarch64 -eq 1 ] && [ "$(uname -m)" != aarch64 ] || return 0
  dpkg --print-foreign-architectures | grep -qx arm64 && return 0
  echo "install-deps: adding arm64 to dpkg's architectures (for busybox-static:arm64)"
  $sudo dpkg --add-architecture arm64
  $sudo apt-get update -q
}

if [ ${#need[@]} -eq 0 ]; then
  echo "install-deps: every Debian package is present"
  foreign_arm64
  service_user
  exit 0
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
# qemu-system-* matches a qemu-utils that may already be there from backports; the rest from main.
main=(); bpo=()
for p in "${need[@]}"; do
  case "$p" in
    linux-source-6.12|qemu-system-x86|qemu-system-arm|qemu-user-static|qemu-utils) bpo+=("$p") ;;
    *) main+=("$p") ;;
  esac
done
if [ ${#main[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${main[@]}"
fi
if [ ${#bpo[@]} -gt 0 ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${src[@]}" "${bpo[@]}"
fi
service_user
foreign_arm64
