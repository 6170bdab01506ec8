#!/usr/bin/env bash
# Installs every dependency (Debian packages) and runs Rebound's tests in one of two tiers
# (docs/testing.md):
#
#   tools/test.sh [--full] [extra bazel test flags]
#
# The default tier (the README's test command; .ci/run runs it):
#   1. `bazel test //...`: every test target once, gcc.
#   2. `bazel build --config=tsan --output_groups=compilation_outputs TSA_TARGETS`, compile only:
#      clang's thread-safety analysis (every ABSL_GUARDED_BY and friends; warnings are errors) over
#      every package that holds such annotations: the product's code, testing/, tools/, the
#      tests phase 3 runs and bench's synthetic trainers (--full: all of //..., the benchmark
#      drivers, fuzzers and other test drivers too: 233 compiles instead of 173). --config=tsan
#      carries --config=tsa's flags (.bazelrc), so this one clang compile is both the tsa check
#      and the objects phase 3 links.
#   3. ThreadSanitizer (`bazel test --config=tsan`) over the unit tests (TSAN_UNIT_TESTS) and over
#      one short end-to-end case per concurrent feature (TSAN_CASES): replay recovery, a pipeline
#      of S = 2 stages, a trainer killed on a sharded center and a server group's failover (the
#      Python spare's verified replay against the tsan-built server only with --full: its
#      timeouts are not stretched under TSan). Each case is a `bazel test`
#      of its own: a Catch2 test name as --test_arg (with --warn NoTests, so a name that matches
#      nothing fails), a pytest -k expression as --test_filter (tests/python/run_pytest.sh). A race
#      in a test or in a server or worker it spawns fails it.
# `--full` adds everything else:
#   1. the tests tagged "manual" and "full" (FULL_ONLY_TESTS, found by that tag): the *_full twins
#      of tools/tiers.bzl and tests/python/BUILD, which hold the cases tagged [.full] (Catch2) or
#      marked full (pytest), and //tests/deploy:image_chroot_test, the images built as Debian 12
#      roots with debootstrap (minutes, the Debian mirror). A test there that skips (unittest's
#      "OK (skipped=N)", e.g. no mirror) counts as skipped, not passed;
#   3. under TSan, every unit and integration test (the whole of //tests/integration/..., which
#      holds the Catch2 cases above, and the [full] twins of those packages) and still the Python
#      case;
#   4. the fuzzers' bounded runs of docs/fuzzing.md: bench/fuzz.sh (`bazel run //bench:fuzz`),
#      60 s per target with clang, libFuzzer and ASan (its own clang build, --config=fuzz).
# Run --full before merging a change to concurrent code, storage, recovery or replication.
#
# Left out under TSan in both tiers, and listed as such: //tests/chaos (its fault timeouts are
# tuned for the normal build: under TSan's 5-15x slowdown they fire on healthy processes; it runs
# in phase 1 at its one setting: the test has no flag for longer runs, those are bench/chaos's,
# docs/chaos.md), //tests/deploy, //tests/docs, //tests/launch, //tests/tools, //testing (YAML,
# docs, launcher checks; the harness's own tests), //fuzz (libFuzzer: --config=fuzz) and
# //tests/python but its one case (the client is Python; the server it talks to is what TSan
# checks). The integration tests' waits, RPC deadlines and job timeouts are stretched under TSan
# by REBOUND_TEST_TIME_SCALE (`test:tsan` in .bazelrc; testing/cluster/time_scale.h); the Python
# case's are not (tests/python does not read it).
#
# Tests that need a GPU are tagged "gpu" and only exist in --config=cuda builds; on a CPU-only
# build they are reported here as skipped, never as passed. //tools/tsan:interposer_test exists
# only in the tsan build and is counted there.
#
# Tests run two at a time (.bazelrc: --local_test_jobs=2); those tagged "exclusive" (they start
# servers, workers or etcd) run alone, after the others.
# Time: targets, not measurements (R16): the default tier within 25 min on a fresh 2-core machine
# (no warm cache), CI (.ci/run) within 30 min of its 90. Measured wall times per target, from a
# run: docs/testing.md#per-target-wall-times (tools/test_times.sh).
# REBOUND_SANITIZERS=0 runs phase 1 only, for a quick local check; the summary then says the
# others were not run.
#
# The last line: `rebound tests: N passed, N failed, N skipped` (phase 1), then the tier, the tsa
# build, the TSan counts, the fuzz runs (--full) and what the tier left out.
set -euo pipefail
self=$(readlink -f "$0")
cd "$(dirname "$self")/.."

