"""Any torch.optim.Optimizer's state in the protocol's OptimizerState (step, m, v, last_hdiag),
read and written through the optimizer's own per-parameter state (what ``state_dict()`` holds),
so that a spare resumes a lost trainer's optimizer exactly (docs/python.md#optimizers).

The snapshot has room for one integer and three tensors of each declared tensor's shape (the
server checks every optimizer bundle against the model's layout), so a parameter's state maps
onto it by one rule, the same on the trainer and on the spare:

* the entry ``step`` (an int or a one-element float tensor, equal for every parameter) is
  OptimizerState.step; an optimizer without one sends the training step;
* an entry that is None (SGD without momentum) stays None;
* every other entry is a *part*, in the order the optimizer created them: a float32 tensor of the
  parameter's shape as it is, a float32 tensor of one element (NAdam's mu_product, ASGD's eta
  and mu) filled into the parameter's shape (float32 to float32: exact); parts 1, 2, 3 are
  m, v, last_hdiag. Adam's (exp_avg, exp_avg_sq) and SGD's momentum_buffer land where they always
  did, so snapshots written before this rule read the same.

A declared tensor that the optimizer does not hold (a buffer, a frozen parameter) gets zeros.
Anything else (a fourth part, a Python float, another dtype, parameters with unequal steps or
only some with state, an optimizer whose step needs a closure) has no exact place: the trainer
sends the step alone, and a spare's ``restore`` raises Unreplayable naming it, which the runner
reports as a failed replay (the server falls back to RESTART_FROM_CENTER).

The spare learns the layout of the state (its entries, their kinds and order) without the
trainer: it steps a deep copy of its freshly built optimizer once on zero gradients, so the rule
needs no table of optimizer classes and applies to user-written optimizers too.
"""

import copy

import torch

from rebound.torch import wire
from rebound_pb import rebound_pb2

PARTS = ("m", "v", "last_hdiag")


class Unreplayable(Exception):
    """The optimizer's state has no exact place in the snapshot: a replay cannot reproduce the
    trainer; the message says what does not fit."""


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _classify(state, param, where):
    """[(key, kind, template)] of one parameter's state: kind "step", "none" or "part"
    (template: the entry, for its shape and type). Raises Unreplayable for an entry that has
    no exact place."""
    entries = []
    for key, value in state.items():
        if key == "step":
            if isinstance(value, bool) or not isinstance(value, (int, torch.Tensor)):
                raise Unreplayable("%s: its state 'step' is a %s" % (where, type(value).__name__))
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise Unreplayable("%s: its state 'step' has %d elements" % (where, value.numel()))
            entries.append((key, "step", value))
        elif value is None:
            entries.append((key, "none", None))
        elif isinstance(value, torch.Tensor) and value.dtype == torch.float32 and (
                value.shape == param.shape or value.numel() == 1):
            entries.append((key, "part", value))
        else:
            described = ("a %s tensor of shape %s" % (value.dtype, list(value.shape))
                         if isinstance(value, torch.Tensor) else "a %s" % type(value).__name__)
            raise Unreplayable("%s: its state '%s' is %s, which the snapshot (float32 tensors "
                               "of the parameter's shape, one-element float32 tensors, an "
                               "integer step) cannot hold" % (where, key, described))
    parts = [key for key, kind, _ in entries if kind == "part"]
    if len(parts) > len(PARTS):
        raise Unreplayable("%s: its state has %d tensors (%s); the snapshot holds %d" % (
            where, len(parts), ", ".join(parts), len(PARTS)))
    return entries


def _step_value(value):
    return int(value) if isinstance(value, int) else int(value.reshape(-1)[0].item())


