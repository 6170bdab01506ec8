"""float32 element math of the C++ engine in torch, bit-identical to compute/adahessian.cc and
compute/elementwise_math.h (built with -ffp-contract=off).

Contract: every element result equals the C++ one bit for bit on CPU float32 tensors. Each
arithmetic step is its own torch op on float32 operands (scalars as 0-d float32 tensors), so every
intermediate is rounded to float32 exactly as in C++; no fused forms (add(alpha=), addcmul,
addcdiv, lerp) are used, since those may round once for a*b+c. Scalar coefficients are computed in
double (Python float) and rounded to float32 once (MakeAdaHessianScalars). powf for a Hessian power
k other than 0 and 1 calls the C library's powf element by element (slow, exact like C++).

API:
  AdaHessianConfig                  dataclass with proto AdaHessianConfig's fields and defaults;
                                    .from_proto(msg), .validate() (ValueError naming the field)
  hessian_due(t, hessian_every)     compute::HessianDue
  learning_rate(config, t)          compute::LearningRate, a Python float (double)
  adahessian_scalars(config, t, weight=1.0) -> AdaHessianScalars   MakeAdaHessianScalars
  adahessian_update_(scalars, g, d, m, v, theta)   AdaHessianElement on every element, in place
  block_average_rows_(d, rows, cols, block_size)   compute::BlockAverageRows, in place
  elastic_move(y, toward, rate)     ElasticMoveElement: y + rate * (toward - y), a new tensor
  elastic_pull_worker(x, c_before, alpha)   ElasticPullWorker: elastic_move(x, c_before, f32(alpha))
  center_move_rate(alpha, weight)   CenterMoveRate: float32(alpha * weight)
  elastic_move_center(center, x, alpha, weight)   ElasticMoveCenter, a new tensor
Tensors must be float32 CPU tensors of equal shapes (ValueError/TypeError otherwise).
"""

import ctypes
import ctypes.util
import dataclasses
import math

import numpy as np
import torch

LR_CONSTANT = 1
LR_COSINE = 2
LR_LINEAR = 3
LR_STEP = 4

_FIELDS = ("lr", "beta1", "beta2", "epsilon", "hessian_power", "weight_decay", "hessian_every",
           "block_size", "warmup_steps", "lr_decay", "decay_steps", "final_lr_fraction",
           "step_every", "step_gamma")
_INT_FIELDS = ("hessian_every", "block_size", "warmup_steps", "lr_decay", "decay_steps",
               "step_every")


@dataclasses.dataclass
class AdaHessianConfig:
    """proto AdaHessianConfig (proto/config.proto) with the same defaults.

    decay_steps must already be resolved (0 = off for the schedule; the C++ side resolves 0 to
    the job's length in common/config.h EffectiveAdaHessianConfig).
    """

    lr: float = 0.15
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-4
    hessian_power: float = 1.0
    weight_decay: float = 0.0
    hessian_every: int = 1
    block_size: int = 0
    warmup_steps: int = 0
    lr_decay: int = LR_CONSTANT
    decay_steps: int = 0
    final_lr_fraction: float = 0.0
    step_every: int = 0
    step_gamma: float = 0.1

    @classmethod
    def from_proto(cls, msg):
        """Reads the fields by attribute name from a protobuf AdaHessianConfig (or any object)."""
        values = {}
        for name in _FIELDS:
            value = getattr(msg, name)
            values[name] = int(value) if name in _INT_FIELDS else float(value)
        return cls(**values)

    @classmethod
    def from_any(cls, config):
        """`config` itself if it is an AdaHessianConfig, else from_proto(config)."""
        return config if isinstance(config, cls) else cls.from_proto(config)

    def validate(self):
        """ValueError naming the field unless the ranges of ValidateAdaHessianConfig hold."""
        def bad(field, rng, value):
            raise ValueError(f"adahessian.{field} must be {rng}, got {value}")
        if not self.lr > 0.0:
            bad("lr", "> 0", self.lr)
        if not 0.0 <= self.beta1 < 1.0:
            bad("beta1", "in [0, 1)", self.beta1)
        if not 0.0 <= self.beta2 < 1.0:
            bad("beta2", "in [0, 1)", self.beta2)
        if not self.epsilon > 0.0:
            bad("epsilon", "> 0", self.epsilon)
        if not 0.0 <= self.hessian_power <= 1.0:
            bad("hessian_power", "in [0, 1]", self.hessian_power)
        if not self.weight_decay >= 0.0:
            bad("weight_decay", ">= 0", self.weight_decay)
        if self.hessian_every < 1:
            bad("hessian_every", ">= 1", self.hessian_every)
        if self.block_size < 0:
            bad("block_size", ">= 0", self.block_size)
        if self.warmup_steps < 0:
            bad("warmup_steps", ">= 0", self.warmup_steps)
        if self.lr_decay not in (LR_CONSTANT, LR_COSINE, LR_LINEAR, LR_STEP):
            bad("lr_decay", "LR_CONSTANT, LR_COSINE, LR_LINEAR or LR_STEP", self.lr_decay)
        if self.lr_decay in (LR_COSINE, LR_LINEAR) and self.decay_steps <= self.warmup_steps:
            bad("decay_steps", f"> adahessian.warmup_steps = {self.warmup_steps}",
                self.decay_steps)
        if not 0.0 <= self.final_lr_fraction <= 1.0:
            bad("final_lr_fraction", "in [0, 1]", self.final_lr_fraction)
        if self.lr_decay == LR_STEP and self.step_every < 1:
            bad("step_every", ">= 1 under LR_STEP", self.step_every)
        if not 0.0 < self.step_gamma <= 1.0:
            bad("step_gamma", "in (0, 1]", self.step_gamma)
        return self


