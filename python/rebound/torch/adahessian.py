"""rebound.torch.AdaHessian: the AdaHessian optimizer of docs/design.md §4.3 as a torch.optim.Optimizer,
computing what the C++ engine computes for the same gradients and Hessian-vector products.

How to drive it (one step = one call of step(), the global step t counts them, 1-based):

    opt = AdaHessian(model.parameters(), AdaHessianConfig(...), seed=job_seed, replica=r)
    for batch in data:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(batch))
        loss.backward(create_graph=opt.hessian_due())   # the caller runs backward
        opt.step()

  * The caller runs loss.backward(create_graph=True) before step() whenever hessian_due() is
    true (always doing so is also fine, only slower); alternatively step(closure) calls
    closure() under torch.enable_grad(), and the closure must do the same (zero the grads, compute
    the loss, call loss.backward(create_graph=...)) and return the loss. step() raises
    RuntimeError when a fresh D is due and no gradient has a graph.
  * step() applies step t = step_count + 1: on HessianDue(t, hessian_every) it draws, for the
    parameter with index i (its position over the param groups in order, 0..n-1),
    z_i = Rademacher(seed, replica, step t, tensor_id i, kRngHutchinson) (python/rebound/rng.py,
    row-major element index), computes Hz by double backward (torch.autograd.grad of the
    gradients with grad_outputs = z), and D_i = z_i * (H z)_i, block-averaged along the last
    dimension if block_size > 1 (compute::BlockAverageRows; a 1-d tensor is one row) and kept as
    last_hdiag; otherwise it reuses last_hdiag. Then every parameter with a gradient gets the
    element update of kernels.adahessian_update_ with the scalars of step t (lr schedule at t).
    Parameters whose .grad is None are skipped (no state change), as torch optimizers do; the
    C++ engine updates every tensor, so give every parameter a gradient for parity.
  * set_rng(seed, replica) sets the Hutchinson key (uint64 seed, uint32 replica); it is part of
    state_dict().
  * export_state() -> (step, [m], [v], [last_hdiag]) and import_state(step, m, v, last_hdiag)
    carry the protocol's OptimizerState: step = t of the last applied step, m/v/last_hdiag =
    float32 tensors in parameter order (tensor id i = list position i). After import_state, the
    next step() is step + 1 and reproduces what the exporter's next step would have done.

Each param group may override any AdaHessianConfig field (torch's usual per-group options); the
global step t and the RNG key are shared by all groups. Not thread-safe (like torch optimizers).
"""

import dataclasses

import torch

from rebound import rng
from rebound.torch import kernels
from rebound.torch.kernels import AdaHessianConfig

_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(AdaHessianConfig))


