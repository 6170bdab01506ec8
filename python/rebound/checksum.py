"""xxHash64 checksums of parameters (docs/design.md §5.2), equal to common/checksum.cc.

Contract:
  checksum_floats(data) == ChecksumFloats: XXH64 (seed 0) of the float32 values' little-endian
      bytes; `data` is bytes-like, a numpy float32 array or a torch float32 tensor.
  checksum_bundle(tensors) == ChecksumBundle: one XXH64 stream (seed 0) over, per tensor in
      order: u64 LE id, u64 dtype, u64 ndim, u64 each dim, u64 byte length, then the data bytes.
      `tensors` is a sequence whose items are either (id, dtype, shape, data_bytes) tuples or
      torch float32 tensors (ids 0..n-1, dtype FLOAT32 = 1, shape = tensor.shape; a 0-d tensor
      has ndim 0).
Raises TypeError for a tensor that is not float32, ValueError for a negative id or dim.
"""

import struct

import numpy as np
import xxhash

DTYPE_FLOAT32 = 1  # proto DataType FLOAT32


def _u64(value):
    value = int(value)
    if value < 0:
        raise ValueError(f"checksum_bundle: negative id or dimension {value}")
    return struct.pack("<Q", value)


def _float_bytes(values):
    """Little-endian float32 bytes of a torch tensor, numpy array or bytes-like object."""
    if isinstance(values, (bytes, bytearray, memoryview)):
        return bytes(values)
    if hasattr(values, "detach"):  # torch.Tensor
        import torch

        if values.dtype != torch.float32:
            raise TypeError(f"checksum: expected a float32 tensor, got {values.dtype}")
        values = values.detach().cpu().contiguous().numpy()
    array = np.ascontiguousarray(values)
    if array.dtype != np.float32:
        raise TypeError(f"checksum: expected float32 values, got {array.dtype}")
    return array.astype("<f4", copy=False).tobytes()


def checksum_floats(data):
    """ChecksumFloats: XXH64(seed 0) of the little-endian float32 bytes, as an int."""
    return xxhash.xxh64_intdigest(_float_bytes(data), seed=0)


def _entries(tensors):
    for index, item in enumerate(tensors):
        if isinstance(item, tuple):
            tensor_id, dtype, shape, data = item
            yield int(tensor_id), int(dtype), [int(s) for s in shape], bytes(data)
        else:
            yield index, DTYPE_FLOAT32, [int(s) for s in item.shape], _float_bytes(item)


def checksum_bundle(tensors):
    """ChecksumBundle over (id, dtype, shape, bytes) tuples or float32 tensors; an int."""
    state = xxhash.xxh64(seed=0)
    for tensor_id, dtype, shape, data in _entries(tensors):
        state.update(_u64(tensor_id))
        state.update(_u64(dtype))
        state.update(_u64(len(shape)))
        for dim in shape:
            state.update(_u64(dim))
        state.update(_u64(len(data)))
        state.update(data)
    return state.intdigest()
