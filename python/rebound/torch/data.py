"""Fashion-MNIST as a data set indexable by sample id, for rebound.torch specs.

Reads the four gzip'ed IDX files that Debian's dataset-fashion-mnist package installs in
/usr/share/datasets/fashion-mnist (the files the C++ worker reads, worker/data/fashion_mnist.h):

    train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz   split "train", 60000 samples
    t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz    split "test",  10000 samples

Contract:
  * ``FashionMnist(split, root, limit, scale)`` loads the split's first ``limit`` samples
    (0 = all) into one float32 tensor ``images`` of shape [N, 1, 28, 28] and one int64 tensor
    ``labels`` of shape [N] with values in [0, 10).
  * ``scale="standard"`` (the default) normalises a pixel byte p exactly as the C++ worker does,
    in float32 arithmetic: (p / 255 - 0.2860) / 0.3530 (kFashionMnistMean and kFashionMnistStd,
    the training pixels' mean and standard deviation), so a Python and a C++ worker see
    bit-identical features. ``scale="unit"`` gives p / 255 in [0, 1] instead.
  * ``ds[i] -> (x, y)``: x a [1, 28, 28] float32 view, y a 0-d int64 tensor; i an int in
    [0, len(ds)) (IndexError otherwise; negative ids are refused, they are no sample id).
  * ``ds.batch(ids) -> (X, Y)``: [B, 1, 28, 28] and [B], gathered by index_select; equal to
    stacking ``ds[i]`` for i in ids. ids: a sequence, numpy array or tensor of integers.
  * Errors name the file and what is wrong: FileNotFoundError for a missing file,
    IdxFormatError (a ValueError) for a damaged gzip stream (truncated, corrupt, bad CRC), a
    wrong IDX magic, an IDX payload shorter or longer than its header promises, a label outside
    [0, 10), image and label files of different counts; ValueError for a bad split, scale or
    limit.

Thread-safety: a loaded data set is read-only; reading it from several threads is safe.
"""

import gzip
import os
import struct
import zlib

import numpy as np
import torch

DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"
NUM_CLASSES = 10

# worker/data/fashion_mnist.h: kFashionMnistMean, kFashionMnistStd.
FASHION_MNIST_MEAN = 0.2860
FASHION_MNIST_STD = 0.3530

_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

# IDX magic numbers (worker/data/idx_reader.h): unsigned bytes, 3 and 1 dimensions.
_IDX_IMAGES_MAGIC = 0x00000803
_IDX_LABELS_MAGIC = 0x00000801


class IdxFormatError(ValueError):
    """A data set file that exists but is not a valid gzip'ed IDX file of the expected kind."""


def _read_gzip(path):
    """The decompressed bytes of the gzip file at `path`; damage raises IdxFormatError."""
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"{path}: no such file (Debian's dataset-fashion-mnist package installs the "
            f"Fashion-MNIST files in {DEFAULT_ROOT})")
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except EOFError as e:
        raise IdxFormatError(f"{path}: truncated gzip stream ({e})") from e
    except (gzip.BadGzipFile, zlib.error) as e:
        raise IdxFormatError(f"{path}: damaged gzip data ({e})") from e


def _parse_idx(path, data, magic, dims, kind):
    """Checks the IDX header and payload size of `data`; returns (sizes, payload as uint8)."""
    if len(data) < 4:
        raise IdxFormatError(
            f"{path}: truncated IDX header: {len(data)} decompressed bytes, the magic number "
            f"alone needs 4")
    (actual,) = struct.unpack(">I", data[:4])
    if actual != magic:
        raise IdxFormatError(
            f"{path}: wrong IDX magic 0x{actual:08x}, expected 0x{magic:08x} ({kind}: unsigned "
            f"bytes, {dims} dimension{'' if dims == 1 else 's'})")
    header = 4 + 4 * dims
    if len(data) < header:
        raise IdxFormatError(
            f"{path}: truncated IDX header: {len(data)} decompressed bytes, the header needs "
            f"{header}")
    sizes = struct.unpack(f">{dims}I", data[4:header])
    payload = int(np.prod(sizes, dtype=np.int64))
    actual_payload = len(data) - header
    shape = " x ".join(str(s) for s in sizes)
    if actual_payload < payload:
        raise IdxFormatError(
            f"{path}: truncated IDX payload: {actual_payload} bytes, the header's shape {shape} "
            f"needs {payload}")
    if actual_payload > payload:
        raise IdxFormatError(
            f"{path}: {actual_payload - payload} trailing bytes after the IDX payload of shape "
            f"{shape} ({payload} bytes)")
    return sizes, np.frombuffer(data, dtype=np.uint8, offset=header)


