"""The runner's data contract (docs/python.md#data): what ds[i] -> (x, y) may hold and how it
is batched (any target a PyTorch loss takes: class indices, floats, vectors, multi-label), the
clear error for what cannot be batched, and which accuracy the evaluator reports."""

import numpy as np
import pytest
import torch

from rebound.torch import runner


class PerSample:
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def fetch(items, ids=(0, 1, 2)):
    return runner._fetch(PerSample(items), np.asarray(ids))


def test_float_targets_stay_floats():
    x, y = fetch([(torch.ones(3), 0.25), (torch.zeros(3), 1.5), (torch.ones(3), -2.0)])
    assert y.dtype == torch.float32 and y.tolist() == [0.25, 1.5, -2.0]
    assert x.shape == (3, 3)
    # What a regression loss then computes is the float target's.
    assert float(torch.nn.functional.mse_loss(torch.zeros(3), y)) == pytest.approx(
        (0.25 ** 2 + 1.5 ** 2 + 2.0 ** 2) / 3)


def test_vector_and_multi_label_targets_are_rows():
    x, y = fetch([([1.0, 2.0], [0.5, 0.25, 0.0]), ([3.0, 4.0], [1.0, 2.0, 3.0]),
                  ([5.0, 6.0], [0.0, 0.0, 1.0])])
    assert x.tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert y.shape == (3, 3) and y[0].tolist() == [0.5, 0.25, 0.0]
    labels = [np.array([1, 0, 1, 0], dtype=np.float32), np.array([0, 0, 1, 1], dtype=np.float32),
              np.array([1, 1, 1, 1], dtype=np.float32)]
    _, y = fetch([(torch.zeros(2), labels[i]) for i in range(3)])
    assert y.dtype == torch.float32 and y.shape == (3, 4) and y[1].tolist() == [0, 0, 1, 1]
    torch.nn.functional.binary_cross_entropy_with_logits(torch.zeros(3, 4), y)  # it takes them


def test_class_indices_are_int64_whatever_they_came_as():
    for label in (lambda k: k, lambda k: torch.tensor(k), lambda k: np.int64(k)):
        _, y = fetch([(torch.zeros(2), label(k)) for k in (3, 0, 2)])
        assert y.dtype == torch.int64 and y.tolist() == [3, 0, 2]


def test_what_cannot_be_batched_is_a_clear_error():
    with pytest.raises(runner.DataError, match=r"target of samples \[0, 1, 2\] cannot be "
                       r"batched.*same shape.*batch\(ids\)"):
        fetch([(torch.zeros(2), [1.0]), (torch.zeros(2), [1.0, 2.0]), (torch.zeros(2), [0.0])])
    with pytest.raises(runner.DataError, match=r"target of sample 0 is a str"):
        fetch([(torch.zeros(2), "cat"), (torch.zeros(2), "dog"), (torch.zeros(2), "cat")])
    with pytest.raises(runner.DataError, match=r"sample 1 of the data set is a Tensor; ds\[i\] "
                       r"must be a pair"):
        fetch([(torch.zeros(2), 1), torch.zeros(2), (torch.zeros(2), 1)])

    class BadBatch:
        def __len__(self):
            return 3

        def batch(self, ids):
            return torch.zeros(len(ids), 2)

    with pytest.raises(runner.DataError, match=r"batch\(ids\) returned a Tensor"):
        runner._fetch(BadBatch(), np.arange(3))


def test_the_evaluators_accuracy_is_argmax_for_classes_and_none_otherwise():
    spec = runner.Spec(model=None, optimizer=None, loss=None, train_set=None)
    out = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
    assert runner._batch_accuracy(spec, out, torch.tensor([1, 0, 0, 0])) == 0.75
    assert runner._batch_accuracy(spec, out, torch.tensor([1.0, 0.0, 0.0, 0.0])) is None
    assert runner._batch_accuracy(spec, out, torch.zeros(4, 2)) is None  # multi-label
    spec.accuracy = lambda o, t: ((o > 0.5) == (t > 0.5)).float().mean()
    assert runner._batch_accuracy(spec, out, torch.zeros(4, 2)) == 0.5
