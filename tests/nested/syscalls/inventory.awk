# The system calls each thread of a `sandbox-vm` made after it applied its filter (with the
# arguments its filter has rules for), from
# `strace -f -p PID` output (see trace.sh). Run as: awk -f inventory.awk NAMES TRACE TRACE
# NAMES: a line "tid name" per thread present when strace attached. The trace is read twice:
# first for which threads applied a filter (seccomp), then for what each did after it.
function sysname(rest,   a) {
  if (rest ~ /^<\.\.\. /) { split(rest, a, " "); return a[2] }
  if (rest ~ /^[a-z0-9_]+\(/) return substr(rest, 1, index(rest, "(") - 1)
  return ""
}
FNR == 1 { pass++ }
pass == 1 { tname[$1] = $2; next }
{ pid = $1; rest = substr($0, length($1) + 2); sub(/^ +/, "", rest); name = sysname(rest) }
pass == 2 {
  if (name == "seccomp" || (name == "prctl" && rest ~ /PR_SET_SECCOMP/)) seals[pid] = 1
  next
}
{
  if (rest ~ /^--- SIGSYS/) { print "TRAP " tname[pid] " " rest; next }
  if (name == "") next
  # A thread that applies a filter counts from then; one that never does is taken as sealed
  # (it inherited its parent's filter, or had it before strace came).
  if (!(pid in state)) state[pid] = (pid in seals) ? 0 : 1
  res = ""
  if (match(rest, /= [0-9]+$/)) res = substr(rest, RSTART + 2)
  if ((name == "clone" || name == "clone3") && res != "") {
    state[res] = (res in seals) ? 0 : state[pid]
    if (!(res in tname)) tname[res] = "child-of-" tname[pid]
  }
  if (name == "prctl" && rest ~ /PR_SET_NAME/) { split(rest, b, "\""); tname[pid] = b[2] }
  if (name == "seccomp" || (name == "prctl" && rest ~ /PR_SET_SECCOMP/)) { state[pid] = 1; next }
  if (!state[pid]) next
  t = tname[pid]; if (t == "") t = "unknown"
  key = name
  if (rest !~ /^<\.\.\./) {
    split(rest, c, ", ")
    if (name == "ioctl") key = "ioctl:" c[2]
    if (name == "fcntl") key = "fcntl:" c[2]
    # The arguments vmm/src/kvm/seal.rs has rules for.
    if (name == "mmap") key = "mmap:" c[3] ((c[4] ~ /MAP_HUGETLB/) ? ":MAP_HUGETLB" : "")
    if (name == "mprotect" || name == "madvise") key = name ":" c[3]
    if (name == "futex") key = "futex:" c[2]
    if (name == "prctl" || name == "socketpair") { key = c[1]; sub(/\(/, ":", key) }
    if (name == "clone") key = "clone:" ((rest ~ /CLONE_THREAD/) ? "thread" : "process")
    if (name == "tgkill") { key = c[1]; sub(/\(/, ":", key) }
  }
  seen[t " " key] = 1
}
END { for (k in seen) print k }
