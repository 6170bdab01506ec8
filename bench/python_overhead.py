#!/usr/bin/python3
"""python_overhead: the example CNN trained through Rebound vs the same plain PyTorch loop.

    bench/python_overhead.py [--seconds 20] [--reps 3]
        [--rebound-server bazel-bin/server/rebound_server]
        [--example examples/torch/fashion_mnist_cnn.py] [--optimizer NAME] [--plain-only]

Prints `RESULT python_overhead: rebound_samples_s=... plain_samples_s=... ratio=...` (target:
ratio >= 0.90): training samples per second of one process with one torch thread on each side,
measured in the same run in alternating pairs (Rebound then plain, --reps times, --seconds each);
the figures are the medians over the reps, the ratio the median of the paired ratios
rebound / plain. Exit codes: 0 measured, 1 a side failed (its output is printed), 2 bad arguments.

What each side does (also printed before the RESULT line):
  * Rebound: a rebound_server on 127.0.0.1 port 0 started by rebound.cluster.LocalServer (the
    tests' and demos' way), with a job written here (job_text()): the model declared by the worker,
    1 replica, 1 stage, no spare and no evaluator, EASGD with sync_period (tau) 8, step logging
    enabled, max_steps far beyond the run. One trainer process runs the example script
    (`--server 127.0.0.1:PORT --role trainer --max-seconds S`): registration, heartbeats, the
    step log of every step, an EASGD sync every 8 steps; its figure is what it prints at exit,
    `rebound-torch: trained N samples in S s` (N / S, the training loop's own time).
  * Plain: the example's spec (make_spec's fields: same model, optimizer, loss, data, batch size)
    in the example's plain loop (plain_train) inside this process, torch.set_num_threads(1),
    samples / seconds over --seconds of training (batch gather, forward, backward, step).
Everything started here is killed at the end (process groups), also on errors and Ctrl-C.
"""

import argparse
import importlib.util
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))
sys.path.insert(1, os.path.join(REPO, "python", "_gen"))  # the stubs (python/install.sh)

from rebound.cluster import LocalServer, read_log  # noqa: E402

TRAINED_RE = re.compile(r"^rebound-torch: trained (\d+) samples in ([0-9.eE+-]+) s\s*$")


