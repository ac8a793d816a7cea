#!/usr/bin/env bash
# The nested test host: runs a command inside a QEMU/TCG guest whose processor is emulated with
# AMD SVM (`-cpu max`), so that /dev/kvm in there is real KVM, whatever this machine's own /dev/kvm
# can do. The guest gets the guest kernel (it has KVM built in), busybox, QEMU, the
# stock image at /images/stock, and the files named with --with (binaries get their shared
# libraries), and the images named with --image. The command's output streams to stderr as it runs
# and to stdout once it ended; this script exits with the command's status.
#
#   tests/nested/run.sh [--with FILE]... [--image NAME[:TAG]]... [--mem MIB] [--timeout S] -- 'shell command'
#
# Files given with --with land in /work/<name>; binaries are stripped of debug info first.
# Exits 125 if the command did not run to completion, 126 if the nested host wedged in every boot
# (see the heartbeat below).
# SANDBOX_HOST_NESTED_CPUS sets its processor count (1: see README.md, "One processor"). SANDBOX_HOST_NESTED_ACCEL replaces the outer QEMU's `-accel tcg`; SANDBOX_HOST_NESTED_QEMU_ARGS adds options to the outer QEMU (for debugging, e.g.
# `-d int,cpu_reset -D /tmp/l0.log` logs every exception of both guest levels).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
. "$root/scripts/cache-dir.sh"
log() { printf '[nested %s] %s\n' "$(date +%T)" "$*" >&2; }

with=(); images=(); mem=6144; timeout=1200
while [ $# -gt 0 ]; do
  case "$1" in
    --with) with+=("$2"); shift 2 ;;
    --image) images+=("$2"); shift 2 ;;
    --mem) mem=$2; shift 2 ;;
    --timeout) timeout=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [--with FILE]... [--image NAME[:TAG]]... [--mem MIB] [--timeout S] -- 'command'" >&2; exit 2 ;;
  esac
