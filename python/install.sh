#!/usr/bin/env bash
# Makes `import rebound`, `import rebound.torch` and `import rebound_pb` work for Debian's
# /usr/bin/python3 (docs/python.md#install): generates the stubs (python/gen_stubs.sh into
# python/_gen) and writes rebound.pth into /usr/local/lib/python3.X/dist-packages, naming this
# checkout's python/ and python/_gen (an editable install: edits to python/rebound take effect
# at once; run this again after a change to proto/). Needs root for the .pth (tools/setup.sh
# runs it with sudo when not root). Nothing comes from PyPI.
#
#   python/install.sh            install
#   python/install.sh --check    only check that the import works
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
py=/usr/bin/python3
if [ "${1:-}" != "--check" ]; then
  "$here/gen_stubs.sh" "$here/_gen"
  site="$("$py" -c 'import site; print(next(p for p in site.getsitepackages() if p.startswith("/usr/local")))')"
  SUDO=""
  if [ "$(id -u)" -ne 0 ] && [ ! -w "$site" ]; then SUDO="sudo"; fi
  $SUDO mkdir -p "$site"
  printf '%s\n%s\n' "$here" "$here/_gen" | $SUDO tee "$site/rebound.pth" > /dev/null
  echo "install: $site/rebound.pth -> $here, $here/_gen"
fi
cd /
"$py" -c 'import rebound.torch, rebound_pb.rebound_pb2; print("install: import rebound.torch works (rebound", rebound.__version__ + ")")'