def load_example(path):
    """The example script as a module (for spec_fields, parse_args and plain_train)."""
    spec = importlib.util.spec_from_file_location("fashion_mnist_cnn", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_text(tau, batch_size):
    """The Rebound side's job (docs/config.md), inline in the server config LocalServer
    writes."""
    return f"""
  job_id: "python-overhead"
  model {{ declared_by_worker: true }}
  topology {{ replicas: 1 stages: 1 spares: 0 evaluator: false }}
  data {{ batch_size: {batch_size} micro_batches: 1 seed: 42 }}
  compute {{ backend: CPU threads: 1 }}
  easgd {{ mode: EASGD sync_period: {tau} }}
  fault_tolerance {{ policy: REPLAY heartbeat_interval_ms: 500 failure_timeout_ms: 3000 }}
  step_log {{ enabled: true compression: ZSTD }}
  training {{ max_steps: 100000000 eval_every_ms: 2000 }}
"""


def run_rebound(args, tmp, rep):
    """Samples/s of one trainer of the example through a fresh rebound_server (started and
    killed by rebound.cluster.LocalServer, the tests' and demos' way)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(sys.path))
    with LocalServer(args.rebound_server, job_text(args.tau, args.batch_size),
                     log_path=os.path.join(tmp, f"server-{rep}.log")) as server:
        cmd = ["/usr/bin/python3", args.example, "--server", server.address, "--role",
               "trainer", "--name", f"bench-trainer-{rep}", "--max-seconds", str(args.seconds),
               "--optimizer", args.optimizer, "--batch-size", str(args.batch_size),
               "--tau", str(args.tau)]
        trainer = server.start_worker(cmd, log_path=os.path.join(tmp, f"trainer-{rep}.log"),
                                      env=env)
        try:
            trainer.wait(timeout=args.seconds + 120)
        except subprocess.TimeoutExpired:
            raise RuntimeError("the trainer did not exit within --seconds + 120 s:\n" +
                               read_log(trainer)[-4000:]) from None
        out = read_log(trainer)
        for line in out.splitlines():
            m = TRAINED_RE.match(line)
            if m:
                return int(m.group(1)) / float(m.group(2))
        raise RuntimeError(f"the trainer (exit {trainer.returncode}) printed no "
                           f"'rebound-torch: trained N samples in S s' line; its output:\n"
                           + out[-4000:] + "\n(server log:\n" + server.server_log()[-3000:] + ")")


def run_plain(example, fields, seconds):
    """Samples/s of the example's plain loop over `seconds`."""
    _, samples, elapsed = example.plain_train(types.SimpleNamespace(**fields), seconds=seconds,
                                              log=lambda *a, **k: None)
    return samples / elapsed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20.0, help="training time per side and rep")
    p.add_argument("--reps", type=int, default=3, help="alternating pairs")
    p.add_argument("--rebound-server",
                   default=os.path.join(REPO, "bazel-bin/server/rebound_server"))
    p.add_argument("--example", default=os.path.join(REPO, "examples/torch/fashion_mnist_cnn.py"))
    p.add_argument("--optimizer", default=None, help="the example's --optimizer (its default)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--tau", type=int, default=8)
    p.add_argument("--plain-only", action="store_true",
                   help="measure the plain side only (no server; prints no RESULT line)")
    args = p.parse_args()
    if args.seconds <= 0 or args.reps < 1 or args.batch_size < 1 or args.tau < 1:
        p.error("--seconds > 0, --reps, --batch-size, --tau >= 1")
    if not args.plain_only and not os.access(args.rebound_server, os.X_OK):
        p.error(f"{args.rebound_server} is not an executable: build it with "
                f"`bazel build -c opt //server:rebound_server` or pass --rebound-server")
    example = load_example(args.example)
    example_argv = ["--plain-epochs", "1", "--batch-size", str(args.batch_size), "--tau",
                    str(args.tau)]
    if args.optimizer:
        example_argv += ["--optimizer", args.optimizer]
    example_args = example.parse_args(example_argv)
    args.optimizer = example_args.optimizer
    torch.set_num_threads(1)
    fields = example.spec_fields(example_args)

    print(f"python_overhead: examples/torch/fashion_mnist_cnn.py ({args.optimizer}, batch "
          f"{args.batch_size}), one process and one torch thread per side, {args.reps} "
          f"alternating pairs of {args.seconds:g} s")
    print(f"  rebound: rebound_server (1 replica, tau {args.tau}, step logging on) + one trainer "
          "process; the samples/s it prints at exit")
    print("  plain:   the same spec in the example's plain PyTorch loop, in this process")
    rebound_rates, plain_rates = [], []
    with tempfile.TemporaryDirectory(prefix="python_overhead.") as tmp:
        for rep in range(args.reps):
            if args.plain_only:
                r = None
            else:
                try:
                    r = run_rebound(args, tmp, rep)
                except RuntimeError as e:
                    print(f"python_overhead: rebound side: {e}", file=sys.stderr)
                    return 1
            pl = run_plain(example, fields, args.seconds)
            plain_rates.append(pl)
            if r is None:
                print(f"  rep {rep + 1}: plain {pl:.0f} samples/s", flush=True)
                continue
            rebound_rates.append(r)
            print(f"  rep {rep + 1}: rebound {r:.0f} samples/s, plain {pl:.0f} samples/s, "
                  f"ratio {r / pl:.3f}", flush=True)
    if args.plain_only:
        print(f"python_overhead: plain_samples_s={statistics.median(plain_rates):.0f} "
              "(--plain-only: no RESULT)")
        return 0
    ratio = statistics.median(r / pl for r, pl in zip(rebound_rates, plain_rates))
    print(f"RESULT python_overhead: rebound_samples_s={statistics.median(rebound_rates):.0f} "
          f"plain_samples_s={statistics.median(plain_rates):.0f} ratio={ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
