"""rebound.torch's progress line (runner.ProgressLine): the C++ worker's line
(worker/progress_line.h, tests/worker:progress_line_test), on a clock the test moves."""

import math

from rebound_pb import rebound_pb2
from rebound.torch.runner import ProgressLine


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_line_per_interval_with_the_samples_per_second_since_the_last():
    clock = Clock()
    progress = ProgressLine(rebound_pb2.SlotId(replica=0, stage=1), 4000, 64, 10, clock)
    assert progress.step(1, 2.3, None) is None  # starts the clock
    clock.now += 5
    assert progress.step(50, 1.9, None) is None
    clock.now += 5
    assert progress.step(101, 0.41234, None) == (
        "progress: slot (0, 1) step 101/4000, loss 0.4123, weight -, 640 samples/s")
    clock.now += 9
    assert progress.step(200, 0.4, 0.98) is None
    clock.now += 11
    assert progress.step(301, 0.3, 0.976) == (
        "progress: slot (0, 1) step 301/4000, loss 0.3000, weight 0.98, 640 samples/s")


def test_no_loss_is_a_dash_and_an_interval_of_0_never_reports():
    clock = Clock()
    line = ProgressLine(rebound_pb2.SlotId(replica=2, stage=0), 100, 10, 1, clock)
    line.step(1, math.nan, 1.0)
    clock.now += 2
    assert line.step(21, math.nan, 1.0) == (
        "progress: slot (2, 0) step 21/100, loss -, weight 1.00, 100 samples/s")
    off = ProgressLine(rebound_pb2.SlotId(), 100, 10, 0, clock)
    for t in range(1, 101):
        clock.now += 100
        assert off.step(t, 1.0, 1.0) is None