tier=default
bazel_flags=()
for arg in "$@"; do
  case "$arg" in
    --full) tier=full ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$self"; exit 0 ;;
    *) bazel_flags+=("$arg") ;;
  esac
done
set -- "${bazel_flags[@]}"

# Phase 1 of --full only: the tests tagged "manual" (so //... leaves them out) and "full", found
# by that tag (after the set-up, below): //tests/deploy:image_chroot_test and the *_full twins of
# tools/tiers.bzl's tiered_cc_test, which hold the Catch2 cases tagged [full].
FULL_ONLY_TESTS=()
TSAN_UNIT_TESTS=(
  //tools/tsan/...
  //tests/common/...
  //tests/storage/...
  //tests/compute/...
  //tests/server/...
  //tests/worker/...
  //tests/coord/...
)
TSAN_INTEGRATION_TESTS=(
  //tests/integration/...
)
# The thread-safety analysis of the default tier: every package whose sources hold thread-safety
# annotations, with the targets phase 3 runs (a file with annotations outside these, as
# `grep -rlE 'GUARDED_BY|LOCKS_REQUIRED|LOCKS_EXCLUDED'` finds them, needs its target here).
TSA_TARGETS=(
  //common/...
  //compute/...
  //coord/...
  //server/...
  //storage/...
  //worker/...
  //tools/...
  //testing/...
  //bench:synthetic_trainers
)
# One short end-to-end case per concurrent feature: feature|target|its source|the Catch2 test name
# (a .cc source), or the pytest -k expression (a .py source). Chosen by reading the tests, as the
# shortest case of the feature (docs/testing.md#the-tsan-cases says why each).
TSAN_CASES=(
  "replay recovery|//tests/integration:recovery_test|tests/integration/recovery_test.cc|a lost slot waits for a spare, and a spare that registers later rebuilds it by replay"
  "pipeline S = 2|//tests/integration:pipeline_test|tests/integration/pipeline_test.cc|malformed, foreign and misaddressed boundary pairs are refused and change nothing"
  "sharded kill|//tests/integration:sharding_test|tests/integration/sharding_test.cc|a trainer killed between its sync to range 0 and range 1 is rebuilt by replay, every range applies the step once, and the run ends bit-identical to one group"
  "group failover|//tests/integration:group_test|tests/integration/group_test.cc|the leader SIGKILLed, then its disk lost: the job finishes with every sync applied once"
  "Python spare replay|//tests/python:client_test|tests/python/test_client.py|test_a_killed_trainer_is_rebuilt_by_verified_replay and adahessian"
)
TSAN_LEFT_OUT=(
  "//tests/chaos/... (fault timeouts tuned for the normal build fire under TSan's slowdown)"
  "//tests/deploy/... //tests/docs/... //tests/launch/... //tests/observability/... //tests/tools/... (no concurrent C++ of Rebound's)"
  "//testing/... (the cluster harness's own tests; the integration tests run the harness under TSan)"
  "//fuzz/... (libFuzzer targets: --config=fuzz)"
  "//tests/python/... but its one case (the client is Python; the server it talks to is checked by the case)"
)
# What the tier leaves out, for its summary line.
if [ "$tier" = default ]; then
  TIER_LEFT_OUT=(
    "FULL_ONLY_TESTS (--full: debootstrap images; the [full] cases of tiered_cc_test, docs/testing.md#tiers)"
    "under TSan, //tests/integration but its 4 cases (--full runs it all), //tests/python (--full runs its spare-replay case: its timeouts are not scaled), //tests/chaos, //tests/deploy, //tests/docs, //tests/launch, //tests/observability, //tests/tools, //testing, //fuzz"
    "the fuzzers' runs (--full)"
    "the thread-safety analysis of the benchmark drivers, //fuzz, //study and the test drivers TSan does not run (no annotations there; --full analyses //...)"
  )
else
  TIER_LEFT_OUT=(
    "under TSan, //tests/python but 1 case, //tests/chaos, //tests/deploy, //tests/docs, //tests/launch, //tests/observability, //tests/tools, //testing, //fuzz"
  )
fi
TIER_LEFT_OUT+=("longer chaos runs (bench/chaos: //tests/chaos has no flag for them)")

