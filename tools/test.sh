#!/usr/bin/env bash
# Installs every dependency (Debian packages) and runs every test of Rebound.
#
#   tools/test.sh [extra bazel test flags]
#
# Tests that need a GPU are tagged "gpu" and only exist in --config=cuda builds; on a CPU-only
# build they are reported here as skipped, never as passed.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh

log=$(mktemp)
trap 'rm -f "$log"' EXIT
rc=0
bazel test //... --test_summary=short "$@" 2>&1 | tee "$log" || rc=$?

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log" || true)
failed=$(grep -cE '^//[^ ]+ +(FAILED|TIMEOUT|NO STATUS|FAILED TO BUILD|INCOMPLETE)' "$log" || true)
skipped=0
for t in $(bazel query 'attr(tags, "\bgpu\b", tests(//...))' 2>/dev/null); do
  if ! grep -qE "^$t +(\(cached\) )?PASSED" "$log"; then
    echo "SKIPPED $t (needs a GPU and a --config=cuda build)"
    skipped=$((skipped + 1))
  fi
done
echo "rebound tests: $passed passed, $failed failed, $skipped skipped"
if [ "$rc" -ne 0 ] || [ "$failed" -ne 0 ] || [ "$passed" -eq 0 ]; then
  exit 1
fi
