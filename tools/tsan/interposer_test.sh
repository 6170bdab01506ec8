#!/usr/bin/env bash
# Proves the tsan build's two halves (docs/thread_safety.md):
#  * each hand-off through an absl primitive is seen with the interposer (no report, exit 0)
#    and reported as a race without it (REBOUND_TSAN_INTERPOSER=off: exit 66), so the
#    interposer is what makes the guarded accesses safe in TSan's eyes;
#  * a real race is still reported (exit 66 and TSan's warning).
set -uo pipefail
dir="$(dirname "$0")"
guarded="$dir/guarded_handoffs"
racy="$dir/racy_counter"
failures=0
out="${TEST_TMPDIR:-/tmp}/tsan.out"

expect() {  # expect <exit code> <description> <command...>
  local want="$1" what="$2"
  shift 2
  "$@" >"$out" 2>&1
  local got=$?
  if [ "$got" -ne "$want" ]; then
    echo "FAIL $what: exit $got, want $want"
    cat "$out"
    failures=$((failures + 1))
    return
  fi
  if [ "$want" -eq 66 ] && ! grep -q 'WARNING: ThreadSanitizer: data race' "$out"; then
    echo "FAIL $what: exit 66 without TSan's data race report"
    cat "$out"
    failures=$((failures + 1))
    return
  fi
  echo "ok   $what"
}

for c in mutex reader_lock try_lock condvar await await_condition notification blocking_counter; do
  expect 0 "$c: hand-off seen with the interposer" env -u TSAN_OPTIONS "$guarded" "$c"
  expect 66 "$c: reported without the interposer" \
    env -u TSAN_OPTIONS REBOUND_TSAN_INTERPOSER=off "$guarded" "$c"
done
# Without the interposer nothing is annotated, so this one is silent either way.
expect 0 "library_published_mutex: the mutex word is not checked on lock" \
  env -u TSAN_OPTIONS "$guarded" library_published_mutex
expect 66 "an unguarded counter is reported" env -u TSAN_OPTIONS "$racy"

if [ "$failures" -ne 0 ]; then
  echo "$failures failed"
  exit 1
fi
echo "all passed"
