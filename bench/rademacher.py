#!/usr/bin/python3
"""rademacher: the Python client's replayable Rademacher draws vs torch's own random signs.

    bench/rademacher.py [--reps 7] [--size 1000]

Prints `RESULT rademacher: rebound_draws_s=... torch_draws_s=... ratio=...`: draws per second of
rebound.rng.rademacher_tensor (the Hutchinson probe every AdaHessian step of a Python trainer
draws, counter-based so that a spare replays it bit for bit) for a --size x --size float32 tensor,
against the same shape from torch.randint(0, 2) * 2 - 1 (not replayable: the baseline a user
would write), alternating the two --reps times in this process; the figures are the medians.
No target: the check that the draws stay cheap, formerly a 1 s bound on 1e6 draws inside
tests/python/test_kernels.py, which a busy CI machine failed (1.03 s). Exit code 0.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))
from rebound import rng  # noqa: E402


def timed(draw):
    begin = time.perf_counter()
    draw()
    return time.perf_counter() - begin


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--size", type=int, default=1000)
    args = p.parse_args()
    if args.reps < 1 or args.size < 1:
        p.error("--reps and --size must be >= 1")
    shape = (args.size, args.size)
    n = args.size * args.size
    torch.set_num_threads(1)
    ours, theirs = [], []
    for rep in range(args.reps):
        ours.append(timed(lambda: rng.rademacher_tensor(1, 2, rep, 4, shape)))
        theirs.append(timed(lambda: torch.randint(0, 2, shape).float() * 2 - 1))
    ours_s, theirs_s = n / statistics.median(ours), n / statistics.median(theirs)
    print(f"{n} draws, median of {args.reps}: rebound.rng {statistics.median(ours) * 1e3:.1f} ms, "
          f"torch.randint {statistics.median(theirs) * 1e3:.1f} ms (one torch thread)")
    print(f"RESULT rademacher: rebound_draws_s={ours_s:.0f} torch_draws_s={theirs_s:.0f} "
          f"ratio={ours_s / theirs_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
