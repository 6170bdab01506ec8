#!/usr/bin/python3
"""peer_torch: the shipped MLP with AdaHessian, Rebound's C++ engine (rebound_train) vs PyTorch.

    bench/peer_torch.py [--seconds 10] [--reps 3] [--rebound-train bazel-bin/worker/rebound_train]
                        [--config configs/train.pbtxt] [--micro-batches 1] [--hessian-every K]

Prints `RESULT peer_torch: rebound_samples_s=... torch_samples_s=... ratio=...`: training samples
per second of each side, one thread each, measured in the same run in alternating pairs (Rebound
then PyTorch, --reps times, each side for about --seconds); the figures are the medians over the
reps and the ratio the median of the paired ratios rebound / torch. Exit codes: 0 measured, 1 a
side failed (its output is printed), 2 bad arguments.

What each side does (honestly; also printed before the RESULT line):
  * Rebound: `rebound_train --config C --epochs E` with C the shipped configs/train.pbtxt (the MLP
    784-256(ReLU)-128(ReLU)-10, batch 64 in its micro-batches, AdaHessian with the exact
    Hessian-vector product by the R-operator, Rademacher z from Philox, hessian_every from the
    config, warm-up + cosine lr) plus `train_limit` so that an epoch is --epoch-steps steps, and
    test_limit 1000 so that the evaluation between epochs is short; OPENBLAS_NUM_THREADS=1 and
    compute.threads 1. Its figure is the samples/s that rebound_train prints per epoch (training
    time only: batch assembly, forward, backward, Hz, update; not the evaluation), summed over the
    epochs after the first (warm-up) until --seconds of training time have passed.
  * PyTorch: torch.nn.Sequential of the same Linear/ReLU layers (default init), the same batch
    size without micro-batches (one forward per step), cross-entropy, and AdaHessian written below
    in plain torch: g by loss.backward(create_graph=True), Hz = autograd.grad(g, params, z) with z
    Rademacher from torch's generator, D = z * Hz, then the docs/design.md §4.3 update (beta1 0.9, beta2
    0.999, eps 1e-4, Hessian power 1, bias correction) with the config's lr and linear warm-up;
    every hessian_every steps like the engine (the gradient alone in between).
    torch.set_num_threads(1). Timed: batch gather (index_select from one in-memory tensor),
    forward, double backward, update, for --seconds after a short warm-up.
  Micro-batches: the engine runs the batch of 64 as --micro-batches M micro-batches (default 1:
  one pass over the whole batch, as the PyTorch side does; 0 keeps the config's, 4 in
  configs/train.pbtxt). They change how the engine walks the batch, not the step's math, but
  four passes of 16 rows are slower than one of 64 (R12, measured in one run on 2 shared cores:
  ratio 1.74 with 4, 2.50 with 1).
"""

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "python"))

from rebound.torch.data import FashionMnist  # noqa: E402


def parse_config(text):
    """The fields of a JobConfig text (configs/train.pbtxt) that both sides need."""
    def one(pattern, default=None, cast=float):
        m = re.search(pattern, text)
        if m is None:
            if default is None:
                raise ValueError(f"config: no match for {pattern!r}")
            return default
        return cast(m.group(1))
    layers = re.findall(r"layers\s*\{\s*width:\s*(\d+)\s+activation:\s*(\w+)\s*\}", text)
    if not layers or any(a != "RELU" for _, a in layers[:-1]) or layers[-1][1] != "IDENTITY":
        raise ValueError(f"config: expected RELU hidden layers and an IDENTITY output: {layers}")
    return dict(
        input_dim=one(r"input_dim:\s*(\d+)", cast=int),
        widths=[int(w) for w, _ in layers],
        batch_size=one(r"batch_size:\s*(\d+)", cast=int),
        lr=one(r"\blr:\s*([0-9.eE+-]+)"),
        warmup_steps=one(r"warmup_steps:\s*(\d+)", 0, int),
        hessian_every=one(r"hessian_every:\s*(\d+)", 1, int),
        beta1=one(r"beta1:\s*([0-9.eE+-]+)", 0.9),
        beta2=one(r"beta2:\s*([0-9.eE+-]+)", 0.999),
        epsilon=one(r"epsilon:\s*([0-9.eE+-]+)", 1e-4),
        hessian_power=one(r"hessian_power:\s*([0-9.eE+-]+)", 1.0),
    )


