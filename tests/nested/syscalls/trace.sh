#!/bin/sh
# Inside the nested test host: runs one sandbox on the KVM backend and lists, per thread of each
# `sandbox-vm`, the system calls it made once filtered (what vm/src/seal.rs must allow).
# From the repository:
#   tests/nested/run.sh --with target/debug/sandbox-host --with target/debug/sandbox-vm \
#     --with /usr/bin/strace --with tests/nested/syscalls/inventory.awk \
#     --with tests/nested/syscalls/trace.sh -- 'sh /work/trace.sh "echo hi; sync"'
# strace attaches just after each VM process starts (tracing from the service's start slows the
# start-up probe past its bound): threads started before that are named from /proc.
cmd=${1:-"echo hi; dd if=/dev/zero of=/workspace/x bs=1M count=20 2>&1; sync"}
SANDBOX_HOST_IN_NESTED=1 SANDBOX_HOST_VMM=kvm ./sandbox-host run --memory-mib 512 --vcpus 2 -- sh -c "$cmd" &
run=$!
while kill -0 $run 2>/dev/null; do
  for p in $(pidof sandbox-vm); do
    [ -e /tmp/names.$p ] && continue
    /work/strace -f -qq -p $p -o /tmp/trace.$p 2>/dev/null &
    sleep 0.2
    for t in /proc/$p/task/*; do echo "${t##*/} $(cat $t/comm)"; done > /tmp/names.$p
  done
  sleep 0.02
done
wait $run
echo "run: exit $?"
sleep 1
for n in /tmp/names.*; do
  p=${n#/tmp/names.}
  echo "== sandbox-vm $p"
  awk -f /work/inventory.awk $n /tmp/trace.$p /tmp/trace.$p | sort
done
