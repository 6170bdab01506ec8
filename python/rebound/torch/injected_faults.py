"""Faults a Python trainer can inject into itself, for tests only (never in production): silent
data corruption that audits catch (docs/recovery.md#audits), as the C++ worker's
``--fault_flip_bit_at_step`` (worker/injected_faults.h), with the same rule for which step,
which parameter and which bit.

Right after the optimizer step of a step ``FlipsAt`` names, and before that step's checksum is
taken and logged, one bit of one parameter flips: the log then holds the corrupted state's
checksum, as it would after a bad memory cell or arithmetic unit, the trainer goes on from the
corrupted value, and only a replay of the step (an audit) can tell. The runner reads the
environment once, when it starts (``BitFlips.from_environment``):

    REBOUND_FAULT_FLIP_BIT_AT_STEP=N        flip after step N (absent, empty or 0: never)
    REBOUND_FAULT_FLIP_BIT_REPEAT_EVERY=K   and again every K steps after it (absent or 0: once)

Thread-safety: a BitFlips is immutable; ``flip`` writes only the tensors it is given.
"""

import dataclasses

import torch

AT_STEP_VARIABLE = "REBOUND_FAULT_FLIP_BIT_AT_STEP"
REPEAT_EVERY_VARIABLE = "REBOUND_FAULT_FLIP_BIT_REPEAT_EVERY"

# The mantissa bit flipped (worker/injected_faults.h, kFlippedBitMask): bit 12 of float32's 23,
# a relative change of about 2^-11 that leaves a finite value finite (the exponent untouched).
FLIPPED_BIT = 12
_MASK64 = (1 << 64) - 1


def flipped_parameter(t, count):
    """The parameter (index among ``count`` >= 1, the declared parameters packed in order) that
    step t's flip corrupts: (t * 2654435761) mod count in uint64 arithmetic, as the C++
    FlippedParameter (Knuth's multiplicative hash: successive flips land far apart)."""
    if count < 1:
        raise ValueError("no parameter to flip (count %d)" % count)
    return ((t * 2654435761) & _MASK64) % count


def flip_target(t, sizes):
    """(tensor index, index within that tensor) of the parameter step t's flip corrupts among
    tensors of ``sizes`` elements (packed in order; empty tensors hold none)."""
    i = flipped_parameter(t, sum(sizes))
    for which, size in enumerate(sizes):
        if i < size:
            return which, i
        i -= size
    raise AssertionError("unreachable: the packed index is below the total")


def flip_bit(tensor, index):
    """Flips bit FLIPPED_BIT of element ``index`` (of the flattened, contiguous float32
    ``tensor``) in place: XOR 1 << 12 on its int32 view."""
    if tensor.dtype != torch.float32 or not tensor.is_contiguous():
        raise ValueError("flip_bit needs a contiguous float32 tensor, got %s" % tensor.dtype)
    with torch.no_grad():
        bits = tensor.detach().view(-1).view(torch.int32)
        bits[index] ^= 1 << FLIPPED_BIT


@dataclasses.dataclass(frozen=True)
class BitFlips:
    """Which steps flip a bit: ``at_step`` (0: none) and every ``repeat_every`` steps after it
    (0: once)."""

    at_step: int = 0
    repeat_every: int = 0

    @classmethod
    def from_environment(cls, environ):
        """The flips the mapping ``environ`` (os.environ) asks for; none when AT_STEP_VARIABLE
        is unset, empty or 0. ValueError naming the variable for a value that is not an integer
        >= 0."""

        def read(name, low):
            text = environ.get(name, "").strip()
            if not text:
                return 0
            try:
                value = int(text)
            except ValueError:
                raise ValueError("%s must be an integer, got %r" % (name, text)) from None
            if value < low:
                raise ValueError("%s must be >= %d, got %d" % (name, low, value))
            return value

        return cls(at_step=read(AT_STEP_VARIABLE, 0), repeat_every=read(REPEAT_EVERY_VARIABLE, 0))

    def __bool__(self):
        return self.at_step > 0

    def flips_at(self, t):
        """Whether step t is one of the steps at_step and repeat_every name."""
        if self.at_step <= 0 or t < self.at_step:
            return False
        if self.repeat_every <= 0:
            return t == self.at_step
        return (t - self.at_step) % self.repeat_every == 0

    def maybe_flip(self, t, params):
        """After step t's update: at a step ``flips_at`` names, flips the bit of parameter
        ``flip_target(t, ...)`` of ``params`` (the declared parameters, in order) and returns
        (tensor index, index within it); None, touching nothing, at any other step."""
        if not self.flips_at(t):
            return None
        which, index = flip_target(t, [p.numel() for p in params])
        flip_bit(params[which], index)
        return which, index
