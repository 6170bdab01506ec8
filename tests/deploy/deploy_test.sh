#!/bin/bash
# Runs deploy_test.py (see BUILD) with the system python3, from the runfiles' workspace root.
set -euo pipefail
exec python3 tests/deploy/deploy_test.py
