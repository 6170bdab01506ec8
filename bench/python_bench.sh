#!/usr/bin/env bash
# The Bazel entry point of the Python benchmarks (//bench:python_overhead, //bench:peer_torch,
# //bench:backup_overhead),
# so that tools/bench.sh runs them like the C++ ones: Debian's /usr/bin/python3 on the script in
# this binary's runfiles, with the client's sources and generated stubs on PYTHONPATH and the
# -c opt binaries of the same build (rebound_server, rebound_train). Extra arguments go to the
# script.
set -euo pipefail
name="$(basename "$0")"
runfiles="${RUNFILES_DIR:-$0.runfiles}/rebound"
[ -d "$runfiles" ] || { echo "$name: no runfiles at $runfiles" >&2; exit 2; }
export PYTHONPATH="$runfiles/python${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
case "$name" in
  python_overhead)
    exec /usr/bin/python3 "$runfiles/bench/python_overhead.py" \
      --rebound-server "$runfiles/server/rebound_server" \
      --example "$runfiles/examples/torch/fashion_mnist_cnn.py" "$@" ;;
  backup_overhead)
    exec /usr/bin/python3 "$runfiles/bench/backup_overhead.py" \
      --rebound-server "$runfiles/server/rebound_server" \
      --rebound-worker "$runfiles/worker/rebound_worker" \
      --reboundctl "$runfiles/tools/reboundctl" "$@" ;;
  peer_torch)
    exec /usr/bin/python3 "$runfiles/bench/peer_torch.py" \
      --rebound-train "$runfiles/worker/rebound_train" \
      --config "$runfiles/configs/train.pbtxt" "$@" ;;
  *) echo "python_bench.sh: unknown benchmark '$name'" >&2; exit 2 ;;
esac