done
[ $# -eq 1 ] || { echo "give exactly one shell command after --" >&2; exit 2; }
cmd=$1

kernel=$(bash "$root/guest-kernel/build.sh" x86_64)
stock=$(bash "$root/rootfs/build-stock.sh")
cache=$(sandbox_cache_dir)
work=$(mktemp -d "${TMPDIR:-/tmp}/nested.XXXXXX")
trap 'rm -rf "$work"' EXIT
tree="$work/tree"
mkdir -p "$tree"/{bin,sbin,usr/bin,usr/sbin,usr/share/qemu,etc,proc,sys,dev,tmp,root,work,images,lib,lib64}

# Copies a binary and every shared library it loads (with the same paths).
add_binary() {
  local src=$1 dst=$2
  mkdir -p "$(dirname "$tree/$dst")"
  strip --strip-debug -o "$tree/$dst" "$src" 2>/dev/null || cp "$src" "$tree/$dst"
  chmod +x "$tree/$dst"
  ldd "$src" 2>/dev/null | grep -o '/[^ ]*' | while read -r lib; do
    [ -e "$tree/$lib" ] || { mkdir -p "$(dirname "$tree/$lib")"; cp -L "$lib" "$tree/$lib"; }
  done
}

cp /bin/busybox "$tree/bin/busybox"
for applet in $(/bin/busybox --list-full); do
  [ -e "$tree/$applet" ] || ln -s /bin/busybox "$tree/$applet"
done
add_binary "$(command -v qemu-system-x86_64)" /usr/bin/qemu-system-x86_64
add_binary "$(command -v qemu-img)" /usr/bin/qemu-img
# The backends make each disk image's sandbox disk with mkfs.ext4.
add_binary "$(PATH=$PATH:/usr/sbin:/sbin command -v mkfs.ext4)" /usr/sbin/mkfs.ext4
[ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$tree/etc/mke2fs.conf"
# QEMU's firmware and option ROMs for the microvm machine (qboot, PVH and Linux loaders); Debian
# ships bios-microvm.bin with seabios.
for fw in qboot.rom pvh.bin linuxboot_dma.bin linuxboot.bin multiboot_dma.bin bios-microvm.bin; do
  for d in /usr/share/qemu /usr/share/seabios; do
    if [ -e "$d/$fw" ]; then cp -L "$d/$fw" "$tree/usr/share/qemu/$fw"; break; fi
  done
done
[ -e "$tree/usr/share/qemu/qboot.rom" ] || { log "QEMU's qboot.rom is missing; install qemu-system-x86"; exit 125; }
for f in "${with[@]}"; do
  if ldd "$f" >/dev/null 2>&1; then add_binary "$f" "/work/$(basename "$f")"; else cp -L "$f" "$tree/work/"; fi
done
cp -rL "$stock" "$tree/images/stock"
# Other images of this machine's store (hard links where possible: a disk image is a gigabyte).
store=${SANDBOX_HOST_IMAGE_DIR:-$cache/images}
for image in "${images[@]}"; do
  src="$store/${image/://}"
  [ -f "$src/manifest.json" ] || { log "no image $image in $store; build it first"; exit 125; }
  mkdir -p "$(dirname "$tree/images/${image/://}")"
  cp -rlL "$src" "$tree/images/${image/://}" 2>/dev/null || cp -rL "$src" "$tree/images/${image/://}"
done
install -m 0755 "$here/init" "$tree/init"
env | grep -E '^(SANDBOX_HOST_[A-Z0-9_]+|RUST_BACKTRACE)=' | grep -vE 'SANDBOX_HOST_(CACHE|IMAGE_DIR|STATE_DIR)=' \
  | sed "s/=\(.*\)/='\1'/; s/^/export /" > "$tree/nested.env" || true
printf 'root:x:0:0:root:/root:/bin/sh\n' > "$tree/etc/passwd"
printf '%s\n' "$cmd" > "$tree/nested.cmd"
(cd "$tree" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc --owner=0:0) > "$work/initramfs.cpio"
log "initramfs $(du -h "$work/initramfs.cpio" | cut -f1); booting the nested host (TCG, emulated SVM, $mem MiB)"

# Under TCG the nested host's TSC runs at this machine's TSC rate, but its kernel often fails to
# calibrate it (no HPET, a PIT too slow to measure against) and then marks the TSC unstable with
# no known frequency; KVM in there then cannot keep its guests' kvm-clock, and they hang before
# printing a line. Telling the kernel the frequency avoids the calibration.
tsc_mhz=$(awk -F: '/^cpu MHz/ {print $2; exit}' /proc/cpuinfo | tr -d ' ')
tsc_arg=""
[ -n "$tsc_mhz" ] && tsc_arg="tsc_early_khz=$(awk -v m="$tsc_mhz" 'BEGIN {printf "%d", m * 1000}')"

# A wedged nested host (tests/nested/README.md, "Wedged") prints nothing any more. Its init writes
# a heartbeat to a second serial port every 2 s, so a stopped heartbeat ends the boot within
# SANDBOX_HOST_NESTED_HEARTBEAT_S (30) seconds, and a heartbeat that never starts (a wedge in the
# kernel's boot) within SANDBOX_HOST_NESTED_FIRST_BEAT_S (120); a console silent for
# SANDBOX_HOST_NESTED_SILENCE_S (420, longer than any test's own 300 s deadline) does too.
# A wedged boot is booted once more, up to SANDBOX_HOST_NESTED_ATTEMPTS (5) boots in all. Every
# boot's console streams to stderr as it runs; stdout gets the console of the last boot alone, so
# callers that read stdout never mix two boots.
silence=${SANDBOX_HOST_NESTED_SILENCE_S:-420}
hb_silence=${SANDBOX_HOST_NESTED_HEARTBEAT_S:-30}
first_beat=${SANDBOX_HOST_NESTED_FIRST_BEAT_S:-120}
attempts=${SANDBOX_HOST_NESTED_ATTEMPTS:-5}
deadline=$(( $(date +%s) + timeout ))
out="$work/console.log"
hb="$work/heartbeat"
attempt=0
while :; do
  attempt=$((attempt + 1))
  : > "$out"; : > "$hb"
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 0 ] || { log "no time left for boot $attempt (--timeout $timeout)"; exit 125; }
  set +e
  timeout "$left" qemu-system-x86_64 -M microvm,acpi=off,isa-serial=on,rtc=off -accel "${SANDBOX_HOST_NESTED_ACCEL:-tcg}" -cpu max \
    -m "$mem" -smp "${SANDBOX_HOST_NESTED_CPUS:-1}" -nodefaults -no-user-config -display none -no-reboot -serial stdio \
    -chardev "file,id=heartbeat,path=$hb" -device isa-serial,chardev=heartbeat,iobase=0x2f8,irq=3 \
    -kernel "$kernel" -initrd "$work/initramfs.cpio" \
    -append "console=ttyS0 reboot=t panic=-1 quiet $tsc_arg sandbox_nested.epoch=$(date +%s) ${SANDBOX_HOST_NESTED_KERNEL_ARGS:-}" \
    -device virtio-rng-device ${SANDBOX_HOST_NESTED_QEMU_ARGS:-} </dev/null >"$out" 2>&1 &
  qemu_pid=$!
  tail -n +1 -f --pid="$qemu_pid" "$out" >&2 &
  wedged=""
  booted=$(date +%s)
  while kill -0 "$qemu_pid" 2>/dev/null; do
    sleep 5
    now=$(date +%s)
    age=$(( now - $(stat -c %Y "$out") ))
    why=""
    if [ -s "$hb" ] && [ $(( now - $(stat -c %Y "$hb") )) -ge "$hb_silence" ]; then
      why="its heartbeat stopped $(( now - $(stat -c %Y "$hb") )) s ago"
    elif [ ! -s "$hb" ] && [ $(( now - booted )) -ge "$first_beat" ]; then
      why="its heartbeat never started in $(( now - booted )) s"
    elif [ "$age" -ge "$silence" ]; then
      why="it printed nothing for $age s"
    fi
    if [ -n "$why" ]; then
      wedged=$why
      kill "$qemu_pid" 2>/dev/null; sleep 1; pkill -KILL -P "$qemu_pid" 2>/dev/null; kill -KILL "$qemu_pid" 2>/dev/null
      break
    fi
  done
  wait "$qemu_pid"
  qemu_status=$?
  wait
  set -e
  if [ -z "$wedged" ]; then break; fi
  log "WEDGED: the nested host stopped ($wedged): its emulated processor halted for good (see tests/nested/README.md, \"Wedged\"), not a test's hang (each test prints its own deadline first); last lines above"
  if [ "$attempt" -ge "$attempts" ]; then
    cat "$out"
    log "the nested host wedged in all $attempts boots; giving up"
    exit 126
  fi
  log "booting it once more (boot $((attempt + 1)) of at most $attempts)"
done
cat "$out"
status=$(sed -n 's/^NESTED-EXIT \([0-9]*\).*/\1/p' "$out" | tail -n 1)
if [ -z "$status" ]; then
  log "the nested host ended without running the command to completion (QEMU status $qemu_status)"
  exit 125
fi
exit "$status"
