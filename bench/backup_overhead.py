#!/usr/bin/python3
"""backup_overhead: training throughput while online backups run, against the same job without,
and what an export of the trained model costs (docs/operations.md#backup-and-restore).

    bench/backup_overhead.py [--seconds 10] [--reps 3] [--backup-max-mb-s R] [--nice N]
        [--rebound-server PATH] [--rebound-worker PATH] [--reboundctl PATH]

Prints
  RESULT backup_overhead: with_backup_samples_s=... without_samples_s=... ratio=...
      backup_s=... backup_bytes=... backup_max_mb_s=...
  RESULT export: export_s=... export_bytes=... tensors=...
(target: ratio >= 0.9). The backups are paced at --backup-max-mb-s (default 4 MB/s; 0 runs them
unpaced, as fast as the server sends). One rebound_server (durable, on 127.0.0.1 port 0, started by
rebound.cluster.LocalServer) serves the shipped model of configs/job.pbtxt (784-256-128-10 MLP,
batch 64) to two rebound_worker trainers; max_steps is far beyond the run. The samples per second
are the trainers' steps (GetStatus, summed over the slots) x batch size over a window of
--seconds; windows without and with backups alternate --reps times, and the figures are the
medians, the ratio the median of the paired ratios with / without. In a "with" window
`reboundctl backup` runs back to back into fresh directories (each removed after); backup_s and
backup_bytes are the medians over those backups. The export is `reboundctl export` of the
center at the end. Exit codes: 0 measured, 1 a step failed (its output is printed), 2 bad
arguments. Everything started here is killed at the end.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from rebound.cluster import LocalServer

BATCH = 64
JOB = """
job_id: "backup-overhead"
model { input_dim: 784 layers { width: 256 activation: RELU }
        layers { width: 128 activation: RELU } layers { width: 10 activation: IDENTITY }
        init_seed: 1 }
topology { replicas: 2 stages: 1 }
data { batch_size: %d micro_batches: 4 seed: 42 }
adahessian { lr: 0.06 }
easgd { sync_period: 8 }
training { max_steps: 100000000 }
""" % BATCH


def samples(server):
    return sum(slot.step for slot in server.status().slots) * BATCH


def window(server, seconds, during=None):
    """Samples per second over `seconds`; `during()` is called in a loop meanwhile."""
    start_samples, start = samples(server), time.monotonic()
    while time.monotonic() - start < seconds:
        if during is not None:
            during()
        else:
            time.sleep(0.05)
    return (samples(server) - start_samples) / (time.monotonic() - start)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rebound-server", default="bazel-bin/server/rebound_server")
    parser.add_argument("--rebound-worker", default="bazel-bin/worker/rebound_worker")
    parser.add_argument("--reboundctl", default="bazel-bin/tools/reboundctl")
    parser.add_argument("--nice", type=int, default=0,
                        help="run reboundctl at this niceness (a client on another host: 19)")
    parser.add_argument("--backup-max-mb-s", type=float, default=4.0,
                        help="reboundctl backup --backup_max_mb_s: the server paces its stream "
                             "(0: unpaced)")
    args = parser.parse_args()
    if args.seconds <= 0 or args.reps < 1:
        print("backup_overhead: --seconds > 0 and --reps >= 1", file=sys.stderr)
        return 2
    nice = ["nice", "-n", str(args.nice)] if args.nice else []
    scratch = tempfile.mkdtemp(prefix="backup-overhead-")
    backups = []  # (seconds, bytes)
    try:
        with LocalServer(args.rebound_server, JOB) as server:
            config = os.path.join(scratch, "worker.pbtxt")
            with open(config, "w") as f:
                f.write('server_address: "%s"\npeer_listen_address: "127.0.0.1:0"\n'
                        'rpc_deadline_ms: 10000\n' % server.address)
            for i in range(2):
                server.start_worker([args.rebound_worker, "--config", config, "--role", "trainer",
                                     "--name", "trainer-%d" % i])
            server.wait_for(lambda s: len(s.slots) == 2 and all(x.step > 50 for x in s.slots),
                            120, what="both trainers training")

            def backup():
                target = os.path.join(scratch, "backup-%d" % len(backups))
                begin = time.monotonic()
                done = subprocess.run(nice + [args.reboundctl, "--server", server.address,
                                              "--output", "json", "--backup_max_mb_s",
                                              str(args.backup_max_mb_s), "backup", target],
                                      capture_output=True, text=True, timeout=600)
                if done.returncode != 0:
                    raise RuntimeError("reboundctl backup failed: " + done.stderr)
                size = int(re.search(r'"bytes": (\d+)', done.stdout).group(1))
                backups.append((time.monotonic() - begin, size))
                shutil.rmtree(target)

            without, with_backup, ratios = [], [], []
            for _ in range(args.reps):
                w = window(server, args.seconds)
                b = window(server, args.seconds, during=backup)
                without.append(w)
                with_backup.append(b)
                ratios.append(b / w)
                print("rep: without %.0f samples/s, with %.0f samples/s (%d backups so far)"
                      % (w, b, len(backups)), flush=True)
            model = os.path.join(scratch, "model.safetensors")
            begin = time.monotonic()
            done = subprocess.run([args.reboundctl, "--server", server.address, "--output", "json",
                                   "export", "-o", model],
                                  capture_output=True, text=True, timeout=600)
            export_s = time.monotonic() - begin
            if done.returncode != 0:
                raise RuntimeError("reboundctl export failed: " + done.stderr)
            tensors = int(re.search(r'"tensors": (\d+)', done.stdout).group(1))
            export_bytes = os.path.getsize(model)
    except (RuntimeError, TimeoutError) as error:
        print("backup_overhead: %s" % error, file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print("RESULT backup_overhead: with_backup_samples_s=%.0f without_samples_s=%.0f ratio=%.3f "
          "backup_s=%.3f backup_bytes=%d backup_max_mb_s=%g" % (
              statistics.median(with_backup), statistics.median(without),
              statistics.median(ratios), statistics.median(s for s, _ in backups),
              statistics.median(b for _, b in backups), args.backup_max_mb_s))
    print("RESULT export: export_s=%.3f export_bytes=%d tensors=%d" % (export_s, export_bytes,
                                                                       tensors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
