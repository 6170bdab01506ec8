"""rebound.torch.run: a Python worker of a Rebound job (docs/design.md §11, docs/python.md).

One process, three roles, decided by the server at registration: a TRAINER trains its slot and
syncs with the center every tau steps (EASGD, §4.4, with the same float32 arithmetic as the C++
worker), logging each step's sample ids, torch seed and parameter checksums; a SPARE waits for a
recovery task, rebuilds a lost slot by replaying its log from its snapshot, verifies every step's
checksum and takes the slot over (or, under RESTART_FROM_CENTER, takes one over from the
center), and, while idle, audits live trainers (docs/recovery.md#audits): replays one of their
sync windows the same way, reports with ReportAudit whether every step matched, and takes
nothing over; an EVALUATOR pulls the center and reports test loss and accuracy. The center is one
server group's or sharded across K groups (docs/sharding.md); rebound.torch.center hides which.

Determinism (what replay needs): the batch of step t is a pure function of (job seed, replica,
t) (``batch_ids``); before step t the runner seeds torch's generator with ``step_seed(...)`` and
logs the seed; torch runs with ``use_deterministic_algorithms(True)`` and the job's
``compute.threads``. The user's model, loss and optimizer must be deterministic functions of
those (docs/python.md#determinism); a replay that does not reproduce a step says which step and
tensor differed and the server falls back to RESTART_FROM_CENTER.

Threads: the work (main) thread; a heartbeat thread (``_Session``) that also carries the
server's commands and takeovers; a step-log thread (``_StepLog``). A fenced worker exits at once
with code 3 from whichever thread learns it (``os._exit``: no later write can leave it); the
other ends those threads learn stop the session, and ``run`` returns their code.

Signals: while ``run`` works (called from the main thread) SIGTERM and SIGINT set the session's
stop: the step in progress completes, the worker deregisters and ``run`` returns code 0.

The end: ``run`` returns a ``RunResult`` (an int, the exit code, with the spec's model holding the
job's final center, read with the worker's own Pull before it deregisters), or, with
``exit=True``, ends the process with the code at once (docs/python.md#the-trained-model).
"""

import collections
import dataclasses
import math
import os
import signal
import socket
import sys
import threading
import time
import typing
import warnings

import numpy as np
import torch

import rebound
from rebound import checksum
from rebound import client as rclient
from rebound import membership
from rebound import steplog
from rebound.torch import injected_faults
from rebound.torch import kernels
from rebound.torch import optim_state
from rebound.torch import wire
from rebound.torch.adahessian import AdaHessian
from rebound.torch.center import center_for
from rebound_pb import config_pb2, rebound_pb2

_MASK64 = (1 << 64) - 1

# backward(create_graph=True) warns of a parameter <-> gradient cycle; the runner breaks it by
# zero_grad(set_to_none=True) before every step.
warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")


_log = rclient.log


class ProgressLine:
    """The line a trainer logs every ``interval_s`` seconds (WorkerConfig.progress_interval_s;
    0: never), as the C++ worker's (worker/progress_line.h):
    ``progress: slot (0, 1) step 1200/4000, loss 0.4123, weight 0.98, 2310 samples/s``.
    ``clock`` is time.monotonic unless a test gives another."""

    def __init__(self, slot, max_steps, batch_size, interval_s, clock=time.monotonic):
        self.slot = "(%d, %d)" % (slot.replica, slot.stage)
        self.max_steps = max_steps
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.clock = clock
        self.last = None  # (time, step) of the line before, or of the first step

    def step(self, t, loss, weight):
        """Step t finished; the line when one is due (also logged), else None."""
        if self.interval_s <= 0:
            return None
        now = self.clock()
        if self.last is None:
            self.last = (now, t)
            return None
        elapsed = now - self.last[0]
        if elapsed < self.interval_s:
            return None
        rate = (t - self.last[1]) * self.batch_size / elapsed
        line = "progress: slot %s step %d/%d, loss %s, weight %s, %.0f samples/s" % (
            self.slot, t, self.max_steps, "%.4f" % loss if math.isfinite(loss) else "-",
            "-" if weight is None else "%.2f" % weight, rate)
        self.last = (now, t)
        _log(line)
        return line
_Exit = rclient.WorkerExit


class ConfigError(Exception):
    """The spec or the options do not fit (exit code 2)."""


class RunResult(int):
    """What ``run`` returns: an int, the exit code (rebound.EXIT_*), so that
    ``sys.exit(rt.run(spec))`` exits with it and code that compared run()'s int keeps working;
    and the outcome (docs/python.md#the-trained-model):

    exit_code: the same code, by name.
    model: the spec's model (the process's own, the one it trained or evaluated; a spare's built
        by the spec's factory) holding the job's final center in its parameters, in eval mode,
        without gradients; None when this process did not see the job finish (it ended first:
        ``max_seconds``, drained, an error) or could not read the center: ``reason`` says which.
    center_version: the final center's version (stage 0's; a sharded center's range 0's), or None.
    job_finished: every slot reached max_steps (the server's STOP) while this process was
        registered.
    reason: "" when ``model`` holds the final center and the code is 0; else why not.
    role: the last role, "trainer", "spare" or "evaluator" (a spare that took a slot over:
        "trainer"); None when the process never registered.
    slot: (replica, stage) of the slot it trained last, or None.
    samples, training_s: samples trained and seconds in training loops (the summary line's).

    ``bool(result)`` is the int's: true for a non-zero code; test ``result.exit_code == 0``.
    """

    def __new__(cls, exit_code, model=None, center_version=None, job_finished=False, reason="",
                role=None, slot=None, samples=0, training_s=0.0):
        result = super().__new__(cls, exit_code)
        result.model = model
        result.center_version = center_version
        result.job_finished = job_finished
        result.reason = reason
        result.role = role
        result.slot = slot
        result.samples = samples
        result.training_s = training_s
        return result

    @property
    def exit_code(self):
        return int(self)

    def __repr__(self):
        return ("RunResult(exit_code=%d, model=%s, center_version=%r, job_finished=%r, "
                "reason=%r, role=%r, slot=%r, samples=%d, training_s=%.3f)" % (
                    int(self), None if self.model is None else type(self.model).__name__,
                    self.center_version, self.job_finished, self.reason, self.role, self.slot,
                    self.samples, self.training_s))

    __str__ = __repr__


