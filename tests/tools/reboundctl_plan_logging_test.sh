#!/usr/bin/env bash
# Specification of `reboundctl plan-logging`'s flags (common/logging_plan.h has the rule itself):
# --budget and its alias --budget_bytes; --stage_ms (measured ms per stage) changes the ranking
# and adds the expected recovery in ms; --boundary_bytes replaces the width estimate; a wrong
# count or a bad number is a usage error (exit 64) naming the flag.
#
# The job is tests/common/logging_plan_test.cc's: 10 -> 8 -> 8 -> 8 -> 4 in four stages, batch 2,
# tau 10; every boundary 256 bytes per step, 2560 stored. With stage times 1, 1, 4, 4 ms a budget
# of 5120 bytes drops boundary 1 (by multiply-adds: boundary 3), and the expected recovery is
# 15.0 ms (12.5 with all logged); that test derives the figures.
#
# Runs under `bazel test //tests/tools:reboundctl_plan_logging_test`, or from the repository root
# as `tests/tools/reboundctl_plan_logging_test.sh` after `bazel build //tools:reboundctl`.
set -uo pipefail

ctl=${TEST_SRCDIR:+$TEST_SRCDIR/${TEST_WORKSPACE:-rebound}/}
ctl=${ctl:-bazel-bin/}tools/reboundctl
dir=$(mktemp -d "${TEST_TMPDIR:-/tmp}/reboundctl_plan_logging_test.XXXXXX")
trap 'rm -rf "$dir"' EXIT

cat >"$dir/job.pbtxt" <<'JOB'
job_id: "p"
model { input_dim: 10 layers { width: 8 } layers { width: 8 } layers { width: 8 }
        layers { width: 4 activation: IDENTITY } }
topology { replicas: 1 stages: 4 }
data { batch_size: 2 micro_batches: 1 }
easgd { sync_period: 10 }
JOB

testlib=${TEST_SRCDIR:+$TEST_SRCDIR/${TEST_WORKSPACE:-rebound}/}tests/tools/testlib.sh
# shellcheck source=tests/tools/testlib.sh
source "$testlib" || { echo "FAIL: cannot read $testlib"; exit 1; }
# run ARGS...: sets $out, $err and $rc.
run() {
  out=$("$ctl" plan-logging --job "$dir/job.pbtxt" "$@" 2>"$dir/err")
  rc=$?
  err=$(cat "$dir/err")
}
expect_rc() {
  [ "$rc" = "$1" ] || fail "exit code: expected $1, got $rc (stderr: $err)"
}

scenario "--budget plans by multiply-adds when no time is measured"
run --budget 5120
expect_rc 0
expect_contains "plan" "step_log { logged_boundaries: [1, 2] }" "$out"
expect_contains "plan" "estimated from multiply-adds" "$out"
expect_lacks "plan" " ms (every boundary logged" "$out"

scenario "--budget_bytes is an alias of --budget"
by_budget=$out
run --budget_bytes 5120
expect_rc 0
[ "$out" = "$by_budget" ] || fail "--budget_bytes 5120 printed something else than --budget 5120"
run --budget 5120 --budget_bytes 5120
expect_rc 0
run --budget 5120 --budget_bytes 2560
expect_rc 64
expect_contains "stderr" "--budget and --budget_bytes" "$err"

scenario "--stage_ms ranks by measured time and prints the expected recovery in ms"
run --budget 5120 --stage_ms 1,1,4,4
expect_rc 0
expect_contains "plan" "step_log { logged_boundaries: [2, 3] }" "$out"
expect_contains "plan" "expected recovery per failure: 15.0 ms (every boundary logged: 12.5 ms)" \
  "$out"
expect_contains "plan" "measured step time per stage (ms): 1.000 1.000 4.000 4.000" "$out"

scenario "--boundary_bytes replaces the width estimate"
run --budget 4000 --boundary_bytes 100,300,100
expect_rc 0
expect_contains "plan" "step_log { logged_boundaries: [1, 3] }" "$out"

scenario "a wrong count or a bad number is a usage error naming the flag"
for bad in "1,1,4" "1,1,4,4,4" "1,x,4,4" "1,0,4,4" "1,-1,4,4" "1,nan,4,4" "1,inf,4,4" "1,,4,4"; do
  run --budget 5120 --stage_ms "$bad"
  expect_rc 64
  expect_contains "stderr of --stage_ms $bad" "--stage_ms" "$err"
  [ -z "$out" ] || fail "--stage_ms $bad printed a plan: $out"
done
for bad in "100,100" "100,0,100" "100,1.5,100"; do
  run --budget 5120 --boundary_bytes "$bad"
  expect_rc 64
  expect_contains "stderr of --boundary_bytes $bad" "--boundary_bytes" "$err"
done

scenario "a missing or negative budget is a usage error"
run
expect_rc 64
expect_contains "stderr" "--budget N" "$err"
run --budget -1
expect_rc 64

finish reboundctl_plan_logging_test