def export(optimizer, tensors, names, step):
    """The OptimizerState of ``optimizer`` for the declared ``tensors`` (parameters and buffers,
    in declaration order; ``names`` for the error messages) after training step ``step``: its
    step and its parts (module doc). Returns (message, why): ``why`` is None when the message
    holds the whole state, else why a replay from it cannot be exact (then the message holds the
    step alone)."""
    message = rebound_pb2.OptimizerState(step=int(step))
    held = {id(p) for p in _optimizer_params(optimizer)}
    layouts = []
    steps = set()
    try:
        for t, name in zip(tensors, names):
            if id(t) not in held:
                layouts.append(None)
                continue
            state = optimizer.state.get(t, {})
            entries = _classify(state, t, "parameter '%s'" % name)
            layouts.append(entries)
            steps.update(_step_value(v) for _, kind, v in entries if kind == "step")
        kinds = {tuple((k, kind) for k, kind, _ in e) for e in layouts if e is not None}
        if len(kinds) > 1:
            raise Unreplayable("its parameters hold different state entries (%s): some had no "
                               "gradient in some step" % " / ".join(
                                   sorted(",".join(k for k, _ in e) or "none" for e in kinds)))
        if len(steps) > 1:
            raise Unreplayable("its parameters are at different steps %s: some had no "
                               "gradient in some step" % sorted(steps))
    except Unreplayable as why:
        return message, str(why)
    if steps:
        message.step = steps.pop()
    count = max((sum(1 for _, kind, _ in e if kind == "part") for e in layouts if e is not None),
                default=0)
    for k in range(count):
        values = []
        for t, entries in zip(tensors, layouts):
            if entries is None:
                values.append(torch.zeros_like(t))
                continue
            part = [v for _, kind, v in entries if kind == "part"][k].detach()
            values.append(part.clone() if part.shape == t.shape
                          else torch.full_like(t, float(part.reshape(-1)[0].item())))
        getattr(message, PARTS[k]).CopyFrom(wire.bundle_of(values))
    return message, None


def _layout_after_one_step(optimizer):
    """[(key, kind, template)] per parameter of ``optimizer`` (param_groups order) as its state
    will be after a step: found by stepping a deep copy on zero gradients."""
    shadow = copy.deepcopy(optimizer)
    params = _optimizer_params(shadow)
    for p in params:
        p.grad = torch.zeros_like(p)
    with torch.random.fork_rng(devices=[]):
        try:
            # The class's step: an instance's own `step` attribute (an LR scheduler's counting
            # wrapper) still refers to the original optimizer and would step that one.
            type(shadow).step(shadow)
        except Exception as error:  # a closure needed (LBFGS), sparse gradients only, ...
            raise Unreplayable("stepping it on zero gradients failed (%s: %s)" % (
                type(error).__name__, error)) from None
    return [_classify(shadow.state.get(p, {}), p, "parameter %d" % i)
            for i, p in enumerate(params)]


def restore(optimizer, tensors, names, message, snapshot_step):
    """Loads the OptimizerState ``message`` of a snapshot at ``snapshot_step`` into the freshly
    built ``optimizer`` over the declared ``tensors``. Raises Unreplayable when the snapshot
    cannot hold this optimizer's state exactly (module doc)."""
    what = type(optimizer).__name__
    try:
        layouts = _layout_after_one_step(optimizer)
    except Unreplayable as why:
        raise Unreplayable("the optimizer %s: %s" % (what, why)) from None
    index = {id(p): i for i, p in enumerate(_optimizer_params(optimizer))}
    count = max((sum(1 for _, kind, _ in e if kind == "part") for e in layouts), default=0)
    present = [name for name in PARTS if len(getattr(message, name).tensors) > 0]
    if snapshot_step == 0 and not present:
        return  # the model's initialisation: the fresh optimizer is the state at step 0
    if len(present) < count:
        raise Unreplayable("the optimizer %s keeps %d state tensors per parameter, the snapshot "
                           "holds %d: the trainer could not export its state (its log says why)"
                           % (what, count, len(present)))
    parts = [wire.tensors_of(getattr(message, PARTS[k]), tensors, "optimizer." + PARTS[k])
             for k in range(count)]
    for i, (t, name) in enumerate(zip(tensors, names)):
        if id(t) not in index:
            continue
        state = {}
        k = 0
        for key, kind, template in layouts[index[id(t)]]:
            if kind == "step":
                state[key] = (int(message.step) if isinstance(template, int)
                              else torch.full_like(template, float(message.step)))
            elif kind == "none":
                state[key] = None
            else:
                value = parts[k][i]
                k += 1
                state[key] = (value if template.shape == t.shape
                              else value.reshape(-1)[:1].reshape(template.shape).clone())
        optimizer.state[t] = state
