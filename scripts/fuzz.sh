#!/usr/bin/env bash
# Runs the fuzz targets of fuzz/ (cargo-fuzz, libFuzzer, on nightly with debug assertions, so
# an overflow is a crash too), each for SECONDS, from its seeds (fuzz/seeds/<target>) and the
# corpus earlier runs grew (<cache>/fuzz/corpus/<target>). Installs the nightly toolchain and
# cargo-fuzz when they are missing. Prints one line per target (executions, coverage, corpus,
# crashes) and exits 1 if any target found a crash, whose input is kept under
# <cache>/fuzz/artifacts/<target>/ (reproduce: cargo +nightly fuzz run -a TARGET FILE).
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]     # default: 60 s each, every target
#   scripts/fuzz.sh --build-only              # the toolchain, cargo-fuzz and the build alone
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
. "$root/scripts/cache-dir.sh"
cache=$(sandbox_cache_dir)/fuzz
build_only=0
if [ "${1:-}" = --build-only ]; then build_only=1; shift; fi
seconds=${1:-60}
shift || true
log() { printf '[fuzz %s] %s\n' "$(date +%T)" "$*" >&2; }

# cargo-fuzz's version, pinned: its flags and output are what this script reads.
cargo_fuzz_version=0.13.2
if ! rustup run nightly rustc --version >/dev/null 2>&1; then
  log "installing the nightly toolchain (libFuzzer's sanitizer coverage needs it)"
  rustup toolchain install nightly --profile minimal >&2
fi
if ! cargo fuzz --version 2>/dev/null | grep -q "$cargo_fuzz_version"; then
  log "installing cargo-fuzz $cargo_fuzz_version"
  # In a target directory of its own: under the workspace's (CARGO_TARGET_DIR) it would hold that
  # directory's lock while bin/test builds beside it.
  CARGO_TARGET_DIR=$cache/install-target cargo install --locked --quiet cargo-fuzz --version "$cargo_fuzz_version" >&2
fi

cd "$root/fuzz"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || mapfile -t targets < <(cargo +nightly fuzz list)
export CARGO_TARGET_DIR=$cache/target
log "building ${#targets[@]} targets (nightly, optimised, debug assertions)"
cargo +nightly fuzz build --debug-assertions >&2
[ $build_only = 0 ] || exit 0

failed=()
printf '%-18s %12s %8s %8s %8s  %s\n' target executions exec/s cov corpus result
for t in "${targets[@]}"; do
  corpus=$cache/corpus/$t artifacts=$cache/artifacts/$t
  mkdir -p "$corpus" "$artifacts"
  out=$cache/$t.log
  extra=()
  case $t in
    # Its runtime's thread pools and buffers outlive an input, which LeakSanitizer would check
    # after every input that allocated more than it freed (halving the speed); -rss_limit_mb
    # still bounds what it holds.
    tcp_stack) extra=(-detect_leaks=0) ;;
    # The agent reaps as PID 1 does (waitpid(-1) on a thread of its own), which also reaps the
    # tracer LeakSanitizer forks for its check; its streams' threads also end after the input.
    agent_server) extra=(-detect_leaks=0) ;;
  esac
  set +e
  # -timeout: one input taking 10 s is a hang; -rss_limit_mb: one input's memory is bounded.
  cargo +nightly fuzz run --debug-assertions "$t" "$corpus" "$root/fuzz/seeds/$t" -- \
    -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$artifacts/" "${extra[@]}" >"$out" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$out" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$out" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$out" | tail -1 | cut -d' ' -f2)
  corp=$(grep -o 'corp: [0-9]*' "$out" | tail -1 | cut -d' ' -f2)
  if [ "$rc" -eq 0 ]; then
    result=ok
  else
    result="CRASH (exit $rc): $(ls -t "$artifacts" 2>/dev/null | head -1); log $out"
    failed+=("$t")
    grep -E 'panicked|ERROR: libFuzzer|SUMMARY|deadly signal|timeout' "$out" | head -5 >&2 || true
  fi
  printf '%-18s %12s %8s %8s %8s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" "${corp:-?}" "$result"
done
if [ ${#failed[@]} -gt 0 ]; then
  log "crashes in: ${failed[*]} (inputs under $cache/artifacts/)"
  exit 1
fi
