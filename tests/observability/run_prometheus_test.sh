#!/bin/bash
# Runs prometheus_test.py under Debian's python3; fails (never skips) when prometheus or promtool
# is missing: tools/setup.sh installs them.
set -euo pipefail
for tool in prometheus promtool; do
  command -v "${tool}" >/dev/null || { echo "${tool} is not installed (tools/setup.sh)" >&2; exit 1; }
done
script="$1"
shift
exec /usr/bin/python3 "${script}" "$@"
