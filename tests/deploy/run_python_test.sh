#!/bin/bash
# Runs a Python test of this package (its first argument, a path in the runfiles) with the system
# python3, from the runfiles' workspace root, with tests/deploy on the import path for images.py.
# Bazel 4.2.3's py_test stub wants a `python` on PATH, which Debian 12 does not have.
set -euo pipefail
export PYTHONPATH=tests/deploy${PYTHONPATH:+:$PYTHONPATH}
exec python3 "$@"
