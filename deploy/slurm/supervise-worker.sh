#!/bin/bash
# Runs one rebound_worker (or a Python worker's script, REBOUND_PYTHON_SCRIPT: rebound.torch.run
# exits with the same codes) for rebound.sbatch and runs it again when it exits 3 (fenced: declared
# failed, or a spare or evaluator after a server restart), 4 (no server for give_up_after_ms) or
# is killed by a signal (e.g. out of memory): the new process registers as a new worker
# (docs/operations.md, "Worker exit codes"), as a Kubernetes restartPolicy would do; a trainer
# whose slot went to a spare meanwhile rejoins as a spare (--role=auto). Any other exit (0 done,
# 1 failed work, 2 bad config, 5 refused) ends it with that status.
#
#   supervise-worker.sh WORKER_COMMAND... FLAGS...
#
# REBOUND_WORKER_RESTARTS (default 10) bounds the restarts. SIGTERM and SIGINT go to the worker,
# which deregisters and exits 0; nothing is restarted after them.
set -u

restarts=${REBOUND_WORKER_RESTARTS:-10}
child=
stopping=0
# shellcheck disable=SC2317  # invoked by the trap
stop() {
  stopping=1
  if [[ -n $child ]]; then kill -TERM "$child" 2> /dev/null; fi
}
trap stop TERM INT

n=0
while :; do
  "$@" &
  child=$!
  if (( stopping )); then kill -TERM "$child" 2> /dev/null; fi
  # A signal interrupts `wait`; wait again until the worker has exited, then take its status.
  while kill -0 "$child" 2> /dev/null; do wait "$child"; done
  wait "$child"
  rc=$?
  if (( stopping )) || { (( rc != 3 && rc != 4 && rc <= 128 )); }; then exit "$rc"; fi
  if (( n >= restarts )); then
    echo "supervise-worker.sh: the worker exited $rc; $restarts restarts done, giving up" >&2
    exit "$rc"
  fi
  n=$((n + 1))
  echo "supervise-worker.sh: the worker exited $rc; starting it again ($n of $restarts)" >&2
  sleep 1
done
