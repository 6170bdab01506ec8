#!/usr/bin/env bash
# The main job, locally: trains the shipped Fashion-MNIST job (configs/job.pbtxt: 4 trainers,
# a spare and an evaluator on loopback, EASGD with AdaHessian and dynamic reliability weights),
# SIGKILLs a trainer on the way, and shows the server detect the failure and fence the dead
# incarnation, the spare replay the lost steps from the slot's snapshot and step log (every step
# checked against the logged checksum) and take the slot over; prints the final test accuracy
# and plots test accuracy and reliability weights over time, with the kill, the failure and the
# recovery marked (tools/plot_progress.sh). About two minutes on 2 cores after the build.
#
#   tools/demo.sh [--ha] [--sharded K] [--corrupt] [extra rebound_launch flags]
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
#
# --sharded K (2 to 64; 1 is the default demo): the same job with its center sharded across K server groups
# (docs/operations.md, "Sharding"): K rebound_servers, each holding one range of the center; the
# trainers sync every range in parallel, and the trainer is killed and rebuilt as in the default
# demo. Prints each group and the ranges at the start and each group's center version at the end
# (equal: every sync reached every range once). With --ha as well, each group is a leader and a
# standby, and group 0's leader is killed. Writes to $DEMO_OUT (default /tmp/rebound-demo-sharded,
# or /tmp/rebound-demo-ha-sharded with --ha), the launcher's output also to launch.log there.
#
# --corrupt: audit replay (docs/recovery.md#audits). Besides the kill, trainer (2,0) silently
# computes wrong: from step 600 it flips one bit of one parameter every 50 steps (no crash, no NaN);
# the job is audited (a quarter of every trainer's sync windows replayed by idle spares, one spare
# more). An audit catches it, a second replay confirms it, the trainer is QUARANTINED and its slot
# restarted from the center: the AUDIT_MISMATCH and the quarantine are on the plot, and the audits
# are printed at the end (reboundctl audits' counts). Writes to $DEMO_OUT (default
# /tmp/rebound-demo-corrupt).
set -euo pipefail
cd "$(dirname "$0")/.."

ha=0
shards=1
corrupt=0
args=()
while [ $# -gt 0 ]; do
  case $1 in
    --ha) ha=1 ;;
    --corrupt) corrupt=1 ;;
    --sharded=*) shards=${1#--sharded=} ;;
    --sharded)
      if [ $# -lt 2 ]; then
        echo "tools/demo.sh: --sharded needs a number of groups, 1 to 64" >&2
        exit 2
      fi
      shards=$2
      shift
      ;;
    *) args+=("$1") ;;
  esac
  shift