# Every case still names a test of its source: a renamed test fails here, right after the set-up
# (which installs python3), not after the TSan build.
check_cases() {
  /usr/bin/python3 - "$@" <<'PYTHON'
import re
import sys

bad = 0
for entry in sys.argv[1:]:
    feature, target, source, selector = entry.split("|", 3)
    try:
        text = open(source, encoding="utf-8").read()
    except OSError as error:
        print("tools/test.sh: TSan case %r: cannot read %s: %s" % (feature, source, error))
        bad += 1
        continue
    if source.endswith(".cc"):
        names = set()
        for m in re.finditer(r"TEST_CASE\s*\(", text):
            i, parts = m.end(), []
            literal = re.compile(r'\s*"((?:[^"\\]|\\.)*)"')
            while True:
                lm = literal.match(text, i)
                if not lm:
                    break
                parts.append(lm.group(1))
                i = lm.end()
            names.add("".join(parts))
        found = selector in names
    else:
        function = selector.split()[0]
        found = re.search(r"^def %s\(" % re.escape(function), text, re.M) is not None
    if not found:
        print("tools/test.sh: TSan case %r (%s) names no test of %s: %r; update TSAN_CASES"
              % (feature, target, source, selector))
        bad += 1
sys.exit(1 if bad else 0)
PYTHON
}
# A Catch2 v2 test name as a test spec: a comma would separate two specs and brackets start a
# tag, so they (and backslashes) are escaped.
catch2_spec() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//,/\\,}
  s=${s//\[/\\[}
  s=${s//\]/\\]}
  printf '%s' "$s"
}

tools/setup.sh
if [ "${REBOUND_SANITIZERS:-1}" != "0" ]; then check_cases "${TSAN_CASES[@]}" || exit 2; fi
full_query='attr(tags, "\bfull\b", tests(//...))'
mapfile -t FULL_ONLY_TESTS < <(bazel query "$full_query" 2>/dev/null)
if [ "${#FULL_ONLY_TESTS[@]}" -eq 0 ]; then
  echo "tools/test.sh: bazel query '$full_query' found no test" >&2
  exit 2
fi
TIER_LEFT_OUT=("${TIER_LEFT_OUT[@]/FULL_ONLY_TESTS/${FULL_ONLY_TESTS[*]}}")

log=$(mktemp)
tsan_log=$(mktemp)
case_log=$(mktemp)
fuzz_log=$(mktemp)
trap 'rm -f "$log" "$tsan_log" "$case_log" "$fuzz_log" "${bg_log:-}" "${bg_status:-}"' EXIT

# Counts a `bazel test --test_summary=short` log: passed, failed, and the gpu tests of PATTERNs
# not run (listed on stderr).
count() {  # count LOG [PATTERN...] -> "passed failed skipped"
  local file="$1"
  shift
  local p f s=0
  p=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$file" || true)
  f=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$file" || true)
  if [ $# -gt 0 ]; then
    for t in $(bazel query "attr(tags, \"\bgpu\b\", tests(set($*)))" 2>/dev/null); do
      if ! grep -qE "^$t +(\(cached\) )?PASSED" "$file"; then
        echo "SKIPPED $t (needs a GPU and a --config=cuda build)" >&2
        s=$((s + 1))
      fi
    done
  fi
  echo "$p $f $s"
}

# Phases 2 and 3 need a clang build of their own (--config=tsan); it starts now, beside phase 1,
# in an output base of its own (a second Bazel server: one server runs one command at a time)
# under the SCHED_IDLE policy (chrt --idle), nice 19 and the idle I/O class: its compiles take
# only the CPU time phase 1 leaves unused (the end-to-end tests leave about 40% of the 2 cores
# idle, waiting on timeouts and each other), never a share of a test's. That server is shut
# down once the build is done; phase 3 runs its tests on a server started at normal priority.
tsa_targets=("${TSA_TARGETS[@]}" "${TSAN_UNIT_TESTS[@]}")
case_targets=()
for entry in "${TSAN_CASES[@]}"; do
  IFS='|' read -r _ case_target _ _ <<< "$entry"
  case_targets+=("$case_target")
done
tsa_targets+=("${case_targets[@]}")
if [ "$tier" != default ]; then
  # Everything `bazel build //...` builds, listed by this (the main) server: the TSan server
  # would walk `//...` into this workspace's convenience symlink bazel-<directory> (it points
  # into the main server's output base, not its own), which only .bazelignore's names keep out
  # (bazel-main, bazel-rebound): a clone in another directory failed to load
  # bazel-<directory>/external/bazel_tools.
  mapfile -t tsa_targets < <(bazel query \
    'kind(rule, //...) except attr(tags, "\bmanual\b", //...)' 2>/dev/null)
  if [ "${#tsa_targets[@]}" -eq 0 ]; then
    echo "tools/test.sh: bazel query found no targets for the thread-safety analysis" >&2
    exit 1
  fi
fi
tsan_groups=("${TSAN_UNIT_TESTS[@]}")
if [ "$tier" = full ]; then
  tsan_groups+=("${TSAN_INTEGRATION_TESTS[@]}")
  # ... and the [full] twins of those packages (manual: the patterns above leave them out).
  tsan_set="${TSAN_UNIT_TESTS[*]} ${TSAN_INTEGRATION_TESTS[*]}"
  mapfile -t tsan_full < <(bazel query "attr(tags, \"\bfull\b\", tests(set($tsan_set)))" \
    2>/dev/null)
  tsan_groups+=("${tsan_full[@]}")
fi
tsan_base="$(bazel info output_base 2>/dev/null)-tsan"
tsan_bazel=(bazel "--output_base=$tsan_base")
# No convenience symlinks from that server (--symlink_prefix=/): Bazel would repoint bazel-out at
# its output base and add bazel-tsan-<workspace>, a copy of the workspace that `//...` would walk
# into. tools/test.sh links its logs as bazel-tsan-out after phase 3 (for tools/test_times.sh;
# .bazelignore names it).
tsan_flags=(--config=tsan --symlink_prefix=/)
bg_log=$(mktemp)
bg_status=$(mktemp)
bg_pid=""
if [ "${REBOUND_SANITIZERS:-1}" != "0" ]; then
  (
    # Each wrapper only where this machine accepts it (a container may refuse a policy): the
    # build must not fail for want of a lower priority.
    idle=(nice -n 19)
    if chrt --idle 0 true 2>/dev/null; then idle=(chrt --idle 0 "${idle[@]}"); fi
    if ionice -c 3 true 2>/dev/null; then idle+=(ionice -c 3); fi
    # The server daemonizes into a session of its own, and with the kernel's autogroups (Debian's
    # default, /proc/sys/kernel/sched_autogroup_enabled) CPU time is shared between sessions
    # first: its compiles would take half the CPU whatever their own policy. Nice 19 on its
    # autogroup (/proc/PID/autogroup) brings that share down to about 2% while phase 1 runs.
    "${idle[@]}" "${tsan_bazel[@]}" info server_pid > "$bg_status.pid" 2>/dev/null || true
    server_pid=$(cat "$bg_status.pid" 2>/dev/null || true)
    if [ -n "$server_pid" ] && [ -w "/proc/$server_pid/autogroup" ]; then
      echo 19 > "/proc/$server_pid/autogroup" || true
      echo "phase 2: the TSan build's Bazel server $server_pid runs in $(cat "/proc/$server_pid/autogroup")"
    fi
    rm -f "$bg_status.pid"
    # 2. Thread-safety analysis (--config=tsa's flags, inside --config=tsan): compile only.
    # Compiling is what checks; phase 3's build links what it runs.
    tsa_rc=0
    "${idle[@]}" "${tsan_bazel[@]}" build "${tsan_flags[@]}" \
      --output_groups=compilation_outputs -- "${tsa_targets[@]}" || tsa_rc=$?
    echo "$tsa_rc" > "$bg_status"
    # Phase 3's test binaries and the binaries they start, linked ahead (a failure here shows
    # again in phase 3, which builds what is left).
    "${idle[@]}" "${tsan_bazel[@]}" build "${tsan_flags[@]}" --build_tests_only \
      -- "${tsan_groups[@]}" "${case_targets[@]}" || true
    "${tsan_bazel[@]}" shutdown
  ) > "$bg_log" 2>&1 &
  bg_pid=$!
fi

# 1. Every test (--full: and FULL_ONLY_TESTS).
phase1=(//...)
[ "$tier" = default ] || phase1+=("${FULL_ONLY_TESTS[@]}")
rc=0
bazel test --test_summary=short "$@" -- "${phase1[@]}" 2>&1 | tee "$log" || rc=$?
read -r passed failed skipped < <(count "$log" //...)
# A full-only test that passed by skipping (it could not run here) is reported as skipped.
if [ "$tier" = full ]; then
  for t in "${FULL_ONLY_TESTS[@]}"; do
    testlog="bazel-testlogs/${t#//}"
    testlog="${testlog/://}/test.log"
    if grep -qE "^$t +(\(cached\) )?PASSED" "$log" && grep -qE '^OK \(skipped=' "$testlog"; then
      echo "SKIPPED $t: $(grep -m1 -oE "skipped '.*'" "$testlog" || echo 'see its test.log')" >&2
      passed=$((passed - 1))
      skipped=$((skipped + 1))
    fi
  done
fi
ok=1
if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then ok=0; fi
summary="rebound tests: $passed passed, $failed failed, $skipped skipped; tier $tier"

if [ "${REBOUND_SANITIZERS:-1}" = "0" ]; then
  echo "$summary; tsa build not run; tsan not run (REBOUND_SANITIZERS=0)"
  [ "$ok" -eq 1 ] || exit 1
  exit 0
fi

# 2. The thread-safety analysis, started before phase 1 (above): wait for it.
wait "$bg_pid" || true
echo "---- phase 2 (--config=tsan compile, beside phase 1) ----"
cat "$bg_log"
tsa=ok
[ "$(cat "$bg_status" 2>/dev/null)" = 0 ] || tsa=FAILED
[ "$tsa" = ok ] || ok=0

# 3. ThreadSanitizer: the unit tests (--full: and the integration tests), in one invocation.
tsan_rc=0
"${tsan_bazel[@]}" test "${tsan_flags[@]}" --test_summary=short "$@" -- "${tsan_groups[@]}" 2>&1 |
  tee "$tsan_log" || tsan_rc=$?
read -r tsan_passed tsan_failed tsan_skipped < <(count "$tsan_log" "${tsan_groups[@]}")
ln -sfn "$tsan_base/execroot/rebound/bazel-out" bazel-tsan-out
if [ "$tsan_rc" -ne 0 ] || [ "$tsan_failed" -ne 0 ] || [ "$tsan_passed" -eq 0 ]; then ok=0; fi
tsan_targets=$((tsan_passed + tsan_failed))

# ... then the cases, one invocation each (--full: the Python case only; the whole of the
# integration targets ran above).
cases_run=0
for entry in "${TSAN_CASES[@]}"; do
  IFS='|' read -r feature target source selector <<<"$entry"
  if [ "$tier" = full ] && [[ "$source" == *.cc ]]; then continue; fi
  # The Python case's failure timeouts are not stretched under TSan (tests/python does not read
  # REBOUND_TEST_TIME_SCALE): a false failure there would fail CI for no race. --full runs it.
  if [ "$tier" = default ] && [[ "$source" == *.py ]]; then continue; fi
  if [[ "$source" == *.cc ]]; then
    pick=(--test_arg=--warn --test_arg=NoTests "--test_arg=$(catch2_spec "$selector")")
  else
    pick=("--test_filter=$selector")
  fi
  echo "TSAN CASE $feature: $target, $selector"
  case_rc=0
  "${tsan_bazel[@]}" test "${tsan_flags[@]}" --test_summary=short "$@" "${pick[@]}" -- "$target" 2>&1 |
    tee "$case_log" || case_rc=$?
  read -r p f _ < <(count "$case_log")
  if [ "$case_rc" -ne 0 ] || [ "$p" -ne 1 ]; then
    [ "$f" -gt 0 ] || f=1
    p=0
    ok=0
    echo "TSAN CASE FAILED $feature: $target, $selector"
  fi
  tsan_passed=$((tsan_passed + p))
  tsan_failed=$((tsan_failed + f))
  cases_run=$((cases_run + 1))
done
for left in "${TSAN_LEFT_OUT[@]}"; do echo "NOT UNDER TSAN $left"; done

# 4. --full: the fuzzers' bounded runs (docs/fuzzing.md).
fuzz=""
if [ "$tier" = full ]; then
  fuzz="; fuzz runs ok"
  if ! bench/fuzz.sh --seconds=60 2>&1 | tee "$fuzz_log"; then
    fuzz="; fuzz runs FAILED"
    ok=0
  fi
fi

for left in "${TIER_LEFT_OUT[@]}"; do echo "NOT IN TIER $tier: $left"; done
left_out=$(printf '%s; ' "${TIER_LEFT_OUT[@]}")
plural=s
[ "$cases_run" -ne 1 ] || plural=""
echo "$summary; tsa build $tsa; tsan: $tsan_passed passed, $tsan_failed failed," \
  "$tsan_skipped skipped ($tsan_targets targets, $cases_run end-to-end case$plural)$fuzz;" \
  "left out: ${left_out%; }"
[ "$ok" -eq 1 ] || exit 1