@dataclasses.dataclass
class Spec:
    """What a training script declares (docs/python.md#the-spec).

    model: a factory returning the torch.nn.Module; called after torch.manual_seed(the job's
        model.init_seed), so its initialisation is the same in every process.
    optimizer: a factory taking the model's parameters and returning a torch.optim.Optimizer
        (rebound.torch.AdaHessian and every torch.optim optimizer but LBFGS and SparseAdam
        replay bit-identically: their state is in the snapshot by rebound.torch.optim_state's
        rule; a state that does not fit it trains, and a replay of it falls back to
        RESTART_FROM_CENTER).
    loss: loss(output, target) -> scalar tensor.
    train_set: indexable by sample id: train_set[i] -> (x, y), batched by the runner (tensors and
        numpy arrays stacked, numbers and lists of numbers as torch.as_tensor makes them: any
        target a loss takes, class indices, floats, vectors, multi-label); an optional
        train_set.batch(ids) -> (X, Y) is used when present (docs/python.md#data).
    test_set: the evaluator's data set (same protocol); None: this script cannot evaluate.
    accuracy: None, or accuracy(output, target) -> the fraction of a test batch predicted right;
        None: argmax accuracy for class-index targets, none (the loss alone) for other targets.
    init_seed: torch.manual_seed before the model factory: the first registration's model is the
        center's initial value (every trainer starts from the center).
    batch_size, tau: must equal the job's data.batch_size and easgd.sync_period (checked at
        registration; None: take the job's).
    scheduler: None, or a factory taking the optimizer and returning a learning-rate scheduler
        (any torch.optim.lr_scheduler whose step() takes no argument: StepLR, LambdaLR,
        OneCycleLR, CosineAnnealingLR, ...; not ReduceLROnPlateau). The runner steps it.
    scheduler_interval: "step": scheduler.step() after every optimizer step; "epoch": after
        every pass over the replica's shard (the step whose batch completes it). Its state
        after step t is a function of t, so a spare and a trainer restarted from the center
        rebuild it by stepping a fresh scheduler as often (docs/python.md#learning-rate-schedulers).
    """
    model: typing.Callable[[], torch.nn.Module]
    optimizer: typing.Callable[[typing.Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
    loss: typing.Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    train_set: typing.Any
    test_set: typing.Any = None
    batch_size: typing.Optional[int] = None
    tau: typing.Optional[int] = None
    eval_batch_size: int = 1000
    init_seed: int = 1
    scheduler: typing.Optional[typing.Callable[[torch.optim.Optimizer], typing.Any]] = None
    scheduler_interval: str = "step"
    accuracy: typing.Optional[typing.Callable[[typing.Any, typing.Any], float]] = None


# ---------------------------------------------------------------------------------------------
# Determinism: the batch and torch seed of a step.

def _mix64(x):
    """common/rng.h RngMix64 (splitmix64's finaliser)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed, replica, step):
    """The seed torch's generator gets before step ``step`` of ``replica`` (logged; replay
    uses it), below 2^63 (torch.manual_seed's range)."""
    return _mix64(_mix64(seed ^ _mix64((replica << 32) | 4)) ^ step) & ((1 << 63) - 1)


def shard_ids(n, replicas, replica):
    """The sample ids of a replica: every replicas-th id from ``replica`` (docs/python.md)."""
    return np.arange(replica, n, replicas, dtype=np.int64)


def _epoch_order(shard, seed, replica, epoch):
    generator = torch.Generator()
    generator.manual_seed(_mix64(_mix64(seed ^ (replica << 32) ^ 3) ^ epoch) & ((1 << 63) - 1))
    return shard[torch.randperm(len(shard), generator=generator).numpy()]


def batch_ids(shard, seed, replica, step, batch_size, _cache={}):
    """The sample ids of step ``step`` (1-based): positions [(step-1) B, step B) of the
    replica's shard in epoch-wise shuffled order, wrapping into the next epoch. A pure function
    of its arguments, so a successor goes on where a lost trainer was. Also returns the data
    cursor (epoch, offset) after the step."""
    n = len(shard)
    start = (step - 1) * batch_size
    out = np.empty(batch_size, dtype=np.int64)
    filled = 0
    while filled < batch_size:
        epoch, offset = divmod(start + filled, n)
        key = (id(shard), n, seed, replica, epoch)
        order = _cache.get(key)
        if order is None:
            if len(_cache) > 4:
                _cache.clear()
            order = _cache[key] = _epoch_order(shard, seed, replica, epoch)
        take = min(batch_size - filled, n - offset)
        out[filled:filled + take] = order[offset:offset + take]
        filled += take
    epoch, offset = divmod(step * batch_size, n)
    return out, epoch, offset


class DataError(Exception):
    """A data set the runner cannot batch (exit code 2): the message names the samples and
    what to do."""


def _collate(values, ids, what):
    """One batch tensor of the per-sample ``values`` (docs/python.md#data): tensors and numpy
    arrays stacked as they are (dtype kept), Python numbers and lists or tuples of numbers as
    torch.as_tensor makes them (floats float32, ints int64, bools bool). DataError otherwise."""
    first = values[0]
    try:
        if isinstance(first, torch.Tensor):
            return torch.stack([torch.as_tensor(v) for v in values])
        if isinstance(first, np.ndarray):
            return torch.stack([torch.from_numpy(np.asarray(v)) for v in values])
        if isinstance(first, (bool, int, float, np.number, list, tuple)):
            return torch.as_tensor(values if not isinstance(first, np.number)
                                   else np.asarray(values))
    except (RuntimeError, TypeError, ValueError) as error:
        raise DataError("the %s of samples %s cannot be batched: %s (every sample's %s needs "
                        "the same shape; or give the data set a batch(ids) method)" % (
                            what, _ids_text(ids), str(error).splitlines()[0], what)) from None
    raise DataError("the %s of sample %d is a %s, which the runner cannot batch: return "
                    "tensors, numpy arrays, numbers or lists of numbers from ds[i], or give the "
                    "data set a batch(ids) method (docs/python.md#data)" % (
                        what, int(ids[0]), type(first).__name__))


def _ids_text(ids):
    ids = [int(i) for i in ids]
    return "%s" % ids if len(ids) <= 6 else "[%d, %d, %d, ...] (%d samples)" % (
        ids[0], ids[1], ids[2], len(ids))


def _fetch(data_set, ids):
    """(X, Y) of the samples ``ids``: ``data_set.batch(ids)`` when it has one, else ds[i] of
    each, batched by ``_collate``. DataError for what cannot be batched."""
    if hasattr(data_set, "batch"):
        batch = data_set.batch(torch.as_tensor(ids))
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise DataError("the data set's batch(ids) returned a %s; it must return (X, Y)" %
                            type(batch).__name__)
        return batch
    items = [data_set[int(i)] for i in ids]
    for i, item in zip(ids, items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DataError("sample %d of the data set is a %s; ds[i] must be a pair (x, y)" %
                            (int(i), type(item).__name__))
    return (_collate([x for x, _ in items], ids, "input"),
            _collate([y for _, y in items], ids, "target"))


def _batch_accuracy(spec, output, target):
    """The fraction of the batch predicted right, or None where it is not defined: the spec's
    ``accuracy(output, target)`` if it has one; else, for class indices (an integer target of
    shape [B] and an output of shape [B, C]), argmax's; else None (regression, multi-label:
    the evaluator reports the loss alone)."""
    if spec.accuracy is not None:
        return float(spec.accuracy(output, target))
    if (isinstance(target, torch.Tensor) and isinstance(output, torch.Tensor) and
            target.dim() == 1 and output.dim() == 2 and len(target) == len(output) and
            not target.dtype.is_floating_point and target.dtype != torch.bool):
        return float((output.argmax(dim=1) == target).sum()) / max(1, len(target))
    return None


# ---------------------------------------------------------------------------------------------
# Checksums.

def _params_checksums(params):
    data = [p.detach().contiguous().numpy().tobytes() for p in params]
    total = checksum.checksum_floats(b"".join(data))
    return total, [checksum.checksum_floats(d) for d in data]


# ---------------------------------------------------------------------------------------------
# Optimizer state <-> the protocol's OptimizerState (step, m, v, last_hdiag).

def _export_optimizer(optimizer, tensors, names, step):
    """(OptimizerState, why) over the declared ``tensors``: AdaHessian's (m, v, D) by its own
    export, any other optimizer's state by rebound.torch.optim_state's rule; ``why`` says why a
    replay from it cannot be exact (None when it can)."""
    if isinstance(optimizer, AdaHessian):
        t, m, v, d = optimizer.export_state()
        params = optimizer._params()
        message = rebound_pb2.OptimizerState(step=int(t))
        for field, values in (("m", m), ("v", v), ("last_hdiag", d)):
            if values is not None:
                getattr(message, field).CopyFrom(wire.bundle_of(_over(tensors, params, values)))
        return message, None
    return optim_state.export(optimizer, tensors, names, step)


def _import_optimizer(optimizer, tensors, names, state, snapshot_step):
    """Loads a snapshot's OptimizerState into the freshly built optimizer. Raises
    optim_state.Unreplayable when the state cannot be restored exactly."""
    if isinstance(optimizer, AdaHessian):
        zeros = [torch.zeros_like(p) for p in tensors]
        m = wire.tensors_of(state.m, tensors, "optimizer.m") if state.m.tensors else zeros
        v = wire.tensors_of(state.v, tensors, "optimizer.v") if state.v.tensors else zeros
        d = (wire.tensors_of(state.last_hdiag, tensors, "optimizer.last_hdiag")
             if state.last_hdiag.tensors else zeros)
        params = optimizer._params()
        optimizer.import_state(state.step, _of(tensors, params, m), _of(tensors, params, v),
                               _of(tensors, params, d))
        return
    optim_state.restore(optimizer, tensors, names, state, snapshot_step)


# ---------------------------------------------------------------------------------------------
# The declared tensors: parameters, then float buffers.

def declared_tensors(model):
    """(names, tensors) of what a model declares, in id order: every parameter of
    ``model.named_parameters()``, then every float32 buffer of its state_dict (BatchNorm's
    running_mean and running_var; not a non-persistent buffer, which is no state). The center
    holds them all and averages buffers with the parameters (docs/python.md#buffers). Integer
    buffers (num_batches_tracked) are not declared: ``set_batches_tracked``."""
    names, tensors = [], []
    for name, p in model.named_parameters():
        names.append(name)
        tensors.append(p)
    persistent = set(model.state_dict(keep_vars=True))
    for name, b in model.named_buffers():
        if b.dtype == torch.float32 and name in persistent:
            names.append(name)
            tensors.append(b)
    return names, tensors


def set_batches_tracked(model, step):
    """Every BatchNorm's num_batches_tracked := the slot's step: what one training forward per
    step counts from step 0, whatever the process's history (a spare, a restart). It matters
    only to a BatchNorm with momentum=None (a cumulative average)."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and (
                getattr(module, "num_batches_tracked", None) is not None):
            module.num_batches_tracked.fill_(step)


def _over(tensors, params, values):
    """``values`` (one per parameter of ``params``) as one per declared tensor: zeros for the
    declared tensors that are not in ``params`` (buffers)."""
    by_id = {id(p): v for p, v in zip(params, values)}
    return [by_id.get(id(t), None) if id(t) in by_id else torch.zeros_like(t) for t in tensors]


def _of(tensors, params, values):
    """The inverse of ``_over``: the values of ``params`` among those of ``tensors``."""
    by_id = {id(t): v for t, v in zip(tensors, values)}
    return [by_id[id(p)] for p in params]


# ---------------------------------------------------------------------------------------------
# The worker.

@dataclasses.dataclass
class _Replayed:
    """What replaying a task's window (t0, failed_step] gave (``_Worker.replay_window``)."""

    steps: int = 0  # steps replayed that matched the log
    # The checksum of the last step that matched (the snapshot's when the window is empty).
    final: typing.Optional[int] = None
    # Why the replay did not run through (None: it did, every step matching): the first step
    # that differed, a state the snapshot cannot restore, a gap in the log, an interruption.
    failure: typing.Optional[str] = None
    mismatch: typing.Optional[rebound_pb2.ReplayMismatch] = None  # where the first step differed
    unreplayable: bool = False  # the snapshot cannot restore the optimizer's state exactly
    interrupted: typing.Optional[str] = None  # what the ``interrupt`` function said
    transfer_s: float = 0.0  # from the start to the log read (snapshot and log)
    replay_s: float = 0.0    # from the log read to the end


class _Worker:
    """``center``: the job's center (rebound.torch.center), one server group's or sharded."""

    def __init__(self, spec, session, conn, center, options, max_seconds):
        self.spec = spec
        self.session = session
        self.conn = conn
        self.center = center
        self.options = options
        self.max_seconds = max_seconds
        self.started = time.monotonic()
        self.samples = 0
        self.training_s = 0.0  # time in training loops (steps, logging, syncs), for the summary
        self._iteration_began = None
        self.model = None
        self.optimizer = None
        self.scheduler = None
        self._epoch = (1, 1)  # (batch size, shard length): an epoch's steps, for the scheduler
        self.params = None   # the optimizer's: model.parameters()
        self.tensors = None  # the declared ones (parameters, float buffers), the center's
        self.names = None
        self._unreplayable = None  # why the optimizer's state cannot be snapshotted, once logged
        self.progress_interval_s = 10  # WorkerConfig.progress_interval_s (run() sets it)
        # Testing only: the bit flips the environment asks for (run() reads it once).
        self.bit_flips = injected_faults.BitFlips()

    # -- set-up ---------------------------------------------------------------------------

    def build(self, job, replica):
        torch.manual_seed(self.spec.init_seed)
        self.model = self.spec.model()
        self.params = [p for p in self.model.parameters()]
        self.names, self.tensors = declared_tensors(self.model)
        self.optimizer = self.spec.optimizer(self.params)
        if isinstance(self.optimizer, AdaHessian):
            self.optimizer.set_rng(job.data.seed, replica)
        self.scheduler = None
        if self.spec.scheduler is not None:
            self.scheduler = self.spec.scheduler(self.optimizer)
            if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise _Exit(rebound.EXIT_CONFIG, "the spec's scheduler is ReduceLROnPlateau, "
                            "whose step needs a metric: the runner steps schedulers without one")
        shard = shard_ids(len(self.spec.train_set), job.topology.replicas, replica)
        self._epoch = (job.data.batch_size, max(1, len(shard)))

    def _scheduler_steps(self, t):
        """How often the scheduler has been stepped after training step t."""
        if self.spec.scheduler_interval == "step":
            return t
        batch_size, shard = self._epoch
        return t * batch_size // shard  # the passes over the shard completed

    def seek_scheduler(self, t):
        """Steps the freshly built scheduler to where it is after training step t: the same
        calls in the same order as the trainer made, so the same bits in every lr."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
            for _ in range(self._scheduler_steps(t)):
                self.scheduler.step()

    def check_job(self, job):
        if self.spec.batch_size is not None and self.spec.batch_size != job.data.batch_size:
            raise _Exit(rebound.EXIT_CONFIG, "the spec's batch_size %d differs from the job's "
                        "data.batch_size %d" % (self.spec.batch_size, job.data.batch_size))
        if self.spec.tau is not None and self.spec.tau != job.easgd.sync_period:
            raise _Exit(rebound.EXIT_CONFIG, "the spec's tau %d differs from the job's "
                        "easgd.sync_period %d" % (self.spec.tau, job.easgd.sync_period))

    def out_of_time(self):
        return (self.max_seconds is not None and
                time.monotonic() - self.started >= self.max_seconds)

    def _begin_iteration(self, reg):
        """Counts the previous iteration's time (step, log, sync: the summary line's training
        time) and says whether the loop must end: "stopped", "replaced", or None to go on."""
        now = time.monotonic()
        if self._iteration_began is not None:
            self.training_s += now - self._iteration_began
        self._iteration_began = now
        if self.session.stop.is_set() or self.out_of_time():
            self._iteration_began = None
            return "stopped"
        if self.session.current().incarnation != reg.incarnation:
            return "replaced"
        return None

    def _end_iterations(self):
        if self._iteration_began is not None:
            self.training_s += time.monotonic() - self._iteration_began
            self._iteration_began = None

    def _data(self, data_set, ids):
        try:
            return _fetch(data_set, ids)
        except DataError as error:
            raise _Exit(rebound.EXIT_CONFIG, str(error)) from None

    def set_params(self, values):
        """The declared tensors := ``values`` (parameters and buffers)."""
        with torch.no_grad():
            for p, v in zip(self.tensors, values):
                p.copy_(v)

    # -- training ---------------------------------------------------------------------------

    def step(self, job, replica, t, ids, seed):
        """One training step on the batch ``ids`` with torch seeded by ``seed``; the loss."""
        torch.manual_seed(seed)
        self.model.train()
        x, y = self._data(self.spec.train_set, ids)
        self.optimizer.zero_grad(set_to_none=True)
        adahessian = isinstance(self.optimizer, AdaHessian)
        if adahessian and self.optimizer.step_count != t - 1:
            raise _Exit(rebound.EXIT_FAILED, "AdaHessian is at step %d, the slot at %d" % (
                self.optimizer.step_count, t - 1))
        loss = self.spec.loss(self.model(x), y)
        loss.backward(create_graph=adahessian and self.optimizer.hessian_due())
        self.optimizer.step()
        if self.scheduler is not None:
            for _ in range(self._scheduler_steps(t) - self._scheduler_steps(t - 1)):
                self.scheduler.step()
        return float(loss.detach())

    def sync(self, reg, t, loss, cursor):
        optimizer, why = _export_optimizer(self.optimizer, self.tensors, self.names, t)
        if why is not None and why != self._unreplayable:
            self._unreplayable = why
            _log("the optimizer %s's state cannot be snapshotted exactly (%s): a replay of this "
                 "slot will fall back to RESTART_FROM_CENTER" % (type(self.optimizer).__name__,
                                                                 why))
        self.set_params(self._guarded(lambda: self.center.sync(
            reg.incarnation, reg.slot, t, self.tensors, optimizer, loss, cursor)))

    def pull(self, reg, buffers=True):
        """Sets the declared tensors to the center's (``buffers=False``: the parameters only);
        its version."""
        center, version = self._guarded(lambda: self.center.pull(reg.incarnation, self.tensors))
        if not buffers:
            held = {id(p) for p in self.params}
            center = [c if id(t) in held else t.detach().clone()
                      for t, c in zip(self.tensors, center)]
        self.set_params(center)
        return version

    def _call(self, method, request, **kwargs):
        return self._guarded(lambda: self.conn.call(method, request, stop=self.session.stop,
                                                    **kwargs))

    def _guarded(self, call):
        """call(), its errors mapped to the worker's exits: fenced (FAILED_PRECONDITION), failed
        (another refusal) or unreachable."""
        try:
            return call()
        except rclient.CallError as error:
            if error.code.name == "FAILED_PRECONDITION":
                self.session.fenced(str(error))
            raise _Exit(rebound.EXIT_FAILED, str(error)) from None
        except rclient.Unreachable as error:
            raise _Exit(rebound.EXIT_UNREACHABLE, str(error)) from None

    def train(self, reg, replayed):
        job = reg.job
        slot = reg.slot
        self.check_job(job)
        if job.easgd.mode == config_pb2.ASYNC_ADAHESSIAN:
            return self.train_pushing(reg)
        tau = job.easgd.sync_period
        max_steps = job.training.max_steps
        batch_size = job.data.batch_size
        micro = max(1, job.data.micro_batches)
        seed = job.data.seed
        shard = shard_ids(len(self.spec.train_set), job.topology.replicas, slot.replica)
        if len(shard) == 0:
            raise _Exit(rebound.EXIT_CONFIG, "replica %d has no samples" % slot.replica)
        start = reg.start_step
        if not replayed:
            self.build(job, slot.replica)
            # Every trainer starts from the center: the first declaration's values, or the
            # center a lost slot restarts from (RESTART_FROM_CENTER, a server restart).
            version = self.pull(reg)
            if start > 0 and isinstance(self.optimizer, AdaHessian):
                zeros = [torch.zeros_like(p) for p in self.params]
                self.optimizer.import_state(start, zeros, zeros, zeros)
            set_batches_tracked(self.model, start)
            self.seek_scheduler(start)  # a restart from the center keeps its schedule
            if start > 0:
                _log("restarting slot (%d, %d) from the center (version %d) at step %d" % (
                    slot.replica, slot.stage, version, start))
        logging = (job.step_log.enabled and
                   job.fault_tolerance.policy == config_pb2.REPLAY)
        log = steplog.StepLog(self.conn, self.options, reg.incarnation, job.step_log,
                       self.session) if logging else None
        _log("training slot (%d, %d) on %d samples for steps %d..%d, sync every %d" % (
            slot.replica, slot.stage, len(shard), start + 1, max_steps, tau))
        loss = float("nan")
        progress = ProgressLine(slot, max_steps, batch_size, self.progress_interval_s)
        try:
            if replayed and start > 0 and (start % tau == 0 or start == max_steps):
                # The lost trainer had done step `start`, but its sync was not applied.
                cursor = batch_ids(shard, seed, slot.replica, start, batch_size)[1:]
                self.sync(reg, start, float("nan"), cursor)
            for t in range(start + 1, max_steps + 1):
                ended = self._begin_iteration(reg)
                if ended is not None:
                    return ended
                ids, epoch, offset = batch_ids(shard, seed, slot.replica, t, batch_size)
                torch_seed = step_seed(seed, slot.replica, t)
                loss = self.step(job, slot.replica, t, ids, torch_seed)
                self._maybe_flip_bit(t)
                if not math.isfinite(loss):
                    raise _Exit(rebound.EXIT_FAILED, "the loss of step %d is not finite" % t)
                self.samples += batch_size
                self.session.set_progress(t, loss)
                progress.step(t, loss, getattr(self.center, "last_weight", None))
                if log is not None:
                    per = batch_size // micro
                    records = [rebound_pb2.LogRecord(
                        slot=slot, step=t, micro_batch=k,
                        sample_ids=ids[k * per:(k + 1) * per].tolist()) for k in range(micro)]
                    total, each = _params_checksums(self.tensors)
                    records.append(rebound_pb2.LogRecord(
                        slot=slot, step=t, micro_batch=-1, params_checksum=total,
                        rng_seed=torch_seed, tensor_checksums=each))
                    log.append(records)
                if t % tau != 0 and t != max_steps:
                    continue
                self.sync(reg, t, loss, (epoch, offset))
                with self.session.lock:
                    drain = self.session.drain
                if drain:
                    _log("drained: synced step %d; leaving slot (%d, %d)" % (
                        t, slot.replica, slot.stage))
                    return "drained"
            _log("finished %d steps" % max_steps)
            return "finished"
        finally:
            self._end_iterations()
            if log is not None:
                if not log.flush(self.options.rpc_deadline_s):
                    _log("the step log was not flushed at the end")
                log.close()

    def _maybe_flip_bit(self, t):
        """Fault injection (tests only, rebound.torch.injected_faults): after step t's update and
        before its checksum is logged, flips a bit of one parameter when the environment asked
        for it at step t."""
        flipped = self.bit_flips.maybe_flip(t, self.params)
        if flipped is not None:
            which, index = flipped
            _log("fault injection: flipped bit %d of parameter %d of tensor %s after step %d" % (
                injected_faults.FLIPPED_BIT, index, self.names[which], t))

    def train_pushing(self, reg):
        """Mode ASYNC_ADAHESSIAN (docs/design.md §4.6), as the C++ trainer: every step pushes the
        gradient and the Hessian diagonal (rebound.torch.AdaHessian.estimate with the job's
        adahessian config and the C++ engine's z keys) with sequence = step; the server applies
        AdaHessian to the center; the trainer pulls the center every tau steps and at the end.
        The spec's optimizer is not used. No step log: a lost slot restarts from the center."""
        job = reg.job
        slot = reg.slot
        tau = job.easgd.sync_period
        max_steps = job.training.max_steps
        batch_size = job.data.batch_size
        seed = job.data.seed
        shard = shard_ids(len(self.spec.train_set), job.topology.replicas, slot.replica)
        if len(shard) == 0:
            raise _Exit(rebound.EXIT_CONFIG, "replica %d has no samples" % slot.replica)
        self.build(job, slot.replica)
        estimator = AdaHessian(self.params, kernels.AdaHessianConfig.from_proto(job.adahessian),
                               seed=seed, replica=slot.replica)

        def seek(step):
            zeros = [torch.zeros_like(p) for p in self.params]
            estimator.import_state(step, zeros, zeros, zeros)

        self.pull(reg, buffers=False)
        seek(reg.start_step)
        _log("training slot (%d, %d) on %d samples for steps %d..%d: pushing g and D every "
             "step, pulling the center every %d" % (slot.replica, slot.stage, len(shard),
                                                    reg.start_step + 1, max_steps, tau))
        t = reg.start_step
        progress = ProgressLine(slot, max_steps, batch_size, self.progress_interval_s)
        try:
            while t < max_steps:
                ended = self._begin_iteration(reg)
                if ended is not None:
                    return ended
                t += 1
                ids = batch_ids(shard, seed, slot.replica, t, batch_size)[0]
                torch.manual_seed(step_seed(seed, slot.replica, t))
                self.model.train()
                x, y = self._data(self.spec.train_set, ids)
                for p in self.params:
                    p.grad = None
                loss = self.spec.loss(self.model(x), y)
                loss.backward(create_graph=estimator.hessian_due())
                g, d = estimator.estimate()
                g, d = _over(self.tensors, self.params, g), _over(self.tensors, self.params, d)
                loss = float(loss.detach())
                if not math.isfinite(loss):
                    raise _Exit(rebound.EXIT_FAILED, "the loss of step %d is not finite" % t)
                response = self._guarded(lambda: self.center.push(
                    reg.incarnation, slot, t, t, g, d, loss))
                self.samples += batch_size
                pull_now = t % tau == 0 or t == max_steps
                if not response.applied and response.applied_sequence > t:
                    applied = min(response.applied_sequence, max_steps)
                    _log("the server has applied this slot's pushes through sequence %d: "
                         "skipping from step %d to step %d" % (response.applied_sequence, t,
                                                               applied + 1))
                    t = applied
                    seek(t)
                    pull_now = True
                self.session.set_progress(t, loss)
                progress.step(t, loss, response.weight)
                if pull_now:
                    self.pull(reg, buffers=False)
                    with self.session.lock:
                        drain = self.session.drain
                    if drain:
                        _log("drained: pushed step %d; leaving the slot" % t)
                        return "drained"
            _log("finished %d steps" % max_steps)
            return "finished"
        finally:
            self._end_iterations()

    # -- replay -----------------------------------------------------------------------------

    def spare(self, reg):
        """Waits for recovery tasks; returns the adopted trainer registration after a verified
        replay (REPLAY) or a takeover (RESTART_FROM_CENTER), or None when the work is over.
        Audit tasks are served on the way (``audit``): they take nothing over."""
        while not self.session.stop.is_set():
            current = self.session.current()
            if current.incarnation != reg.incarnation:
                return current, False  # a takeover from the center, by heartbeat
            if self.out_of_time():
                return None
            request = rebound_pb2.WaitForTaskRequest(incarnation=reg.incarnation, wait_ms=1000)
            try:
                response = self.conn.call("WaitForTask", request,
                                          deadline_s=self.options.rpc_deadline_s + 1.0,
                                          stop=self.session.stop)
            except rclient.CallError as error:
                if error.code.name in ("FAILED_PRECONDITION", "ABORTED"):
                    if self.session.wait_change(reg, 2.0):
                        continue
                    self.session.fenced(str(error))
                raise _Exit(rebound.EXIT_FAILED, str(error)) from None
            except rclient.Unreachable as error:
                raise _Exit(rebound.EXIT_UNREACHABLE, str(error)) from None
            except rclient.Stopped:
                return None
            if not response.HasField("task"):
                continue
            if response.task.audit:
                self.audit(reg, response.task)
                continue
            adopted = self.replay(reg, response.task)
            if adopted is not None:
                return adopted, True
        return None

    def replay_window(self, reg, task, interrupt=None):
        """Replays the window of ``task``, a recovery's or an audit's: the slot's model and
        optimizer from task.snapshot (step t0), then the logged steps (t0, task.failed_step]
        read with ReadLog naming the task, each step's parameters checked against the checksum
        the trainer logged. The first step that differs ends it, naming the first differing
        declared tensor (id order) when the log holds per-tensor checksums. ``interrupt``: None,
        or a function called before each step that returns why the replay must stop there (a
        word) or None to go on. Returns a _Replayed; raises what the calls raise
        (rclient.CallError, rclient.Unreachable)."""
        job = reg.job
        slot = task.slot
        t0 = task.snapshot.step
        tf = task.failed_step
        began = time.monotonic()
        result = _Replayed()
        self.build(job, slot.replica)
        # A sharded center's snapshot comes from its range groups.
        self.center.fill_snapshot(reg.incarnation, task.snapshot, self.tensors)
        for member in task.group_snapshots:
            self.center.fill_snapshot(reg.incarnation, member, self.tensors)
        if len(task.snapshot.params.tensors) > 0 or t0 > 0:
            self.set_params(wire.tensors_of(task.snapshot.params, self.tensors,
                                            "snapshot.params"))
        # else: step 0 without tensors, the model's initialisation, which build() made.
        try:
            _import_optimizer(self.optimizer, self.tensors, self.names, task.snapshot.optimizer,
                              t0)
        except optim_state.Unreplayable as why:
            result.failure = "step %d: cannot replay exactly: %s" % (t0, why)
            result.unreplayable = True
        self.seek_scheduler(t0)
        set_batches_tracked(self.model, t0)
        records = []
        if tf > t0 and result.failure is None:
            records = self.conn.stream("ReadLog", rebound_pb2.ReadLogRequest(
                incarnation=reg.incarnation, task_id=task.task_id, from_step=t0,
                to_step=tf), deadline_s=max(self.options.rpc_deadline_s, 60.0))
        loaded = time.monotonic()
        result.transfer_s = loaded - began
        steps = collections.defaultdict(dict)
        for record in records:
            steps[record.step][record.micro_batch] = record
        micro = max(1, job.data.micro_batches)
        for t in range(t0 + 1, tf + 1 if result.failure is None else t0 + 1):
            why = interrupt() if interrupt is not None else None
            if why is not None:
                result.failure = "%s after %d of %d steps" % (why, t - t0 - 1, tf - t0)
                result.interrupted = why
                break
            parts = steps.get(t, {})
            if -1 not in parts or any(k not in parts for k in range(micro)):
                result.failure = "the log lacks records of step %d" % t
                break
            ids = np.concatenate([np.asarray(parts[k].sample_ids, dtype=np.int64)
                                  for k in range(micro)])
            per_step = parts[-1]
            self.step(job, slot.replica, t, ids, per_step.rng_seed)
            total, each = _params_checksums(self.tensors)
            if total != per_step.params_checksum:
                mismatch = rebound_pb2.ReplayMismatch(
                    step=t, logged_checksum=per_step.params_checksum, replayed_checksum=total,
                    tensor_index=-1)
                which = "the parameters"
                logged = list(per_step.tensor_checksums)
                if len(logged) == len(each):
                    differing = [i for i, (a, b) in enumerate(zip(each, logged)) if a != b]
                    if differing:
                        mismatch.tensor_index = differing[0]
                        mismatch.tensor_name = self.names[differing[0]]
                        which = "tensor %d '%s'" % (differing[0], self.names[differing[0]])
                result.mismatch = mismatch
                result.failure = ("step %d: %s differs from the trainer's (checksum %016x, "
                                  "logged %016x)" % (t, which, total, per_step.params_checksum))
                break
            result.steps += 1
            result.final = total
        if result.failure is None and result.final is None:
            result.final = _params_checksums(self.tensors)[0]
        result.replay_s = time.monotonic() - loaded
        return result

    def replay(self, reg, task):
        job = reg.job
        slot = task.slot
        t0 = task.snapshot.step
        tf = task.failed_step
        _log("replay task %d: rebuilding slot (%d, %d) from step %d to %d" % (
            task.task_id, slot.replica, slot.stage, t0, tf))
        began = time.monotonic()
        report = rebound_pb2.ReportRecoveryRequest(incarnation=reg.incarnation,
                                                   task_id=task.task_id)
        verified = False
        try:
            replayed = self.replay_window(reg, task)
            report.steps_replayed = tf - t0 if replayed.failure is None else 0
            report.phases.snapshot_transfer_ms = int(replayed.transfer_s * 1000)
            report.phases.replay_ms = int(replayed.replay_s * 1000)
            if replayed.failure is not None:
                # A state the snapshot cannot restore exactly is a failed replay, reported as
                # such (the server falls back to RESTART_FROM_CENTER), not an exit; it is no
                # data loss (nothing differed): UNREPLAYABLE.
                report.outcome = (rebound_pb2.UNREPLAYABLE if replayed.unreplayable
                                  else rebound_pb2.CHECKSUM_MISMATCH)
                report.detail = replayed.failure
                if replayed.mismatch is not None:
                    report.mismatch.CopyFrom(replayed.mismatch)
                _log("replay task %d: %s; the server falls back to RESTART_FROM_CENTER" % (
                    task.task_id, replayed.failure))
            else:
                verified = True
                report.outcome = rebound_pb2.RECOVERED
                report.verified = True
                report.final_checksum = replayed.final
        except (rclient.CallError, rclient.Unreachable) as error:
            # Unreachable: a sharded center's range group, while its snapshot was read.
            report.outcome = rebound_pb2.ABANDONED
            report.detail = str(error)
            _log("replay task %d abandoned: %s" % (task.task_id, error))
        try:
            granted = self.conn.call("ReportRecovery", report, stop=self.session.stop)
        except rclient.CallError as error:
            _log("replay task %d: report refused: %s" % (task.task_id, error))
            return None
        except (rclient.Unreachable, rclient.Stopped) as error:
            raise _Exit(rebound.EXIT_UNREACHABLE, str(error)) from None
        if not verified or granted.incarnation == 0:
            return None
        adopted = rebound_pb2.RegisterResponse(
            incarnation=granted.incarnation, role=config_pb2.TRAINER, slot=granted.slot,
            job=job, start_step=tf)
        self.session.adopt(adopted)
        _log("took over slot (%d, %d) as incarnation %d at step %d: %d steps replayed and "
             "verified in %.2f s" % (granted.slot.replica, granted.slot.stage,
                                     granted.incarnation, tf, tf - t0, time.monotonic() - began))
        return adopted

    def audit(self, reg, task):
        """Serves the audit ``task`` (docs/recovery.md#audits): replays a live trainer's sync
        window exactly as a recovery (``replay_window``), reports with ReportAudit that every
        step matched the log (AUDIT_MATCHED), where the first differed (AUDIT_MISMATCHED), that
        the server's PREEMPT_AUDIT (or a takeover of this spare) stopped it before a step
        (AUDIT_PREEMPTED), or why it could not run to the end (AUDIT_INCOMPLETE), and takes
        nothing over. A report the server refuses (the audit is over without this spare) or
        that cannot reach it is logged, not fatal: the spare goes back to waiting for tasks."""
        t0 = task.snapshot.step
        tf = task.failed_step
        _log("audit %d: replaying steps %d..%d of slot (%d, %d) (trainer '%s')" % (
            task.task_id, t0 + 1, tf, task.slot.replica, task.slot.stage, task.audited_worker))
        report = rebound_pb2.ReportAuditRequest(incarnation=reg.incarnation,
                                                audit_id=task.task_id)

        def interrupt():
            if self.session.stop.is_set():
                return "stopped"
            if (self.session.audit_preempted() or
                    self.session.current().incarnation != reg.incarnation):
                return "preempted"
            return None

        # From here a PREEMPT_AUDIT stops it (and one left from an earlier audit does not).
        self.session.begin_audit()
        try:
            replayed = self.replay_window(reg, task, interrupt)
        except Exception as error:
            # Whatever else fails (a call, the log, the model) ends this audit, never the spare.
            replayed = _Replayed(failure="%s: %s" % (type(error).__name__, error))
        finally:
            self.session.end_audit()
        report.steps_replayed = replayed.steps
        if replayed.failure is None:
            report.result = rebound_pb2.AUDIT_MATCHED
            _log("audit %d: steps %d..%d of trainer '%s' match the log (%.2f s)" % (
                task.task_id, t0 + 1, tf, task.audited_worker,
                replayed.transfer_s + replayed.replay_s))
        else:
            if replayed.mismatch is not None:
                report.result = rebound_pb2.AUDIT_MISMATCHED
                report.mismatch.CopyFrom(replayed.mismatch)
            elif replayed.interrupted == "preempted":
                report.result = rebound_pb2.AUDIT_PREEMPTED
            else:
                report.result = rebound_pb2.AUDIT_INCOMPLETE
            report.detail = replayed.failure
            _log("audit %d of trainer '%s': %s: %s" % (
                task.task_id, task.audited_worker, rebound_pb2.AuditResult.Name(report.result),
                replayed.failure))
        try:
            self.conn.call("ReportAudit", report, stop=self.session.stop)
        except (rclient.CallError, rclient.Unreachable, rclient.Stopped) as error:
            # FAILED_PRECONDITION: the audit is over without this spare (or this spare is, which
            # the next WaitForTask tells); Unreachable: the next WaitForTask tells too. An audit
            # is no reason to end the spare.
            _log("audit %d: report not taken: %s" % (task.task_id, error))

    # -- evaluation -------------------------------------------------------------------------

    def evaluate(self, reg):
        job = reg.job
        if self.spec.test_set is None:
            raise _Exit(rebound.EXIT_CONFIG, "registered as EVALUATOR but the spec has no "
                        "test_set")
        self.build(job, 0)
        n = len(self.spec.test_set)
        if job.data.test_limit > 0:
            n = min(n, job.data.test_limit)
        period = job.training.eval_every_ms / 1000.0
        last_version = -1
        while True:
            # The job's end (STOP) gets one more evaluation: the last one reported is the final
            # center's.
            leaving = self.session.stop.is_set() or self.out_of_time()
            with self.session.lock:
                if leaving and not self.session.job_done:
                    break
            version = self.pull(reg)
            if version != last_version:
                last_version = version
                self.model.eval()
                total_loss = 0.0
                correct = 0.0  # None once a batch has no accuracy
                with torch.no_grad():
                    for begin in range(0, n, self.spec.eval_batch_size):
                        ids = np.arange(begin, min(n, begin + self.spec.eval_batch_size))
                        x, y = self._data(self.spec.test_set, ids)
                        out = self.model(x)
                        total_loss += float(self.spec.loss(out, y)) * len(ids)
                        right = _batch_accuracy(self.spec, out, y)
                        correct = None if right is None or correct is None else (
                            correct + right * len(ids))
                loss = total_loss / max(1, n)
                request = rebound_pb2.ReportEvalRequest(
                    incarnation=reg.incarnation, stage=0, center_version=version,
                    test_loss=loss)
                if correct is not None:
                    request.test_accuracy = min(1.0, max(0.0, correct / max(1, n)))
                if math.isfinite(loss):
                    self._call("ReportEval", request)
                _log("evaluated center version %d: test loss %.4f%s" % (
                    version, loss, " accuracy %.4f" % request.test_accuracy
                    if request.HasField("test_accuracy") else ""))
            if leaving:
                break
            self.session.stop.wait(period)
        return "stopped"

    # -- the end ---------------------------------------------------------------------------

    def wait_for_job_end(self):
        """A trainer done with its slot: waits, heartbeating, until every slot is done (the
        server's STOP) or max_seconds pass. True if the job finished."""
        while not self.session.stop.wait(0.05):
            if self.out_of_time():
                break
        with self.session.lock:
            return self.session.job_done

    def final_model(self, first_reg, why_not):
        """(model, center version, reason) for RunResult: the process's model (a spare that
        never trained builds one) holding the center, read with this worker's Pull (a worker
        call: no operator token; a sharded center gathered from its ranges); (None, None, why)
        when the job did not finish (``why_not``) or the center cannot be read. Call before
        deregistering. ``first_reg``: the registration's answer, which names the range groups."""
        with self.session.lock:
            finished = self.session.job_done
        if not finished:
            return None, None, why_not
        model = self.model
        if model is None:
            torch.manual_seed(self.spec.init_seed)
            model = self.spec.model()
        tensors = declared_tensors(model)[1]
        # The session's stop event is set by now; the final read gets its own, so that its
        # retries are not cut short.
        center = center_for(self.conn, first_reg, threading.Event())
        try:
            values, version = center.pull(self.session.current().incarnation, tensors)
        except (rclient.CallError, rclient.Unreachable, ValueError) as error:
            return None, None, "the final center could not be read: %s" % error
        finally:
            center.close()
        with torch.no_grad():
            for p, v in zip(tensors, values):
                p.copy_(v)
        for p in model.parameters():
            p.grad = None  # AdaHessian's create_graph left a graph there
        model.eval()
        return model, version, ""


def _model_declaration(spec, init_seed=None):
    """The RegisterRequest.model of the spec's model: its declared tensors (every parameter,
    then every float32 buffer: ``declared_tensors``) in order, with their initial values (the
    factory called after torch.manual_seed(init_seed))."""
    if init_seed is not None:
        torch.manual_seed(init_seed)
    model = spec.model()
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            raise _Exit(rebound.EXIT_CONFIG, "parameter '%s' is %s; Rebound trains float32 "
                        "parameters" % (name, p.dtype))
    if not list(model.parameters()):
        raise _Exit(rebound.EXIT_CONFIG, "the model has no parameters")
    names, tensors = declared_tensors(model)
    return wire.bundle_of(tensors, names)


def load_worker_config(path):
    """A WorkerConfig (.pbtxt, the rebound_worker format, docs/config.md#workerconfig) from
    ``path``. Raises ConfigError naming the file, line and column of a parse error, or the
    field of a value out of range."""
    from google.protobuf import text_format
    try:
        with open(path) as f:
            text = f.read()
    except OSError as error:
        raise ConfigError("%s: %s" % (path, error.strerror)) from None
    config = config_pb2.WorkerConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as error:
        raise ConfigError("%s:%s" % (path, error)) from None
    for field, low in (("rpc_deadline_ms", 10), ("backoff_initial_ms", 1),
                       ("give_up_after_ms", 0)):
        if getattr(config, field) < low:
            raise ConfigError("%s: %s must be >= %d, got %d" % (path, field, low,
                                                               getattr(config, field)))
    if config.backoff_max_ms < config.backoff_initial_ms:
        raise ConfigError("%s: backoff_max_ms must be >= backoff_initial_ms" % path)
    if config.security.HasField("tls"):
        raise ConfigError("%s: security.tls is not supported by the Python client yet "
                          "(docs/python.md#limits)" % path)
    token_file = config.security.token_file
    if token_file and not os.path.isabs(token_file):
        token_file = os.path.join(os.path.dirname(os.path.abspath(path)), token_file)
    return config, token_file


def run(spec, server=None, name=None, role=None, config=None, token_file=None, job_id=None,
        max_seconds=None, rpc_deadline_s=None, give_up_after_s=None, exit=False):
    """Runs this process as a worker of the job served at ``server`` until the job ends, the
    server fences it, or ``max_seconds`` pass. ``config``: a WorkerConfig file (the
    rebound_worker format: server_address, name, role, rpc_deadline_ms, backoff_initial_ms,
    backoff_max_ms, give_up_after_ms, job_id, security.token_file); the keyword arguments
    override it. ``role``: None (the server decides), "trainer", "spare" or "evaluator".

    Returns a RunResult: the exit code (rebound.EXIT_*; the RunResult is that int) and, when the
    job finished, the spec's model holding the final center (``result.model``,
    ``result.center_version``). A trainer done with its slot waits, heartbeating, for the other
    slots (at most until ``max_seconds``), so that the center it returns is the final one. torch's
    thread count and deterministic-algorithms switch are restored before it returns.

    ``exit=True``: ends the process with the code instead (``os._exit``, at once: a trainer does
    not wait for the others, nothing reads the final center), as a worker process under a
    supervisor wants. A fenced worker (code 3) ends the process at once either way; what the
    heartbeat and step-log threads learn (4, 5, 1) stops the work and is returned, or, with
    ``exit=True``, ends the process at once.
    Prints ``rebound-torch: trained N samples in S s`` at the end."""
    code = rebound.EXIT_OK
    reason = ""
    roles = {None: config_pb2.ROLE_UNSPECIFIED, "trainer": config_pb2.TRAINER,
             "spare": config_pb2.SPARE, "evaluator": config_pb2.EVALUATOR}
    role_names = {config_pb2.TRAINER: "trainer", config_pb2.SPARE: "spare",
                  config_pb2.EVALUATOR: "evaluator"}
    torch_threads = torch.get_num_threads()
    torch_deterministic = torch.are_deterministic_algorithms_enabled()
    conn = None
    session = None
    center = None
    worker = None
    final = (None, None, "")
    signalled = []  # the SIGTERM or SIGINT that stops this worker, once one came

    def on_signal(signum, frame):
        # Only flags: the step in progress (main thread) completes, syncs or not as it would,
        # and the loop ends at the next step's start; the work then deregisters and returns 0.
        # A second signal finds the previous handlers again (the default: end the process).
        signalled.append(signal.Signals(signum).name)
        _log("%s: stopping after the current step, deregistering" % signalled[0])
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        if session is not None:
            session.stop.set()

    previous_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous_handlers[sig] = signal.signal(sig, on_signal)
    try:
        if config is not None:
            worker_config, config_token = load_worker_config(config)
        else:
            worker_config, config_token = config_pb2.WorkerConfig(), ""
        roles_by_enum = {config_pb2.ROLE_UNSPECIFIED: None, config_pb2.TRAINER: "trainer",
                         config_pb2.SPARE: "spare", config_pb2.EVALUATOR: "evaluator"}
        if role is None:
            role = roles_by_enum[worker_config.role]
        if role not in roles:
            raise _Exit(rebound.EXIT_CONFIG, "role must be trainer, spare or evaluator, got %r"
                        % (role,))
        if spec.scheduler_interval not in ("step", "epoch"):
            raise _Exit(rebound.EXIT_CONFIG, "the spec's scheduler_interval must be \"step\" or "
                        "\"epoch\", got %r" % (spec.scheduler_interval,))
        token_file = token_file or config_token
        token = ""
        if token_file:
            try:
                with open(token_file) as f:
                    token = f.readline().strip()
            except OSError as error:
                raise _Exit(rebound.EXIT_CONFIG, "token_file %s: %s" % (token_file,
                                                                        error.strerror))
        options = rclient.Options(
            server=server or worker_config.server_address, token=token,
            rpc_deadline_s=(rpc_deadline_s if rpc_deadline_s is not None
                            else worker_config.rpc_deadline_ms / 1000.0),
            backoff_initial_s=worker_config.backoff_initial_ms / 1000.0,
            backoff_max_s=worker_config.backoff_max_ms / 1000.0,
            give_up_after_s=(give_up_after_s if give_up_after_s is not None
                             else worker_config.give_up_after_ms / 1000.0))
        job_id = job_id if job_id is not None else worker_config.job_id
        name = name or worker_config.name or "%s-%d" % (socket.gethostname(), os.getpid())
        conn = rclient.Connection(options)
        declaration = _model_declaration(spec, init_seed=spec.init_seed)
        # Testing only (rebound.torch.injected_faults): read once, before registering.
        bit_flips = injected_faults.BitFlips.from_environment(os.environ)
        if bit_flips:
            _log("fault injection (testing only): bit %d of one parameter flips after step %d%s"
                 % (injected_faults.FLIPPED_BIT, bit_flips.at_step,
                    " and every %d steps after it" % bit_flips.repeat_every
                    if bit_flips.repeat_every else ""))
        # audits: this runner's spare loop serves audit tasks (_Worker.audit).
        session = membership.Session(conn, options, declaration, name, roles[role], job_id,
                                     exit_at_once=exit, audits=True)
        if signalled:
            raise rclient.Stopped("stopped by %s before registering" % signalled[0])
        first_reg = reg = session.register()
        job = reg.job
        torch.set_num_threads(max(1, job.compute.threads))
        torch.use_deterministic_algorithms(True)
        center = center_for(conn, reg, session.stop)
        session.start()
        worker = _Worker(spec, session, conn, center, options, max_seconds)
        worker.progress_interval_s = worker_config.progress_interval_s
        worker.bit_flips = bit_flips
        adopted = None
        replayed = False
        def stopped_early():
            return ("stopped by %s before the job finished" % signalled[0] if signalled
                    else "max_seconds passed before the job finished")

        while True:
            reg = session.current()
            if reg.role == config_pb2.TRAINER:
                # The job's start barrier (bounded by the server's start_barrier_ms; this bound
                # covers a server that stops answering meanwhile).
                limit_s = (reg.job.topology.start_barrier_ms +
                           2 * reg.job.fault_tolerance.heartbeat_interval_ms) / 1000.0 + \
                    options.rpc_deadline_s
                if not session.wait_for_start(limit_s):
                    if not exit:
                        final = worker.final_model(first_reg, stopped_early())
                    session.deregister()
                    break
                outcome = worker.train(reg, replayed)
                if outcome == "replaced":
                    continue
                if not exit:
                    if outcome == "finished":
                        worker.wait_for_job_end()
                    final = worker.final_model(first_reg, "drained before the job finished"
                                               if outcome == "drained" else stopped_early())
                session.deregister(drained=outcome == "drained")
                break
            if reg.role == config_pb2.EVALUATOR:
                worker.evaluate(reg)
                if not exit:
                    final = worker.final_model(first_reg, stopped_early())
                session.deregister()
                break
            result = worker.spare(reg)
            if result is None:
                if not exit:
                    final = worker.final_model(first_reg, stopped_early())
                session.deregister()
                break
            adopted, replayed = result
    except _Exit as stop:
        code, reason = stop.code, str(stop)
        _log(reason)
        if session is not None and code != rebound.EXIT_FENCED:
            session.deregister()
    except rclient.Stopped as error:
        # A call's retries cut short by the stop event (a signal, the server's STOP): leaving
        # is what was asked.
        reason = str(error)
        if session is not None:
            session.deregister()
    except (rclient.Unreachable,) as error:
        code, reason = rebound.EXIT_UNREACHABLE, str(error)
        _log(reason)
    except (ValueError, ConfigError) as error:
        code, reason = rebound.EXIT_CONFIG, str(error)
        _log(reason)
    finally:
        if session is not None:
            session.stop.set()
        if center is not None:
            center.close()
    if session is not None and session.ended is not None:
        # The heartbeat or step-log thread ended the work (exit=False): its code and reason.
        code, reason = session.ended
    if worker is not None:
        print("rebound-torch: trained %d samples in %.3f s" % (worker.samples, worker.training_s),
              flush=True)
    if exit:  # at once, as the handlers would have the process end
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    # Returning: leave nothing running behind the caller's code. The heartbeat thread ends after
    # its call in flight, since deregister set the session's stop.
    if session is not None:
        session.join(timeout=options.rpc_deadline_s + 1.0)
    if conn is not None:
        conn.close()
    torch.set_num_threads(torch_threads)
    torch.use_deterministic_algorithms(torch_deterministic)
    for sig, handler in previous_handlers.items():
        signal.signal(sig, handler)
    model, version, why_not = final
    current = session.current() if session is not None else None
    return RunResult(
        code, model=model, center_version=version,
        job_finished=session is not None and session.job_done,
        reason=reason or why_not, role=role_names.get(current.role) if current else None,
        slot=((current.slot.replica, current.slot.stage)
              if current is not None and current.HasField("slot") else None),
        samples=worker.samples if worker else 0,
        training_s=worker.training_s if worker else 0.0)