def _pixel_table(scale):
    """float32 value of each pixel byte 0..255, computed in float32 like the C++ worker."""
    p = np.arange(256, dtype=np.float32) / np.float32(255.0)
    if scale == "unit":
        return p
    # (p / 255.0f - kFashionMnistMean) / kFashionMnistStd, every operation in float32.
    return (p - np.float32(FASHION_MNIST_MEAN)) / np.float32(FASHION_MNIST_STD)


class FashionMnist:
    """One split of Fashion-MNIST in memory; see the module docstring for the contract."""

    def __init__(self, split="train", root=DEFAULT_ROOT, limit=0, scale="standard"):
        if split not in _FILES:
            raise ValueError(f"FashionMnist: split must be 'train' or 'test', not {split!r}")
        if scale not in ("standard", "unit"):
            raise ValueError(f"FashionMnist: scale must be 'standard' or 'unit', not {scale!r}")
        images_path, labels_path = (os.path.join(root, name) for name in _FILES[split])

        (count, rows, cols), pixels = _parse_idx(
            images_path, _read_gzip(images_path), _IDX_IMAGES_MAGIC, 3, "images")
        if rows < 1 or cols < 1:
            raise IdxFormatError(f"{images_path}: unsupported IDX image shape {count} x {rows} x "
                                 f"{cols}: rows and cols must be >= 1")
        (label_count,), labels = _parse_idx(
            labels_path, _read_gzip(labels_path), _IDX_LABELS_MAGIC, 1, "labels")
        if count != label_count:
            raise IdxFormatError(f"{images_path} holds {count} images but {labels_path} holds "
                                 f"{label_count} labels")
        if labels.size and int(labels.max()) >= NUM_CLASSES:
            bad = int(np.argmax(labels >= NUM_CLASSES))
            raise IdxFormatError(f"{labels_path}: label {int(labels[bad])} of sample {bad} is "
                                 f"outside [0, {NUM_CLASSES})")
        if not isinstance(limit, int) or limit < 0 or limit > count:
            raise ValueError(f"{images_path}: sample limit {limit!r} is outside [0, {count}] "
                             f"(0 = all samples)")
        n = count if limit == 0 else limit

        table = _pixel_table(scale)
        images = table[pixels[: n * rows * cols]].reshape(n, 1, rows, cols)
        self.images = torch.from_numpy(np.ascontiguousarray(images))
        self.labels = torch.from_numpy(labels[:n].astype(np.int64))
        self.split = split
        self.root = root
        self.num_classes = NUM_CLASSES

    def __len__(self):
        return self.labels.shape[0]

    def __getitem__(self, i):
        if isinstance(i, torch.Tensor):
            i = int(i)
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"FashionMnist: a sample id is an integer, not {type(i).__name__}")
        if not 0 <= i < len(self):
            raise IndexError(f"FashionMnist({self.split!r}): sample id {i} is outside "
                             f"[0, {len(self)})")
        return self.images[i], self.labels[i]

    def batch(self, ids):
        """(X, Y) of the samples `ids`, in order: [B, 1, 28, 28] float32 and [B] int64."""
        index = torch.as_tensor(ids)
        if index.dim() != 1 or (index.numel() and index.is_floating_point()) or \
                index.dtype == torch.bool:
            raise TypeError(f"FashionMnist.batch: ids must be a 1-d sequence of integers, got "
                            f"shape {tuple(index.shape)} of {index.dtype}")
        index = index.to(torch.int64)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= len(self)):
            bad = index[(index < 0) | (index >= len(self))][0]
            raise IndexError(f"FashionMnist({self.split!r}).batch: sample id {int(bad)} is "
                             f"outside [0, {len(self)})")
        return self.images.index_select(0, index), self.labels.index_select(0, index)

    def __repr__(self):
        return f"FashionMnist(split={self.split!r}, root={self.root!r}, samples={len(self)})"
