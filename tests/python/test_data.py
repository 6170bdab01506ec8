"""Tests of rebound.torch.data.FashionMnist, the IDX reader of the Python client.

Against Debian's Fashion-MNIST files: shapes and counts equal to the files' own headers (read here
independently with gzip and struct), labels in [0, 10), the first label and the first image's
bytes read from the raw files, the normalisation of worker/data/fashion_mnist.h, batch() equal to
per-item gathering. Against small files written into tmp_path: a valid tiny data set read back,
and every kind of damage (truncated gzip, not gzip, wrong magic, short or long payload, count
mismatch, label out of range, missing file) refused with an error naming the file.
The time limit is the sh_test's (tests/python/BUILD); the tests start no processes.
"""

import gzip
import os
import struct

import numpy as np
import pytest
import torch

from rebound.torch.data import FashionMnist, IdxFormatError

ROOT = "/usr/share/datasets/fashion-mnist"
TRAIN_IMAGES = os.path.join(ROOT, "train-images-idx3-ubyte.gz")
TRAIN_LABELS = os.path.join(ROOT, "train-labels-idx1-ubyte.gz")
TEST_LABELS = os.path.join(ROOT, "t10k-labels-idx1-ubyte.gz")


@pytest.fixture(scope="module")
def train():
    return FashionMnist("train")


@pytest.fixture(scope="module")
def raw_train():
    """The decompressed bytes of the training images and labels, read here without the reader."""
    with gzip.open(TRAIN_IMAGES, "rb") as f:
        images = f.read()
    with gzip.open(TRAIN_LABELS, "rb") as f:
        labels = f.read()
    return images, labels


def test_shapes_match_the_files_headers(train, raw_train):
    images, labels = raw_train
    count, rows, cols = struct.unpack(">III", images[4:16])
    (label_count,) = struct.unpack(">I", labels[4:8])
    assert label_count == count
    assert len(train) == count
    assert train.images.shape == (count, 1, rows, cols)
    assert train.images.dtype == torch.float32
    assert train.labels.shape == (count,)
    assert train.labels.dtype == torch.int64


def test_test_split_is_the_t10k_files():
    test = FashionMnist("test")
    with gzip.open(TEST_LABELS, "rb") as f:
        raw = f.read()
    (count,) = struct.unpack(">I", raw[4:8])
    assert len(test) == count
    assert test.labels.tolist() == list(raw[8:])


def test_labels_in_range_and_every_class_present(train):
    assert int(train.labels.min()) == 0
    assert int(train.labels.max()) == 9
    assert torch.bincount(train.labels, minlength=10).min() > 0


def test_first_sample_matches_raw_bytes(train, raw_train):
    images, labels = raw_train
    x, y = train[0]
    assert int(y) == labels[8]
    assert x.shape == (1, 28, 28)
    pixels = np.frombuffer(images[16:16 + 784], dtype=np.uint8).reshape(1, 28, 28)
    # worker/data/fashion_mnist.cc: (p / 255.0f - 0.2860f) / 0.3530f, every operation in float32.
    scaled = pixels.astype(np.float32) / np.float32(255)
    expected = (scaled - np.float32(0.2860)) / np.float32(0.3530)
    assert torch.equal(x, torch.from_numpy(expected))
    # The last sample too: a reader that misplaces the payload by a few bytes fails here.
    last = len(train) - 1
    pixels = np.frombuffer(images[16 + 784 * last:], dtype=np.uint8).reshape(1, 28, 28)
    x, y = train[last]
    assert int(y) == labels[8 + last]
    assert torch.equal(FashionMnist("train", scale="unit")[last][0] * 255,
                      torch.from_numpy(pixels.astype(np.float32)))


def test_standard_scaling_is_about_zero_mean_unit_std(train):
    # The C++ constants are the training pixels' mean and std, so the result is standardised.
    assert abs(float(train.images.mean())) < 1e-3
    assert abs(float(train.images.std()) - 1.0) < 1e-3


def test_batch_equals_per_item_gathering(train):
    ids = [59999, 0, 17, 17, 31337, 2]
    xs, ys = train.batch(ids)
    assert xs.shape == (len(ids), 1, 28, 28)
    assert torch.equal(xs, torch.stack([train[i][0] for i in ids]))
    assert torch.equal(ys, torch.stack([train[i][1] for i in ids]))
    # Tensors and numpy arrays of ids give the same batch.
    assert torch.equal(train.batch(torch.tensor(ids))[0], xs)
    assert torch.equal(train.batch(np.array(ids, dtype=np.int32))[1], ys)


