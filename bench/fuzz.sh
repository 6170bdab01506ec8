#!/usr/bin/env bash
# Fuzzes every target of fuzz/ for a bounded time (docs/fuzzing.md):
#   bazel run //bench:fuzz -- [--seconds=60] [--targets=config_fuzzer,...] [--workdir=DIR]
#   bench/fuzz.sh [same flags]                     (from a checkout, without bazel run)
# Builds the fuzzers with --config=fuzz (clang, libFuzzer, ASan; outputs beside the gcc build's),
# then runs each for --seconds on a scratch copy of its corpus (fuzz/corpus/<target>/, which it
# never writes). Prints per target the executions and crashes (crash, leak, timeout or
# out-of-memory inputs libFuzzer saved), then `RESULT fuzz: targets=T executions=E crashes=C`.
# Exit status: 0 with no crash, 1 with one or more (each input saved in the work directory), 2 on
# a usage or build error.
set -euo pipefail

seconds=60
targets="config_fuzzer,tensor_codec_fuzzer,service_fuzzer,worker_peer_fuzzer"
workdir=""
for arg in "$@"; do
  case "$arg" in
    --seconds=*) seconds="${arg#*=}" ;;
    --targets=*) targets="${arg#*=}" ;;
    --workdir=*) workdir="${arg#*=}" ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done
if ! [[ "$seconds" =~ ^[1-9][0-9]*$ ]]; then
  echo "fuzz.sh: --seconds must be a positive integer, got '$seconds'" >&2
  exit 2
fi

# The workspace: bazel run says where it is; otherwise this script's checkout.
if [[ -n "${BUILD_WORKSPACE_DIRECTORY:-}" ]]; then
  cd "$BUILD_WORKSPACE_DIRECTORY"
else
  cd "$(dirname "$(readlink -f "$0")")/.."
fi

IFS=',' read -r -a names <<< "$targets"
labels=()
for name in "${names[@]}"; do
  if [[ ! -d "fuzz/corpus/$name" ]]; then
    echo "fuzz.sh: no fuzz target $name (no fuzz/corpus/$name)" >&2
    exit 2
  fi
  labels+=("//fuzz:$name")
done

# clang, libFuzzer, ASan and lld are not part of the default install.
tools/setup.sh --fuzz >&2
echo "building ${labels[*]} with --config=fuzz" >&2
if ! bazel build --config=fuzz "${labels[@]}" >&2; then
  echo "fuzz.sh: the fuzz build failed" >&2
  exit 2
fi
bin=$(bazel info --config=fuzz bazel-bin 2>/dev/null)

if [[ -z "$workdir" ]]; then
  workdir=$(mktemp -d "${TMPDIR:-/tmp}/rebound-fuzz.XXXXXX")
fi
mkdir -p "$workdir"
if [[ -z "${ASAN_SYMBOLIZER_PATH:-}" ]] && ! command -v llvm-symbolizer > /dev/null &&
  [[ -x /usr/lib/llvm-14/bin/llvm-symbolizer ]]; then
  export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
fi

total_execs=0
total_crashes=0
for name in "${names[@]}"; do
  dir="$workdir/$name"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  log="$dir/fuzz.log"
  echo "fuzzing $name for ${seconds}s (log: $log)" >&2
  # New inputs go to the scratch corpus (the first directory); the checked-in one is read only.
  set +e
  # -max_len: libFuzzer would otherwise cap inputs at the largest seed (a session of ~1 KB).
  "$bin/fuzz/$name" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 \
    -rss_limit_mb=2048 -max_len=16384 -artifact_prefix="$dir/artifacts/" \
    "$dir/corpus" "fuzz/corpus/$name" > "$log" 2>&1
  rc=$?
  set -e
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
  if [[ -z "$execs" ]]; then
    # No final stats (the run ended in a crash): the last progress line's count.
    execs=$(sed -n 's/^#\([0-9]*\).*/\1/p' "$log" | tail -1)
  fi
  execs=${execs:-0}
  crashes=$(find "$dir/artifacts" -type f \( -name 'crash-*' -o -name 'leak-*' -o \
    -name 'timeout-*' -o -name 'oom-*' \) | wc -l)
  if [[ $rc -ne 0 && $crashes -eq 0 ]]; then
    crashes=1  # it died without saving an input: count it, the log says why
  fi
  rate=$(( execs / seconds ))
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$log" | tail -1 || true)
  new_inputs=$(find "$dir/corpus" -type f | wc -l)
  echo "fuzz $name: executions=$execs crashes=$crashes (${rate}/s; ${cov:-cov: ?}; $new_inputs new inputs; exit $rc)"
  if [[ $crashes -gt 0 ]]; then
    find "$dir/artifacts" -type f | sed 's/^/  saved input: /'
    grep -m1 -E 'ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)|fuzz property violated' "$log" |
      sed 's/^/  /' || true
  fi
  total_execs=$(( total_execs + execs ))
  total_crashes=$(( total_crashes + crashes ))
done

echo "work directory (corpora, logs, saved inputs): $workdir"
echo "RESULT fuzz: targets=${#names[@]} executions=$total_execs crashes=$total_crashes"
[[ $total_crashes -eq 0 ]]
