#!/usr/bin/env bash
# The main job, locally: trains the shipped Fashion-MNIST job (configs/job.pbtxt: 4 trainers,
# a spare and an evaluator on loopback, EASGD with AdaHessian and dynamic reliability weights),
# SIGKILLs a trainer on the way, and shows the server detect the failure and fence the dead
# incarnation, the spare replay the lost steps from the slot's snapshot and step log (every step
# checked against the logged checksum) and take the slot over; prints the final test accuracy
# and plots test accuracy and reliability weights over time, with the kill, the failure and the
# recovery marked (tools/plot_progress.sh). About two minutes on 2 cores after the build.
#
#   tools/demo.sh [extra rebound_launch flags]
#
# Writes to $DEMO_OUT (default /tmp/rebound-demo): work/ (every process's log), progress.csv and
# progress.png. Exits with rebound_launch's status; the plot is drawn even when the job failed.
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh
bazel build -c opt //server:rebound_server //worker:rebound_worker //tools:reboundctl \
  //tools/launch:rebound_launch

out=${DEMO_OUT:-/tmp/rebound-demo}
rm -rf "$out"
mkdir -p "$out"
echo "== training configs/job.pbtxt; trainer (1,0) is killed at step 1000; logs in $out/work"
rc=0
bazel-bin/tools/launch/rebound_launch --job configs/job.pbtxt --workdir "$out/work" \
  --kill_trainer_at_step 1000 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
  --timeout_s 900 "$@" || rc=$?
echo "== progress table: $out/progress.csv"
if [ -s "$out/progress.csv" ]; then
  if tools/plot_progress.sh "$out/progress.csv" "$out/progress.png"; then
    echo "== plot of accuracy and weights, failure and recovery marked: $out/progress.png"
  else
    echo "== no plot: tools/plot_progress.sh failed (see above)" >&2
    [ "$rc" -ne 0 ] || rc=1
  fi
fi
exit "$rc"
