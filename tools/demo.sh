#!/usr/bin/env bash
# The main job, locally: trains the shipped Fashion-MNIST job (configs/job.pbtxt: 4 trainers,
# a spare and an evaluator on loopback, EASGD with AdaHessian and dynamic reliability weights),
# SIGKILLs a trainer on the way, and shows the server detect the failure and fence the dead
# incarnation, the spare replay the lost steps from the slot's snapshot and step log (every step
# checked against the logged checksum) and take the slot over; prints the final test accuracy
# and plots test accuracy and reliability weights over time, with the kill, the failure and the
# recovery marked (tools/plot_progress.sh). About two minutes on 2 cores after the build.
#
#   tools/demo.sh [--ha] [extra rebound_launch flags]
#
# Writes to $DEMO_OUT (default /tmp/rebound-demo): work/ (every process's log), progress.csv and
# progress.png. Exits with rebound_launch's status; the plot is drawn even when the job failed.
#
# --ha: the same job on a replicated server group (docs/operations.md, "High availability"):
# 3 etcd members and 2 rebound_server members, a leader and a synchronous standby. Besides the
# trainer, the leader is SIGKILLed once the mean trainer step reaches half of the job's
# training.max_steps; the standby takes over and the trainers go on with it; the killed member
# is started again on its data dir and rejoins as a standby. Prints the failover (from the kill
# to the first sync the new leader acknowledged) at the end. Writes to $DEMO_OUT (default
# /tmp/rebound-demo-ha), the launcher's output also to launch.log there.
set -euo pipefail
cd "$(dirname "$0")/.."

ha=0
args=()
for arg in "$@"; do
  if [ "$arg" = --ha ]; then ha=1; else args+=("$arg"); fi
done
set -- "${args[@]+"${args[@]}"}"

tools/setup.sh
bazel build -c opt //server:rebound_server //worker:rebound_worker //tools:reboundctl \
  //tools/launch:rebound_launch

if [ "$ha" -eq 1 ]; then
  out=${DEMO_OUT:-/tmp/rebound-demo-ha}
else
  out=${DEMO_OUT:-/tmp/rebound-demo}
fi
rm -rf "$out"
mkdir -p "$out"
if [ "$ha" -eq 1 ]; then
  max_steps=$(awk '/^[[:space:]]*max_steps:/ {print $2; exit}' configs/job.pbtxt)
  leader_step=$(( ${max_steps:-1000} / 2 ))
  echo "== training configs/job.pbtxt on a server group (a leader, a standby, 3 etcd members);" \
    "trainer (1,0) is killed at step 1000, the leader at mean step $leader_step; logs in $out/work"
  rc=0
  bazel-bin/tools/launch/rebound_launch --job configs/job.pbtxt --workdir "$out/work" \
    --kill_trainer_at_step 1000 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
    --standbys 1 --kill_leader_at_step "$leader_step" \
    --timeout_s 900 "$@" | tee "$out/launch.log" || rc=$?
else
  echo "== training configs/job.pbtxt; trainer (1,0) is killed at step 1000; logs in $out/work"
  rc=0
  bazel-bin/tools/launch/rebound_launch --job configs/job.pbtxt --workdir "$out/work" \
    --kill_trainer_at_step 1000 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
    --timeout_s 900 "$@" || rc=$?
fi
echo "== progress table: $out/progress.csv"
if [ -s "$out/progress.csv" ]; then
  if tools/plot_progress.sh "$out/progress.csv" "$out/progress.png"; then
    echo "== plot of accuracy and weights, failure and recovery marked: $out/progress.png"
  else
    echo "== no plot: tools/plot_progress.sh failed (see above)" >&2
    [ "$rc" -ne 0 ] || rc=1
  fi
fi
if [ "$ha" -eq 1 ]; then
  echo "== the server group's failover (the launcher's lines; all of it in $out/launch.log):"
  grep -E '\] (leader server-[0-9]+ .*SIGKILLed|group: server-[0-9]+ leads|failover: |started server-[0-9]+ again|group: server-[0-9]+ is back in sync|failover summary: )' \
    "$out/launch.log" | sed 's/^/   /' || echo "   (none: the leader was not killed; see above)"
fi
exit "$rc"