done
if ! [[ $shards =~ ^[0-9]+$ ]] || ((10#$shards < 1 || 10#$shards > 64)); then
  echo "tools/demo.sh: --sharded takes a number of groups, 1 to 64 (1: not sharded); got" \
    "'$shards'" >&2
  exit 2
fi
shards=$((10#$shards))
set -- "${args[@]+"${args[@]}"}"

tools/setup.sh
bazel build -c opt //server:rebound_server //worker:rebound_worker //tools:reboundctl \
  //tools/launch:rebound_launch

suffix=
if [ "$ha" -eq 1 ]; then suffix=-ha; fi
shard_flags=()
if [ "$shards" -gt 1 ]; then
  suffix=$suffix-sharded
  shard_flags=(--shard_groups "$shards")
fi
corrupt_flags=()
if [ "$corrupt" -eq 1 ]; then
  suffix=$suffix-corrupt
  corrupt_flags=(--corrupt_trainer_at_step 600 --corrupt_slot 2,0 --corrupt_every 50)
fi
out=${DEMO_OUT:-/tmp/rebound-demo$suffix}
rm -rf "$out"
mkdir -p "$out"
where="a server"
if [ "$shards" -gt 1 ]; then where="$shards server groups, each holding a range of the center"; fi
# The trained model, written when the job finishes (a sharded center too: group 0 joins its ranges).
export_flags=(--export "$out/model.safetensors")
if [ "$ha" -eq 1 ]; then
  max_steps=$(awk '/^[[:space:]]*max_steps:/ {print $2; exit}' configs/job.pbtxt)
  leader_step=$(( ${max_steps:-1000} / 2 ))
  leader="the leader"
  if [ "$shards" -gt 1 ]; then
    where="$shards server groups (each a leader and a standby, one range of the center each)"
    leader="group 0's leader"
  else
    where="a server group (a leader, a standby)"
  fi
  echo "== training configs/job.pbtxt on $where, 3 etcd members;" \
    "trainer (1,0) is killed at step 1000, $leader at mean step $leader_step; logs in $out/work"
  rc=0
  bazel-bin/tools/launch/rebound_launch --job configs/job.pbtxt --workdir "$out/work" \
    --kill_trainer_at_step 1000 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
    --standbys 1 --kill_leader_at_step "$leader_step" "${shard_flags[@]+"${shard_flags[@]}"}" \
    "${corrupt_flags[@]+"${corrupt_flags[@]}"}" \
    "${export_flags[@]+"${export_flags[@]}"}" --timeout_s 900 "$@" | tee "$out/launch.log" || rc=$?
else
  echo "== training configs/job.pbtxt on $where; trainer (1,0) is killed at step 1000;" \
    "logs in $out/work"
  if [ "$corrupt" -eq 1 ]; then
    echo "== trainer (2,0) flips a bit every 50 steps from step 600; a quarter of every" \
      "trainer's sync windows are audited by idle spares"
  fi
  rc=0
  bazel-bin/tools/launch/rebound_launch --job configs/job.pbtxt --workdir "$out/work" \
    --kill_trainer_at_step 1000 --kill_slot 1,0 --progress_csv "$out/progress.csv" \
    "${shard_flags[@]+"${shard_flags[@]}"}" "${corrupt_flags[@]+"${corrupt_flags[@]}"}" \
    "${export_flags[@]+"${export_flags[@]}"}" \
    --timeout_s 900 "$@" | tee "$out/launch.log" || rc=$?
fi
echo "== progress table: $out/progress.csv"
if [ "${#export_flags[@]}" -gt 0 ] && [ -s "$out/model.safetensors" ]; then
  echo "== the trained model: $out/model.safetensors (safetensors; layer<l>.weight, layer<l>.bias);" \
    "load it in Python with:"
  echo "   /usr/bin/python3 -c 'import rebound.torch as rt; m = rt.load_safetensors(\"$out/model.safetensors\"); print({k: tuple(v.shape) for k, v in m.items()})'"
fi
if [ -s "$out/progress.csv" ]; then
  if tools/plot_progress.sh "$out/progress.csv" "$out/progress.png"; then
    echo "== plot of accuracy and weights, failure and recovery marked: $out/progress.png"
  else
    echo "== no plot: tools/plot_progress.sh failed (see above)" >&2
    [ "$rc" -ne 0 ] || rc=1
  fi
fi
member='(g0-)?server-[0-9]+'
if [ "$ha" -eq 1 ]; then
  echo "== the server group's failover (the launcher's lines; all of it in $out/launch.log):"
  grep -E "\\] (leader $member .*SIGKILLed|group: $member leads|failover: |started $member again|group: $member is back in sync|failover summary: )" \
    "$out/launch.log" | sed 's/^/   /' || echo "   (none: the leader was not killed; see above)"
fi
if [ "$corrupt" -eq 1 ]; then
  echo "== audits (the launcher's lines; all of it in $out/launch.log):"
  grep -E "\] (AUDIT_MISMATCH|audit disagreement|audit inconclusive) |-> QUARANTINED|after a QUARANTINE" \
    "$out/launch.log" | sed 's/^/   /' || echo "   (none: no corruption was caught; see above)"
fi
if [ "$shards" -gt 1 ]; then
  echo "== the shard groups: their ranges, and each group's center version at the end (equal:" \
    "every sync reached every range once; all of it in $out/launch.log):"
  # The line and its continuation lines (indented): one per stage, then the workers' address.
  awk '/\] center sharded across /{p = 1; print; next} p && /^ /{print; next} {p = 0}' \
    "$out/launch.log" | sed 's/^/   /'
  grep -E '\] shard group [0-9]+ \(.*\): ' "$out/launch.log" | sed 's/^/   /' ||
    echo "   (none: the job did not get that far; see above)"
fi
exit "$rc"
