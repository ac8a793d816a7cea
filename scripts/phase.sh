# Sourced by bin/test and the build scripts: times the phases of a run, so that every CI log ends
# with where its time went (issue 36) and a regression shows in the next one.
#   phase NAME COMMAND...   runs COMMAND; when SANDBOX_HOST_PHASES names a file, appends one line
#                           "NAME<TAB>start<TAB>seconds<TAB>status" (start: seconds since
#                           SANDBOX_HOST_PHASES_T0, so phases that overlap show it)
#   phase_table             prints the file as a table, with the wall time of the whole run
# Phases run in the background are timed the same way: `phase NAME cmd &`.

phase_now() { date +%s.%N; }

phase() {
  local name=$1 t0 rc=0
  shift
  t0=$(phase_now)
  "$@" || rc=$?
  if [ -n "${SANDBOX_HOST_PHASES:-}" ]; then
    awk -v n="$name" -v t0="$t0" -v t1="$(phase_now)" -v base="${SANDBOX_HOST_PHASES_T0:-$t0}" -v rc="$rc" \
      'BEGIN { printf "%s\t%.0f\t%.0f\t%s\n", n, t0 - base, t1 - t0, rc }' >> "$SANDBOX_HOST_PHASES"
  fi
  return $rc
}

phase_table() {
  [ -n "${SANDBOX_HOST_PHASES:-}" ] && [ -f "$SANDBOX_HOST_PHASES" ] || return 0
  local total
  total=$(awk -v t0="${SANDBOX_HOST_PHASES_T0:-0}" -v t1="$(phase_now)" 'BEGIN { printf "%.0f", t1 - t0 }')
  {
    echo
    echo "Where the time went (seconds; start is from the beginning of the run; phases that start"
    echo "before the one above ended ran beside it; status 0 is a pass):"
    printf '%-44s %6s %7s %6s\n' phase start seconds status
    awk -F'\t' '{ printf "%-44s %6s %7s %6s\n", $1, $2, $3, $4 }' "$SANDBOX_HOST_PHASES"
    printf '%-44s %6s %7s\n' "whole run (wall)" 0 "$total"
  } >&2
}
