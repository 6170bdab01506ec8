#!/bin/bash
# Runs doc_links_test.py (see BUILD) with the system python3, from the runfiles' workspace root.
set -euo pipefail
exec python3 tests/docs/doc_links_test.py