def test_out_of_range_ids_are_refused(train):
    with pytest.raises(IndexError, match="60000"):
        train[60000]
    with pytest.raises(IndexError, match="-1"):
        train[-1]
    with pytest.raises(IndexError, match="60000"):
        train.batch([0, 60000])
    with pytest.raises(TypeError):
        train.batch([0.5])


def test_limit_keeps_the_first_samples(train):
    small = FashionMnist("train", limit=100)
    assert len(small) == 100
    assert torch.equal(small.images, train.images[:100])
    assert torch.equal(small.labels, train.labels[:100])
    with pytest.raises(ValueError, match="limit"):
        FashionMnist("test", limit=10001)
    with pytest.raises(ValueError, match="split"):
        FashionMnist("validation")


# ---- small files written into tmp_path ----------------------------------------------------------

def _idx_images(pixels):
    n, rows, cols = pixels.shape
    return struct.pack(">IIII", 0x803, n, rows, cols) + pixels.tobytes()


def _idx_labels(labels):
    return struct.pack(">II", 0x801, len(labels)) + bytes(labels)


def _write(root, images_bytes, labels_bytes, split="train", compress=True):
    names = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
             "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}[split]
    paths = [os.path.join(root, n) for n in names]
    for path, data in zip(paths, (images_bytes, labels_bytes)):
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if compress else data)
    return paths


@pytest.fixture
def tiny():
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=(3, 4, 5), dtype=np.uint8), [4, 0, 9]


def test_tiny_valid_files_read_back(tmp_path, tiny):
    pixels, labels = tiny
    _write(tmp_path, _idx_images(pixels), _idx_labels(labels), split="test")
    ds = FashionMnist("test", root=str(tmp_path), scale="unit")
    assert ds.images.shape == (3, 1, 4, 5)
    assert ds.labels.tolist() == labels
    assert torch.equal(ds.images[:, 0] * 255, torch.from_numpy(pixels.astype(np.float32)))


def test_truncated_gzip_names_the_file(tmp_path, tiny):
    pixels, labels = tiny
    images_path, _ = _write(tmp_path, _idx_images(pixels), _idx_labels(labels))
    with open(images_path, "rb") as f:
        data = f.read()
    with open(images_path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(IdxFormatError, match="truncated gzip") as e:
        FashionMnist("train", root=str(tmp_path))
    assert images_path in str(e.value)


def test_not_gzip_names_the_file(tmp_path, tiny):
    pixels, labels = tiny
    _, labels_path = _write(tmp_path, _idx_images(pixels), _idx_labels(labels))
    with open(labels_path, "wb") as f:
        f.write(_idx_labels(labels))  # uncompressed
    with pytest.raises(IdxFormatError, match="gzip") as e:
        FashionMnist("train", root=str(tmp_path))
    assert labels_path in str(e.value)


def test_wrong_magic_short_and_long_payload(tmp_path, tiny):
    pixels, labels = tiny
    # A labels file where the images file should be.
    images_path, _ = _write(tmp_path, _idx_labels(labels), _idx_labels(labels))
    with pytest.raises(IdxFormatError, match="magic 0x00000801, expected 0x00000803") as e:
        FashionMnist("train", root=str(tmp_path))
    assert images_path in str(e.value)
    _write(tmp_path, _idx_images(pixels)[:-1], _idx_labels(labels))
    with pytest.raises(IdxFormatError, match="truncated IDX payload: 59 bytes.*needs 60"):
        FashionMnist("train", root=str(tmp_path))
    _write(tmp_path, _idx_images(pixels) + b"\0\0", _idx_labels(labels))
    with pytest.raises(IdxFormatError, match="2 trailing bytes"):
        FashionMnist("train", root=str(tmp_path))
    _write(tmp_path, _idx_images(pixels)[:10], _idx_labels(labels))
    with pytest.raises(IdxFormatError, match="truncated IDX header"):
        FashionMnist("train", root=str(tmp_path))


def test_count_mismatch_and_bad_label(tmp_path, tiny):
    pixels, labels = tiny
    _write(tmp_path, _idx_images(pixels), _idx_labels(labels[:2]))
    with pytest.raises(IdxFormatError, match="holds 3 images but .* holds 2 labels"):
        FashionMnist("train", root=str(tmp_path))
    _, labels_path = _write(tmp_path, _idx_images(pixels), _idx_labels([1, 10, 2]))
    with pytest.raises(IdxFormatError, match="label 10 of sample 1") as e:
        FashionMnist("train", root=str(tmp_path))
    assert labels_path in str(e.value)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        FashionMnist("train", root=str(tmp_path))
    assert os.path.join(str(tmp_path), "train-images-idx3-ubyte.gz") in str(e.value)
