#!/usr/bin/env bash
# Installs every dependency (Debian packages) and runs every test of Rebound, then checks the
# locks twice (docs/thread_safety.md):
#
#   tools/test.sh [extra bazel test flags]
#
#   1. `bazel test //...`: every test, gcc.
#   2. `bazel build --config=tsan //...`, compile only: clang's thread-safety analysis over all
#      of the project's code (every ABSL_GUARDED_BY and friends; warnings are errors). --config=tsan
#      carries --config=tsa's flags (.bazelrc), so this one clang compile is both the tsa check
#      and the objects phase 3 links: checking the locks costs no second compile of //....
#   3. `bazel test --config=tsan` over the unit and integration tests, ThreadSanitizer: a race in
#      a test or in a server or worker it spawns fails the test. Left out, and listed as such:
#      //tests/chaos (its fault timeouts are tuned for the normal build: under TSan's 5-15x
#      slowdown they fire on healthy processes), and the tests that run no concurrent C++ of
#      Rebound's (//tests/deploy, //tests/docs, //tests/launch, //tests/tools: YAML, docs and
#      launcher-config checks) and //fuzz (libFuzzer, its own --config=fuzz). The integration
#      tests' waits, RPC deadlines and job timeouts are stretched under TSan by one factor,
#      REBOUND_TEST_TIME_SCALE (`test:tsan` in .bazelrc; testing/cluster/time_scale.h), so none of
#      them is left out for want of time.
#
# Tests that need a GPU are tagged "gpu" and only exist in --config=cuda builds; on a CPU-only
# build they are reported here as skipped, never as passed. //tools/tsan:interposer_test exists
# only in the tsan build and is counted there.
#
# Time (docs/thread_safety.md#cost): 23.5 min on the 2-core development VM with warm caches
# (2026-12-03; the TSan test run alone 20 min). On a fresh machine, estimated from the CI run of
# phase 1 (8.5 min) and cold clang builds: about 45 min in all, under CI's 60.
# REBOUND_SANITIZERS=0 runs phase 1 only, for a quick local check; the summary then says the
# other two were not run.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh

TSAN_TESTS=(
  //tools/tsan/...
  //tests/common/...
  //tests/storage/...
  //tests/compute/...
  //tests/server/...
  //tests/worker/...
  //tests/integration/...
  //tests/coord/...
)
# Tests of those groups that cannot pass under TSan for want of time, not for a race, left out by
# name and never counted (docs/thread_safety.md). None today: training_test, bad_input_test and
# recovery_test, once left out for their fixed deadlines, run with the time scale.
TSAN_EXCLUDED=()
TSAN_LEFT_OUT=(
  "//tests/chaos/... (fault timeouts tuned for the normal build fire under TSan's slowdown)"
  "//tests/deploy/... //tests/docs/... //tests/launch/... //tests/tools/... (no concurrent C++ of Rebound's)"
  "//fuzz/... (libFuzzer targets: --config=fuzz)"
  "//tests/python/... (the Python client; the server it talks to is covered by //tests/integration/... here)"
)

log=$(mktemp)
tsan_log=$(mktemp)
trap 'rm -f "$log" "$tsan_log"' EXIT

# Counts a `bazel test --test_summary=short` log of PATTERNs: passed, failed, and the gpu tests
# not run (listed on stderr).
count() {  # count LOG PATTERN... -> "passed failed skipped"
  local file="$1"
  shift
  local p f s=0
  p=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$file" || true)
  f=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$file" || true)
  for t in $(bazel query "attr(tags, \"\bgpu\b\", tests(set($*)))" 2>/dev/null); do
    if ! grep -qE "^$t +(\(cached\) )?PASSED" "$file"; then
      echo "SKIPPED $t (needs a GPU and a --config=cuda build)" >&2
      s=$((s + 1))
    fi
  done
  echo "$p $f $s"
}

# 1. Every test.
rc=0
bazel test //... --test_summary=short "$@" 2>&1 | tee "$log" || rc=$?
read -r passed failed skipped < <(count "$log" //...)
ok=1
if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then ok=0; fi
summary="rebound tests: $passed passed, $failed failed, $skipped skipped"

if [ "${REBOUND_SANITIZERS:-1}" = "0" ]; then
  echo "$summary; tsa build not run; tsan not run (REBOUND_SANITIZERS=0)"
  [ "$ok" -eq 1 ] || exit 1
  exit 0
fi

# 2. Thread-safety analysis (--config=tsa's flags, inside --config=tsan): compile only.
tsa=ok
# Compiling is what checks; linking every binary would only cost time (phase 3 links its tests).
bazel build --config=tsan --output_groups=compilation_outputs //... || tsa=FAILED
[ "$tsa" = ok ] || ok=0

# 3. ThreadSanitizer over the unit and integration tests.
tsan_rc=0
excluded=()
for t in "${TSAN_EXCLUDED[@]}"; do excluded+=("-$t"); done
bazel test --config=tsan --test_summary=short "$@" -- "${TSAN_TESTS[@]}" "${excluded[@]}" 2>&1 |
  tee "$tsan_log" || tsan_rc=$?
read -r tsan_passed tsan_failed tsan_skipped < <(count "$tsan_log" "${TSAN_TESTS[@]}")
for left in "${TSAN_LEFT_OUT[@]}"; do echo "NOT UNDER TSAN $left"; done
if [ "$tsan_rc" -ne 0 ] || [ "$tsan_failed" -ne 0 ] || [ "$tsan_passed" -eq 0 ]; then ok=0; fi

echo "$summary; tsa build $tsa; tsan: $tsan_passed passed, $tsan_failed failed," \
  "$tsan_skipped skipped, ${#TSAN_EXCLUDED[@]} tests and 3 groups left out"
[ "$ok" -eq 1 ] || exit 1
