#!/bin/bash
# Runs one pytest file of tests/python under Debian's /usr/bin/python3 with PYTHONPATH at the
# worktree's python/ directory (in the runfiles of a Bazel sh_test, or the source tree when run
# by hand). Usage: run_pytest.sh <test file> [NAME=relative/or/absolute/path ...]; each NAME=PATH
# is exported with PATH made absolute. Fails (never skips) if pytest or the file is missing.
# `bazel test --test_filter=EXPR` (Bazel's TESTBRIDGE_TEST_ONLY) runs only the cases pytest's
# `-k EXPR` selects, e.g. tools/test.sh's TSan case
#   --test_filter='test_a_killed_trainer_is_rebuilt_by_verified_replay and adahessian';
# a filter that selects nothing fails (pytest exits 5).
set -euo pipefail

# Cases marked `@pytest.mark.full` run only with --full (a twin target of tools/test.sh --full's,
# tagged manual and full: docs/testing.md#tiers); without it, every other case.
marks="not full"
if [[ "${1:-}" == "--full" ]]; then
  marks="full"
  shift
fi
if [[ $# -lt 1 ]]; then
  echo "usage: $0 [--full] <test file> [NAME=PATH ...]" >&2
  exit 2
fi
# The sh_test runs in $TEST_SRCDIR/<workspace>; by hand, run from the repository root.
if [[ -n "${TEST_SRCDIR:-}" && -d "${TEST_SRCDIR}/rebound" ]]; then
  root="${TEST_SRCDIR}/rebound"
else
  root="$(pwd)"
fi
test_file="$1"
shift
[[ "${test_file}" = /* ]] || test_file="${root}/${test_file}"
for assignment in "$@"; do
  name="${assignment%%=*}"
  value="${assignment#*=}"
  [[ "${value}" = /* ]] || value="${root}/${value}"
  export "${name}=${value}"
done
if [[ ! -d "${root}/python/rebound" ]]; then
  echo "run_pytest.sh: ${root}/python/rebound not found" >&2
  exit 1
fi
if ! /usr/bin/python3 -c "import pytest" 2>/dev/null; then
  echo "run_pytest.sh: pytest is missing (apt-get install python3-pytest)" >&2
  exit 1
fi
export PYTHONPATH="${root}/python${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONDONTWRITEBYTECODE=1
export OMP_NUM_THREADS=1
cd "${TEST_TMPDIR:-${TMPDIR:-/tmp}}"
pick=()
if [[ -n "${TESTBRIDGE_TEST_ONLY:-}" ]]; then
  pick=(-k "${TESTBRIDGE_TEST_ONLY}")
fi
exec /usr/bin/python3 -m pytest -q -p no:cacheprovider \
  -o "markers=full: runs only in tools/test.sh --full" -m "${marks}" "${pick[@]}" "${test_file}"
