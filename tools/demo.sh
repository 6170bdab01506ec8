#!/usr/bin/env bash
# The main job, locally: builds Rebound, starts a server and two workers on loopback, shows them
# registered and heartbeating, kills one trainer and shows the server declare it failed and fence
# it, then stops everything cleanly.
#
#   tools/demo.sh
#
# Training on Fashion-MNIST and replay recovery join this demo as they land (issues R3, R4, R6).
set -euo pipefail
cd "$(dirname "$0")/.."

tools/setup.sh
bazel build -c opt //server:rebound_server //worker:rebound_worker //tools:reboundctl

bin=bazel-bin
work=$(mktemp -d /tmp/rebound-demo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  sleep 1
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

# The shipped job, without a data directory (nothing is persisted yet).
cp configs/job.pbtxt "$work/job.pbtxt"
cat > "$work/server.pbtxt" <<CONF
listen_address: "127.0.0.1:0"
job_file: "job.pbtxt"
CONF

"$bin/server/rebound_server" --config "$work/server.pbtxt" --port_file "$work/port" \
  > "$work/server.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.1; done
[ -s "$work/port" ] || { echo "server did not start:"; cat "$work/server.log"; exit 1; }
server="127.0.0.1:$(cat "$work/port")"
echo "== server listening on $server: $("$bin/tools/reboundctl" --server "$server" health)"

for name in trainer-a trainer-b spare-c; do
  "$bin/worker/rebound_worker" --config configs/worker.pbtxt --server "$server" --name "$name" \
    > "$work/$name.log" 2>&1 &
  pids+=($!)
done
sleep 2
echo "== three workers registered and heartbeating"
"$bin/tools/reboundctl" --server "$server" status

echo
echo "== SIGKILL trainer-a; the server declares it failed after failure_timeout (3 s)"
kill -KILL "${pids[1]}"
sleep 4
"$bin/tools/reboundctl" --server "$server" status

echo
echo "== stopping: workers deregister, the server shuts down gracefully"
for pid in "${pids[@]:2}"; do kill -TERM "$pid"; done
wait "${pids[@]:2}" || true
kill -TERM "${pids[0]}"
wait "${pids[0]}" || true
pids=()
echo "== server log"
cat "$work/server.log"