def bench_config(text, train_limit, micro_batches, hessian_every):
    """The shipped config with the bench's data limits (and overrides) inserted."""
    extra = f"\n  train_limit: {train_limit}\n  test_limit: 1000"
    if micro_batches:
        text = re.sub(r"\n\s*micro_batches:\s*\d+", "", text)
        extra += f"\n  micro_batches: {micro_batches}"
    text, n = re.subn(r"\bdata\s*\{", "data {" + extra, text, count=1)
    if n != 1:
        raise ValueError("config: no data { } block")
    if hessian_every:
        text = re.sub(r"\n\s*hessian_every:\s*\d+", "", text)
        text, n = re.subn(r"\badahessian\s*\{", f"adahessian {{\n  hessian_every: {hessian_every}",
                          text, count=1)
        if n != 1:
            raise ValueError("config: no adahessian { } block")
    return text


def run_rebound(binary, config_path, seconds, epochs):
    """Samples/s of rebound_train over the epochs after the first, stopping after `seconds`."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([binary, f"--config={config_path}", f"--epochs={epochs}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # A watchdog: the run must not outlive a generous multiple of its budget.
    watchdog = threading.Timer(3 * seconds + 60, proc.kill)
    watchdog.start()
    line_re = re.compile(r"^epoch\s+(\d+) .* (\d+) samples/s\s+([0-9.]+) s")
    samples = train_s = 0.0
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            m = line_re.match(line)
            if not m:
                continue
            epoch, rate, secs = int(m.group(1)), float(m.group(2)), float(m.group(3))
            if epoch == 1:
                continue  # warm-up: first touches of the buffers
            samples += rate * secs
            train_s += secs
            if train_s >= seconds:
                break
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        watchdog.cancel()
    if train_s == 0:
        sys.stdout.write("".join(output))
        raise RuntimeError(f"{binary} printed no epoch after the first (exit {proc.returncode})")
    return samples / train_s


def adahessian_step(params, state, loss, t, cfg, lr):
    """One AdaHessian step in plain torch (docs/design.md §4.3), D by Hutchinson + double backward."""
    due = cfg["hessian_every"] <= 1 or (t - 1) % cfg["hessian_every"] == 0
    grads = torch.autograd.grad(loss, params, create_graph=due)
    if due:
        zs = [torch.randint(0, 2, p.shape, dtype=torch.float32).mul_(2).sub_(1) for p in params]
        hzs = torch.autograd.grad(grads, params, grad_outputs=zs)
        state["d"] = [z * hz for z, hz in zip(zs, hzs)]
    b1, b2 = cfg["beta1"], cfg["beta2"]
    bias1, bias2 = 1 - b1 ** t, 1 - b2 ** t
    k = cfg["hessian_power"]
    with torch.no_grad():
        for p, g, d, m, v in zip(params, grads, state["d"], state["m"], state["v"]):
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(d, d, value=1 - b2)
            denom = (v / bias2).sqrt_()
            if k != 1.0:
                denom.pow_(k)
            p.addcdiv_(m, denom.add_(cfg["epsilon"]), value=-lr / bias1)


def run_torch(data, cfg, seconds, warmup_steps=20):
    """Samples/s of the plain PyTorch MLP + AdaHessian over `seconds` (after warm-up steps)."""
    torch.manual_seed(1)
    layers, width_in = [], cfg["input_dim"]
    for i, w in enumerate(cfg["widths"]):
        layers.append(torch.nn.Linear(width_in, w))
        if i + 1 < len(cfg["widths"]):
            layers.append(torch.nn.ReLU())
        width_in = w
    model = torch.nn.Sequential(torch.nn.Flatten(), *layers)
    params = list(model.parameters())
    state = {"m": [torch.zeros_like(p) for p in params], "v": [torch.zeros_like(p) for p in params]}
    b, n = cfg["batch_size"], len(data)
    gen = torch.Generator().manual_seed(42)
    order = torch.randperm(n, generator=gen)
    t = pos = samples = 0
    start = None
    while True:
        if t == warmup_steps:
            start, samples = time.perf_counter(), 0
        if start is not None and time.perf_counter() - start >= seconds:
            return samples / (time.perf_counter() - start)
        if pos + b > n:
            order, pos = torch.randperm(n, generator=gen), 0
        x, y = data.batch(order[pos:pos + b])
        pos += b
        t += 1
        lr = cfg["lr"] * min(1.0, t / cfg["warmup_steps"]) if cfg["warmup_steps"] else cfg["lr"]
        loss = torch.nn.functional.cross_entropy(model(x), y)
        adahessian_step(params, state, loss, t, cfg, lr)
        samples += b


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measured time per side and rep")
    p.add_argument("--reps", type=int, default=3, help="alternating pairs")
    p.add_argument("--rebound-train", default=os.path.join(REPO, "bazel-bin/worker/rebound_train"))
    p.add_argument("--config", default=os.path.join(REPO, "configs/train.pbtxt"))
    p.add_argument("--epoch-steps", type=int, default=100, help="steps per rebound_train epoch")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="the engine's micro-batches per step (0 = the config's)")
    p.add_argument("--hessian-every", type=int, default=0, help="override the config's (0 = keep)")
    args = p.parse_args()
    if args.seconds <= 0 or args.reps < 1 or args.epoch_steps < 1 or args.micro_batches < 0 \
            or args.hessian_every < 0:
        p.error("--seconds > 0, --reps >= 1, --epoch-steps >= 1, overrides >= 0")
    if not os.access(args.rebound_train, os.X_OK):
        p.error(f"{args.rebound_train} is not an executable: build it with "
                f"`bazel build -c opt //worker:rebound_train` or pass --rebound-train")
    with open(args.config) as f:
        text = f.read()
    cfg = parse_config(text)
    if args.hessian_every:
        cfg["hessian_every"] = args.hessian_every
    torch.set_num_threads(1)
    data = FashionMnist("train")
    train_limit = args.epoch_steps * cfg["batch_size"]
    # Enough epochs for --seconds at up to 10x the engine's expected speed; the run is stopped
    # once --seconds of training time have been read.
    epochs = 2 + math.ceil(args.seconds * 100000 / train_limit)

    print("peer_torch: the shipped MLP " + "-".join(str(w) for w in [cfg["input_dim"]] +
          cfg["widths"]) + f" with AdaHessian (hessian_every {cfg['hessian_every']}), batch "
          f"{cfg['batch_size']}, one thread per side, {args.reps} alternating pairs of "
          f"{args.seconds:g} s")
    print("  rebound: rebound_train (C++ engine, OpenBLAS 1 thread, exact Hz by the R-operator, "
          f"micro-batches {args.micro_batches or 'as configured'}); samples/s it prints per epoch "
          "of training, the first epoch skipped")
    print("  torch:   nn.Sequential + AdaHessian in plain torch (double backward for Hz), "
          "torch.set_num_threads(1); batch gather + step timed")
    rebound_rates, torch_rates = [], []
    with tempfile.TemporaryDirectory(prefix="peer_torch.") as tmp:
        config_path = os.path.join(tmp, "train.pbtxt")
        with open(config_path, "w") as f:
            f.write(bench_config(text, train_limit, args.micro_batches, args.hessian_every))
        for rep in range(args.reps):
            try:
                r = run_rebound(args.rebound_train, config_path, args.seconds, epochs)
            except RuntimeError as e:
                print(f"peer_torch: {e}", file=sys.stderr)
                return 1
            tr = run_torch(data, cfg, args.seconds)
            rebound_rates.append(r)
            torch_rates.append(tr)
            print(f"  rep {rep + 1}: rebound {r:.0f} samples/s, torch {tr:.0f} samples/s, "
                  f"ratio {r / tr:.2f}", flush=True)
    ratio = statistics.median(r / t for r, t in zip(rebound_rates, torch_rates))
    print(f"RESULT peer_torch: rebound_samples_s={statistics.median(rebound_rates):.0f} "
          f"torch_samples_s={statistics.median(torch_rates):.0f} ratio={ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
