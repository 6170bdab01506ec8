#!/usr/bin/env bash
# The Python client's demo (docs/python.md): the C++ rebound_server with 4 Python trainers, a
# Python spare and a Python evaluator on loopback, training the example CNN
# (examples/torch/fashion_mnist_cnn.py: two convolutions, Adam) on Fashion-MNIST under
# configs/torch_job.pbtxt; trainer (1,0) is SIGKILLed on the way, and the spare rebuilds its
# slot by replaying the logged steps from its snapshot, each step checked against the trainer's
# checksum, and takes the slot over. Prints the final test accuracy, the wall time and the
# recovery's outcome, and draws the same plot as tools/demo.sh (tools/plot_progress.sh).
#
#   tools/demo_torch.sh [extra rebound_launch flags]
#
# Writes to $DEMO_OUT (default /tmp/rebound-demo-torch): work/ (every process's log),
# launch.log, progress.csv and progress.png. Exits non-zero when the job failed, the recovery
# was not a verified replay, or the final accuracy is below 90%.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"

tools/setup.sh
bazel build -c opt //server:rebound_server //tools:reboundctl //tools/launch:rebound_launch

out=${DEMO_OUT:-/tmp/rebound-demo-torch}
rm -rf "$out"
mkdir -p "$out"
export PYTHONPATH="$root/python:$root/python/_gen${PYTHONPATH:+:$PYTHONPATH}"
echo "== training configs/torch_job.pbtxt with Python workers; trainer (1,0) is killed at step 600;" \
  "logs in $out/work"
start=$(date +%s.%N)
rc=0
bazel-bin/tools/launch/rebound_launch --job configs/torch_job.pbtxt --workdir "$out/work" \
  --server_binary bazel-bin/server/rebound_server \
  --worker_command "/usr/bin/python3 $root/examples/torch/fashion_mnist_cnn.py" \
  --kill_trainer_at_step 600 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
  --export "$out/model.safetensors" --timeout_s 1500 "$@" 2>&1 | tee "$out/launch.log" || rc=$?
wall=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
if [ -s "$out/progress.csv" ]; then
  if tools/plot_progress.sh "$out/progress.csv" "$out/progress.png"; then
    echo "== plot of accuracy and weights, failure and recovery marked: $out/progress.png"
  else
    echo "== no plot: tools/plot_progress.sh failed (see above)" >&2
    [ "$rc" -ne 0 ] || rc=1
  fi
fi
accuracy=$(grep -o 'final test accuracy [0-9.]*' "$out/launch.log" | tail -1 | awk '{print $4}')
recovery=$(grep -o 'recovery [0-9]* of slot [^:]*: RECOVERED.*verified yes' "$out/launch.log" | tail -1 || true)
echo "== wall time ${wall} s; final test accuracy ${accuracy:-none}"
if [ -s "$out/model.safetensors" ]; then
  echo "== the trained model: $out/model.safetensors; the CNN's own names, so in Python:"
  echo "   net = Net(); net.load_state_dict(rebound.torch.load_safetensors(\"$out/model.safetensors\"))"
  echo "   (Net from examples/torch/fashion_mnist_cnn.py; docs/python.md#the-trained-model)"
fi
if [ -n "$recovery" ]; then
  echo "== the killed trainer was rebuilt by verified replay: $recovery"
else
  echo "== no verified replay in $out/launch.log" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
if [ -z "$accuracy" ] || awk -v a="$accuracy" 'BEGIN { exit !(a < 0.90) }'; then
  echo "== the final accuracy ${accuracy:-none} is below 90%" >&2
  [ "$rc" -ne 0 ] || rc=1
fi
exit "$rc"
