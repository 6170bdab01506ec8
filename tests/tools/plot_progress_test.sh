#!/usr/bin/env bash
# Specification of tools/plot_progress.sh: a progress CSV (rebound_launch --progress_csv) becomes
# a 1200x900 PNG whose summary names every slot, accuracy point and marked event; a missing or
# malformed CSV is refused with a message naming the file, line and column, and no PNG.
#
# Runs under `bazel test //tests/tools:plot_progress_test`, or from the repository root as
# `tests/tools/plot_progress_test.sh`.
set -uo pipefail

script=${TEST_SRCDIR:+$TEST_SRCDIR/${TEST_WORKSPACE:-rebound}/}tools/plot_progress.sh
dir=$(mktemp -d "${TEST_TMPDIR:-/tmp}/plot_progress_test.XXXXXX")
trap 'rm -rf "$dir"' EXIT

if ! command -v gnuplot >/dev/null 2>&1; then
  echo "FAIL: gnuplot is not installed: run tools/setup.sh (it installs Debian's gnuplot-nox)"
  exit 1
fi

testlib=${TEST_SRCDIR:+$TEST_SRCDIR/${TEST_WORKSPACE:-rebound}/}tests/tools/testlib.sh
# shellcheck source=tests/tools/testlib.sh
source "$testlib" || { echo "FAIL: cannot read $testlib"; exit 1; }

# Runs the script; sets rc, out (stdout) and err (stderr).
plot() {
  "$script" "$@" >"$dir/out" 2>"$dir/err"
  rc=$?
  out=$(cat "$dir/out")
  err=$(cat "$dir/err")
}

# Checks that $1 is a PNG of the given width and height: signature, IHDR first, real size.
expect_png() {  # file, width, height
  local file=$1
  if [ ! -f "$file" ]; then
    fail "no file at $file"
    return
  fi
  expect_eq "PNG signature of $file" "89504e470d0a1a0a" \
    "$(od -An -tx1 -N8 "$file" | tr -d ' \n')"
  expect_eq "first chunk of $file" "IHDR" "$(head -c 16 "$file" | tail -c 4)"
  local w h size
  read -r w h < <(od -An -tu1 -j16 -N8 "$file" |
    awk '{ print (($1 * 256 + $2) * 256 + $3) * 256 + $4,
                 (($5 * 256 + $6) * 256 + $7) * 256 + $8 }')
  expect_eq "width of $file" "$2" "$w"
  expect_eq "height of $file" "$3" "$h"
  size=$(stat -c %s "$file")
  # Axes, tics, labels and legend in antialiased text are tens of kilobytes; an empty canvas of
  # this size compresses to about one.
  [ "$size" -gt 10000 ] || fail "$file is only $size bytes: nothing drawn?"
}

readonly kHeader="elapsed_s,slot,step,loss,weight,test_accuracy,event"

scenario "a run with a kill, a failure and a recovery becomes a 1200x900 PNG with all three marked"
cat >"$dir/run.csv" <<EOF
$kHeader
0.2,r0s0,0,,1,,"worker trainer-r0s0 registered: TRAINER of slot (0,0), incarnation 11"
0.3,r1s0,0,,1,,"worker trainer-r1s0 registered: TRAINER of slot (1,0), incarnation 12"
0.4,r0s1,0,,1,,"worker trainer-r0s1 registered: TRAINER of slot (0,1), incarnation 13"
1.0,r0s0,10,0.9,1,,
1.0,r1s0,9,0.95,1,,
1.0,r0s1,8,0.97,1,,
2.0,r0s0,40,0.7,0.9,0.61,
2.0,r1s0,38,0.72,1,0.61,
2.0,r0s1,35,0.8,0.95,0.61,
3.0,r1s0,60,0.6,1,,killed trainer-r1s0 (pid 4242) at step 60; the server held 5 logged step(s) past its snapshot
4.0,r1s0,60,0.6,1,,"trainer-r1s0 (pid 4242) exited: killed by SIGKILL, as the launcher killed it"
5.0,r1s0,60,0.6,0.05,,worker trainer-r1s0 (incarnation 12): ALIVE -> FAILED: no heartbeat for 3010 ms (failure_timeout 3000 ms)
5.0,,,,,,"worker spare-0 (incarnation 14): ALIVE -> REPLACED: took over slot (1, 0)
as incarnation 15, after a ""quoted"" remark"
6.0,r1s0,62,0.6,0.05,,"recovery 1 of slot (1,0): RECOVERED, policy REPLAY, failed at step 60, 5 steps replayed by [spare-0], verified yes"
6.0,r0s0,120,0.5,1,0.74,
6.0,r1s0,62,0.6,0.05,0.74,
6.0,r0s1,110,0.55,0.9,0.74,
EOF
plot "$dir/run.csv" "$dir/run.png"
expect_eq "exit status" 0 "$rc"
expect_eq "summary" "plot_progress: wrote $dir/run.png (1200x900): 3 slot(s), \
2 accuracy point(s), 3 event(s): trainer-r1s0 killed at 3.0 s; trainer-r1s0 FAILED at 5.0 s; \
slot r1s0 RECOVERED at 6.0 s" "$out"
expect_png "$dir/run.png" 1200 900

scenario "a run before its first evaluation, without events, still gives a PNG"
cat >"$dir/early.csv" <<EOF
$kHeader
1.1,r0s0,0,,1,,
1.1,r1s0,0,,1,,
2.1,r0s0,15,0.638,1,,
2.1,r1s0,3,0.7,0.73,,
EOF
plot "$dir/early.csv" "$dir/early.png"
expect_eq "exit status" 0 "$rc"
expect_eq "summary" "plot_progress: wrote $dir/early.png (1200x900): 2 slot(s), \
0 accuracy point(s), 0 event(s)" "$out"
expect_png "$dir/early.png" 1200 900