def hessian_due(t, hessian_every):
    """compute::HessianDue: a fresh D at t = 1, 1 + k, 1 + 2k, ... (C++ % truncates)."""
    t, k = int(t), int(hessian_every)
    if k <= 1:
        return True
    return abs(t - 1) % k == 0  # == C++'s (t - 1) % k == 0 for either sign


def learning_rate(config, t):
    """compute::LearningRate(config, t) in double, the same operations in the same order."""
    c = AdaHessianConfig.from_any(config)
    t = int(t)
    lr = float(c.lr)
    warmup = int(c.warmup_steps)
    if warmup > 0 and t <= warmup:
        return lr * float(t if t > 0 else 0) / float(warmup)
    after = t - (warmup if warmup > 0 else 0)
    f = float(c.final_lr_fraction)
    if c.lr_decay in (LR_COSINE, LR_LINEAR):
        span = int(c.decay_steps) - (warmup if warmup > 0 else 0)
        if span <= 0:
            return lr
        p = float(after) / float(span)
        p = 0.0 if p < 0.0 else (1.0 if p > 1.0 else p)
        if c.lr_decay == LR_LINEAR:
            return lr * (1.0 - (1.0 - f) * p)
        return lr * (f + (1.0 - f) * 0.5 * (1.0 + math.cos(math.pi * p)))
    if c.lr_decay == LR_STEP:
        if c.step_every < 1 or after < 0:
            return lr
        drops = float(after // int(c.step_every))
        factor = math.pow(float(c.step_gamma), drops)
        return lr * (factor if factor > f else f)
    return lr


def _f32(x):
    """static_cast<float>(double x): round to nearest float32 (inf on overflow), a Python float."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


@dataclasses.dataclass(frozen=True)
class AdaHessianScalars:
    """compute::AdaHessianScalars: every value is a float32 value (held as a Python float)."""

    lr: float
    beta1: float
    beta2: float
    m_coeff: float
    v_coeff: float
    bias1: float
    bias2: float
    epsilon: float
    weight_decay: float
    half_power: float
    power_mode: int  # 0: k = 0, 1: k = 1 (sqrt), 2: powf(x, half_power)


def adahessian_scalars(config, t, weight=1.0):
    """MakeAdaHessianScalars(config, t, weight). ValueError for t < 1."""
    c = AdaHessianConfig.from_any(config)
    t = int(t)
    if t < 1:
        raise ValueError(f"adahessian_scalars: t = {t} < 1")
    weight = float(weight)
    beta1, beta2 = float(c.beta1), float(c.beta2)
    power = float(c.hessian_power)
    mode = 1 if power == 1.0 else (0 if power == 0.0 else 2)
    return AdaHessianScalars(
        lr=_f32(learning_rate(c, t)),
        beta1=_f32(beta1),
        beta2=_f32(beta2),
        m_coeff=_f32((1.0 - beta1) * weight),
        v_coeff=_f32((1.0 - beta2) * weight),
        bias1=_f32(1.0 - math.pow(beta1, float(t))),
        bias2=_f32(1.0 - math.pow(beta2, float(t))),
        epsilon=_f32(float(c.epsilon)),
        weight_decay=_f32(float(c.weight_decay)),
        half_power=_f32(0.5 * power),
        power_mode=mode)


def _s(x):
    """A 0-d float32 tensor holding the float32 value x."""
    return torch.tensor(x, dtype=torch.float32)


def _check(*tensors):
    shape = tensors[0].shape
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError("kernels: expected float32 CPU tensors")
        if t.shape != shape:
            raise ValueError(f"kernels: shapes differ ({tuple(shape)} vs {tuple(t.shape)})")


_LIBM = None


def _powf(x, y):
    """The C library's powf(x[i], y) for every element (what the C++ loop calls)."""
    global _LIBM
    if _LIBM is None:
        lib = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        lib.powf.restype = ctypes.c_float
        lib.powf.argtypes = [ctypes.c_float, ctypes.c_float]
        _LIBM = lib
    powf = _LIBM.powf
    flat = x.detach().contiguous().reshape(-1).numpy()
    out = np.fromiter((powf(float(v), y) for v in flat), dtype=np.float32, count=flat.size)
    return torch.from_numpy(out).reshape(x.shape)


def adahessian_update_(scalars, g, d, m, v, theta):
    """AdaHessianElement(scalars, g[i], d[i], &m[i], &v[i], &theta[i]) for every i, in place:
      m' = beta1 m + m_coeff g;  v' = beta2 v + v_coeff (d d)
      theta' = theta - lr ((m' / bias1) / (root(v' / bias2) + eps) + weight_decay theta)
    """
    _check(theta, g, d, m, v)
    s = scalars
    m_new = (_s(s.beta1) * m) + (_s(s.m_coeff) * g)
    v_new = (_s(s.beta2) * v) + (_s(s.v_coeff) * (d * d))
    m_hat = m_new / _s(s.bias1)
    v_hat = v_new / _s(s.bias2)
    if s.power_mode == 1:
        root = torch.sqrt(v_hat)
    elif s.power_mode == 0:
        root = torch.ones_like(v_hat)
    else:
        root = _powf(v_hat, s.half_power)
    den = root + _s(s.epsilon)
    step = (m_hat / den) + (_s(s.weight_decay) * theta)
    theta_new = theta - (_s(s.lr) * step)
    with torch.no_grad():
        m.copy_(m_new)
        v.copy_(v_new)
        theta.copy_(theta_new)


def block_average_rows_(d, rows, cols, block_size):
    """compute::BlockAverageRows on d viewed as row-major rows x cols, in place: each block of
    block_size elements along a row becomes its mean (float sum in ascending order / length; the
    last block of a row may be shorter). block_size 0 or 1: unchanged."""
    rows, cols, block_size = int(rows), int(cols), int(block_size)
    if rows < 0 or cols < 0 or block_size < 0:
        raise ValueError(f"block_average_rows_: bad arguments {rows} {cols} {block_size}")
    if d.numel() != rows * cols:
        raise ValueError(f"block_average_rows_: {d.numel()} elements, expected {rows} x {cols}")
    _check(d)
    if block_size <= 1 or d.numel() == 0:
        return d
    view = d.detach().reshape(rows, cols).clone()
    out = torch.empty_like(view)
    for begin in range(0, cols, block_size):
        end = min(begin + block_size, cols)
        total = torch.zeros(rows, dtype=torch.float32)
        for i in range(begin, end):
            total = total + view[:, i]
        mean = total / _s(float(end - begin))
        out[:, begin:end] = mean.unsqueeze(1).expand(rows, end - begin)
    with torch.no_grad():
        d.copy_(out.reshape(d.shape))
    return d


def elastic_move(y, toward, rate):
    """ElasticMoveElement on every element: y + rate * (toward - y); rate a float32 value."""
    _check(y, toward)
    return y + (_s(_f32(rate)) * (toward - y))


def elastic_pull_worker(x, c_before, alpha):
    """compute::ElasticPullWorker: the worker's x after a sync, x + float(alpha) (c_before - x),
    a new tensor (x unchanged)."""
    return elastic_move(x, c_before, _f32(float(alpha)))


def center_move_rate(alpha, weight):
    """compute::CenterMoveRate: float32(alpha * weight) (product in double)."""
    return _f32(float(alpha) * float(weight))


def elastic_move_center(center, x, alpha, weight):
    """compute::ElasticMoveCenter: center + float(alpha w) (x - center), a new tensor."""
    return elastic_move(center, x, center_move_rate(alpha, weight))