class AdaHessian(torch.optim.Optimizer):
    """AdaHessian with a Hutchinson diagonal drawn from Rebound's counter-based RNG."""

    def __init__(self, params, config=None, *, seed=0, replica=0, **overrides):
        """config: an AdaHessianConfig or a protobuf AdaHessianConfig (None = the defaults);
        overrides: field=value replacing config fields (e.g. lr=0.1). ValueError for values out
        of range (the ranges of compute::ValidateAdaHessianConfig)."""
        base = AdaHessianConfig() if config is None else AdaHessianConfig.from_any(config)
        unknown = set(overrides) - set(_CONFIG_FIELDS)
        if unknown:
            raise TypeError(f"AdaHessian: unknown options {sorted(unknown)}")
        base = dataclasses.replace(base, **overrides).validate()
        self._step_count = 0
        self._seed = 0
        self._replica = 0
        super().__init__(params, dataclasses.asdict(base))
        self.set_rng(seed, replica)
        for p in self._params():
            self._state_of(p)

    # ---- configuration ---------------------------------------------------------------------------

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._group_config(group).validate()
        for p in group["params"]:
            if p.dtype != torch.float32 or p.device.type != "cpu":
                raise TypeError("AdaHessian: parameters must be float32 CPU tensors")

    @staticmethod
    def _group_config(group):
        return AdaHessianConfig(**{name: group[name] for name in _CONFIG_FIELDS})

    def set_rng(self, seed, replica):
        """The Hutchinson key's job seed (uint64) and replica (uint32) for every later step."""
        seed, replica = int(seed), int(replica)
        if not 0 <= seed < 2**64 or not 0 <= replica < 2**32:
            raise ValueError(f"AdaHessian.set_rng: seed {seed} or replica {replica} out of range")
        self._seed, self._replica = seed, replica

    @property
    def rng_key(self):
        """(seed, replica) of the Hutchinson draws."""
        return self._seed, self._replica

    @property
    def step_count(self):
        """t of the last applied step (0 before the first)."""
        return self._step_count

    def hessian_due(self):
        """True iff the next step() (t = step_count + 1) computes a fresh D in some group, i.e.
        the caller must run backward(create_graph=True) first."""
        t = self._step_count + 1
        return any(kernels.hessian_due(t, g["hessian_every"]) for g in self.param_groups)

    # ---- state -----------------------------------------------------------------------------------

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _state_of(self, p):
        state = self.state[p]
        if "m" not in state:
            state["m"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["v"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["last_hdiag"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state

    def export_state(self):
        """(step, [m], [v], [last_hdiag]): copies, float32, in parameter order."""
        params = self._params()
        states = [self._state_of(p) for p in params]
        return (self._step_count, [s["m"].detach().clone() for s in states],
                [s["v"].detach().clone() for s in states],
                [s["last_hdiag"].detach().clone() for s in states])

    def import_state(self, step, m, v, last_hdiag):
        """Replaces the state by an exported one (copies it). ValueError if a list's length, a
        shape or the step (>= 0) does not fit; TypeError for a non-float32 tensor; nothing
        changes then."""
        step = int(step)
        params = self._params()
        if step < 0:
            raise ValueError(f"AdaHessian.import_state: step {step} < 0")
        for name, values in (("m", m), ("v", v), ("last_hdiag", last_hdiag)):
            if len(values) != len(params):
                raise ValueError(f"AdaHessian.import_state: {len(values)} {name} tensors for "
                                 f"{len(params)} parameters")
            for i, (value, p) in enumerate(zip(values, params)):
                if not isinstance(value, torch.Tensor) or value.dtype != torch.float32:
                    raise TypeError(f"AdaHessian.import_state: {name}[{i}] is not float32")
                if value.shape != p.shape:
                    raise ValueError(f"AdaHessian.import_state: {name}[{i}] has shape "
                                     f"{tuple(value.shape)}, parameter {tuple(p.shape)}")
        for i, p in enumerate(params):
            state = self._state_of(p)
            with torch.no_grad():
                state["m"].copy_(m[i])
                state["v"].copy_(v[i])
                state["last_hdiag"].copy_(last_hdiag[i])
        self._step_count = step

    def state_dict(self):
        result = super().state_dict()
        result["rebound"] = {"step": self._step_count, "seed": self._seed,
                             "replica": self._replica}
        return result

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        extra = state_dict.pop("rebound")
        super().load_state_dict(state_dict)
        self.set_rng(extra["seed"], extra["replica"])
        self._step_count = int(extra["step"])
        for p in self._params():
            self._state_of(p)

    # ---- the step --------------------------------------------------------------------------------

    def _fresh_hdiag(self, t, due):
        """D = z * (H z) for the (index, param, group) entries in `due`, via double backward."""
        outputs, zs, inputs = [], [], []
        z_of = {}
        for index, p, _ in due:
            z = rng.rademacher_tensor(self._seed, self._replica, t, index, p.shape)
            z_of[index] = z
            inputs.append(p)
            if p.grad.requires_grad:
                outputs.append(p.grad)
                zs.append(z)
        if not outputs:
            raise RuntimeError(
                "AdaHessian: step %d needs a fresh Hessian diagonal but no gradient has a graph: "
                "call loss.backward(create_graph=True) before step() when hessian_due()" % t)
        hz = torch.autograd.grad(outputs, inputs, grad_outputs=zs, allow_unused=True)
        result = []
        for (index, p, group), hz_i in zip(due, hz):
            z = z_of[index]
            hz_i = torch.zeros_like(z) if hz_i is None else hz_i.detach().reshape(z.shape)
            d = z * hz_i.to(torch.float32)
            block = int(group["block_size"])
            if block > 1 and d.numel() > 0:
                cols = d.shape[-1] if d.dim() >= 1 else 1
                kernels.block_average_rows_(d, d.numel() // cols, cols, block)
            result.append(d)
        return result

    def _entries_and_hdiag(self, t):
        """The (index, param, group) entries with a gradient; refreshes last_hdiag of those whose
        D is due at step t."""
        entries = []
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise RuntimeError("AdaHessian does not support sparse gradients")
                    entries.append((index, p, group))
                index += 1
        due = [e for e in entries if kernels.hessian_due(t, e[2]["hessian_every"])]
        if due:
            with torch.enable_grad():
                fresh = self._fresh_hdiag(t, due)
            for (_, p, _), d in zip(due, fresh):
                self._state_of(p)["last_hdiag"].copy_(d)
        return entries

    def estimate(self):
        """Step t = step_count + 1 without the update (mode ASYNC_ADAHESSIAN: the server applies
        AdaHessian to the center): returns ([g], [D]) in parameter order, D fresh or reused as
        step() would, and counts the step. Every parameter needs a gradient."""
        t = self._step_count + 1
        entries = self._entries_and_hdiag(t)
        params = self._params()
        if len(entries) != len(params):
            raise RuntimeError("AdaHessian.estimate: every parameter needs a gradient")
        self._step_count = t
        return ([p.grad.detach().clone() for _, p, _ in entries],
                [self._state_of(p)["last_hdiag"].clone() for _, p, _ in entries])

    def step(self, closure=None):
        """Applies step t = step_count + 1 (see the module comment); returns closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._step_count + 1
        entries = self._entries_and_hdiag(t)
        scalars = {}
        with torch.no_grad():
            for _, p, group in entries:
                key = id(group)
                if key not in scalars:
                    scalars[key] = kernels.adahessian_scalars(self._group_config(group), t)
                state = self._state_of(p)
                theta = p.data
                kernels.adahessian_update_(scalars[key], p.grad.detach(), state["last_hdiag"],
                                           state["m"], state["v"], theta)
        self._step_count = t
        return loss