scenario "a recovery that does not complete is marked with its outcome"
cat >"$dir/abandoned.csv" <<EOF
$kHeader
1.0,r0s0,10,0.9,1,0.5,
2.0,r0s0,20,0.8,1,0.6,killed trainer-r0s0 (pid 1) at step 20
6.0,r0s0,20,0.8,0.05,,"recovery 1 of slot (0,0): ABANDONED, policy REPLAY, failed at step 20, 0 steps replayed by [], verified no: no spare"
EOF
plot "$dir/abandoned.csv" "$dir/abandoned.png"
expect_eq "exit status" 0 "$rc"
expect_eq "summary" "plot_progress: wrote $dir/abandoned.png (1200x900): 1 slot(s), \
2 accuracy point(s), 2 event(s): trainer-r0s0 killed at 2.0 s; \
slot r0s0 recovery ABANDONED at 6.0 s" "$out"
expect_png "$dir/abandoned.png" 1200 900

scenario "an audit's AUDIT_MISMATCH and the quarantine that follows are marked"
cat >"$dir/audit.csv" <<EOF
$kHeader
1.0,r2s0,100,0.9,1,0.5,
4.0,r2s0,700,0.7,1,,"AUDIT_MISMATCH of slot (2,0): worker trainer-r2s0 step 650 tensor layer0.weight, window (648, 656]: confirmed: two replays give 891980196c209dc2"
4.1,r2s0,710,0.7,0.3,,worker trainer-r2s0 (incarnation 9): ALIVE -> QUARANTINED: audit: step 650 does not replay to what it logged
5.0,r2s0,710,0.7,1,0.6,"recovery 2 of slot (2,0): RECOVERED, policy RESTART_FROM_CENTER, failed at step 710, 0 steps replayed by [spare-1], verified no: after a QUARANTINE: spare 'spare-1' restarts the slot from the center"
EOF
plot "$dir/audit.csv" "$dir/audit.png"
expect_eq "exit status" 0 "$rc"
expect_eq "summary" "plot_progress: wrote $dir/audit.png (1200x900): 1 slot(s), \
2 accuracy point(s), 3 event(s): slot r2s0 AUDIT_MISMATCH at 4.0 s; trainer-r2s0 QUARANTINED \
at 4.1 s; slot r2s0 RECOVERED at 5.0 s" "$out"
expect_png "$dir/audit.png" 1200 900

# Each refusal: exit status 1, the message on stderr, and no PNG.
expect_refusal() {  # csv, message
  rm -f "$dir/refused.png"
  plot "$1" "$dir/refused.png"
  expect_eq "exit status" 1 "$rc"
  expect_eq "stdout" "" "$out"
  expect_eq "stderr" "$2" "$err"
  [ ! -e "$dir/refused.png" ] || fail "a PNG was written for $1"
}

scenario "a missing CSV is refused"
expect_refusal "$dir/absent.csv" "plot_progress: cannot read the progress CSV '$dir/absent.csv'"

scenario "an empty file is refused"
: >"$dir/empty.csv"
expect_refusal "$dir/empty.csv" \
  "plot_progress: $dir/empty.csv is empty: expected the header '$kHeader'"

scenario "a CSV with another header is refused"
printf 'time,accuracy\n1,0.5\n' >"$dir/other.csv"
expect_refusal "$dir/other.csv" \
  "plot_progress: $dir/other.csv:1: not a progress CSV: expected the header '$kHeader', \
got 'time,accuracy'"

scenario "a header without rows is refused"
echo "$kHeader" >"$dir/header_only.csv"
expect_refusal "$dir/header_only.csv" \
  "plot_progress: $dir/header_only.csv:1: no rows after the header: nothing to plot"

scenario "a row with too few columns is refused with its line"
printf '%s\n1.0,r0s0,1,0.5,1,,\n2.0,r0s0,2\n' "$kHeader" >"$dir/short.csv"
expect_refusal "$dir/short.csv" \
  "plot_progress: $dir/short.csv:3: expected 7 columns ($kHeader), got 3"

scenario "a weight that is not a number is refused with its line and value"
printf '%s\n1.0,r0s0,1,0.5,1,,\n2.0,r0s0,2,0.4,heavy,,\n' "$kHeader" >"$dir/weight.csv"
expect_refusal "$dir/weight.csv" "plot_progress: $dir/weight.csv:3: weight is not a number: 'heavy'"

scenario "an accuracy that is not a number is refused with its line and value"
printf '%s\n1.0,r0s0,1,0.5,1,88%%,\n' "$kHeader" >"$dir/accuracy.csv"
expect_refusal "$dir/accuracy.csv" \
  "plot_progress: $dir/accuracy.csv:2: test_accuracy is not a number: '88%'"

scenario "an event whose quote never closes is refused with the line it starts on"
printf '%s\n1.0,r0s0,1,0.5,1,,\n2.0,r0s0,2,0.4,1,,"killed trainer-r0s0\n' "$kHeader" \
  >"$dir/quote.csv"
expect_refusal "$dir/quote.csv" \
  "plot_progress: $dir/quote.csv:3: unterminated quoted event at the end of the file"

scenario "a wrong number of arguments prints the usage and exits 64"
plot "$dir/run.csv"
expect_eq "exit status" 64 "$rc"
expect_eq "stderr" "usage: tools/plot_progress.sh PROGRESS_CSV OUTPUT_PNG" "$err"

finish plot_progress_test
