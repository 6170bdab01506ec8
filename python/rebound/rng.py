"""Philox4x32-10 and the counter-based RNG of docs/design.md §4.2, bit-identical to common/philox.h
and common/rng.h.

Contract: every draw is a pure function of (seed, replica, step, tensor_id, purpose, index), the
same 32-bit words as the C++ RngWord for the same RngStream and element index, so Python and C++
trainers (and a replaying spare) draw the same Hutchinson z. Vectorised with numpy uint32/uint64
arithmetic (wrap-around as in C++): one Philox call per four consecutive indices.

Functions:
  philox4x32_10(counter, key0, key1)     one block (ints or uint32 arrays of equal shape)
  rng_key(seed, replica, purpose)        the 64-bit Philox key (RngMix64 mixing)
  rng_words(stream, start, n)            RngWord(stream, start + i) for i in [0, n), uint32
  rademacher(seed, replica, step, tensor_id, n, purpose=RNG_HUTCHINSON)   float32 +-1
  uniform(...)                           RngUniform: float32 in [0, 1) with 24 bits
  rademacher_tensor(seed, replica, step, tensor_id, shape, ...)  torch.float32 (row-major)
Every function raises ValueError for negative or out-of-range arguments.
"""

import dataclasses

import numpy as np

RNG_HUTCHINSON = 1  # kRngHutchinson
RNG_INIT = 2  # kRngInit
RNG_SHUFFLE = 3  # kRngShuffle

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_MUL0 = np.uint64(0xD2511F53)
_MUL1 = np.uint64(0xCD9E8D57)
_WEYL0 = 0x9E3779B9
_WEYL1 = 0xBB67AE85


@dataclasses.dataclass(frozen=True)
class RngStream:
    """common/rng.h RngStream: addresses one stream of draws."""

    seed: int = 0
    replica: int = 0
    step: int = 0
    tensor_id: int = 0
    purpose: int = 0

    def check(self):
        for name, bits in (("seed", 64), ("replica", 32), ("step", 64), ("tensor_id", 32),
                           ("purpose", 32)):
            value = getattr(self, name)
            if not 0 <= int(value) < (1 << bits):
                raise ValueError(f"RngStream.{name} = {value} is not a uint{bits}")


def rng_mix64(x):
    """SplitMix64 finaliser (RngMix64) on a Python int, modulo 2^64."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def rng_key(seed, replica, purpose):
    """The 64-bit Philox key of RngWord: RngMix64(seed ^ RngMix64(replica << 32 | purpose))."""
    return rng_mix64(int(seed) ^ rng_mix64(((int(replica) << 32) | int(purpose)) & _MASK64))


def philox4x32_10(counter, key0, key1):
    """Ten Philox4x32 rounds (Philox4x32Round10).

    counter: four uint32 values or four uint32 numpy arrays of one shape; key0, key1: ints.
    Returns four numpy uint32 arrays (0-d for scalar counters).
    """
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & np.uint64(_MASK32) for c in counter)
    k0 = int(key0) & _MASK32
    k1 = int(key1) & _MASK32
    low = np.uint64(_MASK32)
    shift = np.uint64(32)
    for _ in range(10):
        p0 = c0 * _MUL0  # < 2^64: exact in uint64
        p1 = c2 * _MUL1
        hi0, lo0 = p0 >> shift, p0 & low
        hi1, lo1 = p1 >> shift, p1 & low
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
        k0 = (k0 + _WEYL0) & _MASK32
        k1 = (k1 + _WEYL1) & _MASK32
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def rng_words(stream, start, n):
    """RngWord(stream, start + i) for i in [0, n) as a numpy uint32 array of n words."""
    stream.check()
    start, n = int(start), int(n)
    if start < 0 or n < 0 or start + n > (1 << 64):
        raise ValueError(f"rng_words: bad range start {start} n {n}")
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    key = rng_key(stream.seed, stream.replica, stream.purpose)
    first_block = start >> 2
    last_block = (start + n - 1) >> 2
    blocks = np.arange(last_block - first_block + 1, dtype=np.uint64) + np.uint64(first_block)
    c0 = blocks & np.uint64(_MASK32)
    # index >> 34 == block >> 32; C++: tensor_id ^ uint32(index >> 34) * 0x85EBCA6B (mod 2^32).
    high = ((blocks >> np.uint64(32)) * np.uint64(0x85EBCA6B)) & np.uint64(_MASK32)
    c1 = np.uint64(stream.tensor_id) ^ high
    step = int(stream.step)
    c2 = np.full(blocks.shape, step & _MASK32, dtype=np.uint64)
    c3 = np.full(blocks.shape, step >> 32, dtype=np.uint64)
    out = philox4x32_10((c0, c1, c2, c3), key & _MASK32, key >> 32)
    words = np.stack(out, axis=1).reshape(-1)  # block b, lane j -> index 4b + j
    offset = start - 4 * first_block
    return words[offset:offset + n]


def _stream(seed, replica, step, tensor_id, purpose):
    return RngStream(seed=int(seed), replica=int(replica), step=int(step),
                     tensor_id=int(tensor_id), purpose=int(purpose))


def rademacher(seed, replica, step, tensor_id, n, purpose=RNG_HUTCHINSON, start=0):
    """RngRademacher for element indices start..start+n-1: float32 +1.0 (odd word) or -1.0."""
    words = rng_words(_stream(seed, replica, step, tensor_id, purpose), start, n)
    out = np.full(words.shape, -1.0, dtype=np.float32)
    out[(words & np.uint32(1)) != 0] = 1.0
    return out


def uniform(seed, replica, step, tensor_id, n, purpose=RNG_INIT, start=0):
    """RngUniform: float32((word >> 8)) * 2^-24, in [0, 1)."""
    words = rng_words(_stream(seed, replica, step, tensor_id, purpose), start, n)
    return (words >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def rademacher_tensor(seed, replica, step, tensor_id, shape, purpose=RNG_HUTCHINSON):
    """rademacher(...) as a torch.float32 CPU tensor of `shape` (element index = row-major)."""
    import torch  # only this helper needs torch

    shape = tuple(int(s) for s in shape)
    n = 1
    for s in shape:
        n *= s
    values = rademacher(seed, replica, step, tensor_id, n, purpose)
    return torch.from_numpy(values).reshape(shape)
