#!/usr/bin/env bash
# Bazel's --workspace_status_command for stamped builds (`bazel build --config=release`, .bazelrc):
# prints the git commit of this checkout as STABLE_REBOUND_COMMIT, which //common:version bakes
# into every binary's `--version`. The Python package (python/rebound/__init__.py) runs this same
# script at `python3 -m rebound --version`, so both say the commit the same way:
#   <12 hex digits>          a clean checkout
#   <12 hex digits>-dirty    tracked files differ from that commit
#   unknown                  not a git checkout (or no git)
cd "$(dirname "$0")/.." || exit 1
commit="$(git rev-parse --short=12 HEAD 2>/dev/null)" || commit=""
if [ -z "$commit" ]; then
  commit=unknown
elif ! git diff --quiet HEAD -- 2>/dev/null; then
  commit="$commit-dirty"
fi
echo "STABLE_REBOUND_COMMIT $commit"
