"""rebound.torch.injected_faults, the bit flip a Python trainer injects for the audit tests: which
steps flip, which parameter (the C++ worker's rule, worker/injected_faults.h), that exactly bit 12
of it flips and nothing else, and the environment variables and their errors. No server."""

import numpy as np
import pytest
import torch

from rebound.torch import injected_faults as faults


def bits(tensor):
    return tensor.detach().contiguous().view(-1).numpy().view(np.uint32).copy()


def test_the_parameter_is_the_cxx_rule_in_uint64_arithmetic():
    # (t * 2654435761) mod count, as worker/injected_faults.cc's FlippedParameter, also where
    # the product wraps past 2^64.
    assert faults.flipped_parameter(50, 676) == (50 * 2654435761) % 676 == 670
    t = (1 << 40) + 3
    assert faults.flipped_parameter(t, 1000003) == ((t * 2654435761) % (1 << 64)) % 1000003
    assert faults.flipped_parameter(7, 1) == 0
    with pytest.raises(ValueError):
        faults.flipped_parameter(7, 0)


def test_the_packed_index_names_a_tensor_and_an_element_of_it():
    # tiny_spec's MLP: 0.weight [32, 16], 0.bias [32], 3.weight [4, 32], 3.bias [4].
    sizes = [512, 32, 128, 4]
    assert faults.flip_target(50, sizes) == (2, 670 - 544)
    # Empty tensors hold no parameter; every packed index lands in a tensor, in order.
    seen = set()
    for t in range(1, 400):
        which, index = faults.flip_target(t, [0, 3, 0, 5])
        assert (which, index) in {(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2), (3, 3), (3, 4)}
        seen.add((which, index))
    assert len(seen) == 8


def test_a_flip_changes_bit_12_of_one_element_and_nothing_else():
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.randn(6, 5))
    before = bits(param)
    values = param.detach().clone()
    faults.flip_bit(param, 17)
    after = bits(param)
    assert np.flatnonzero(before != after).tolist() == [17]
    assert int(before[17] ^ after[17]) == 1 << 12
    # A low mantissa bit: finite, and about 2^-11 of the value (the exponent is untouched).
    changed = float(param.detach().view(-1)[17])
    original = float(values.view(-1)[17])
    assert np.isfinite(changed)
    assert abs(changed - original) <= abs(original) * 2.0 ** -11 * 1.0001
    assert abs(changed - original) >= abs(original) * 2.0 ** -12
    # Still the optimizer's leaf; a second flip restores it bit for bit.
    assert param.is_leaf and param.requires_grad
    faults.flip_bit(param, 17)
    assert (bits(param) == before).all()
    with pytest.raises(ValueError):
        faults.flip_bit(torch.zeros(3, dtype=torch.float64), 0)


def test_the_steps_that_flip():
    once = faults.BitFlips(at_step=50)
    assert once and [t for t in range(200) if once.flips_at(t)] == [50]
    repeated = faults.BitFlips(at_step=50, repeat_every=30)
    assert [t for t in range(150) if repeated.flips_at(t)] == [50, 80, 110, 140]
    none = faults.BitFlips()
    assert not none and not any(none.flips_at(t) for t in range(100))


def test_maybe_flip_touches_the_parameter_of_a_flipping_step_only():
    torch.manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(32, 16)), torch.nn.Parameter(torch.randn(32)),
              torch.nn.Parameter(torch.randn(4, 32)), torch.nn.Parameter(torch.randn(4))]
    before = [bits(p) for p in params]
    flips = faults.BitFlips(at_step=50)
    assert flips.maybe_flip(49, params) is None
    assert all((bits(p) == b).all() for p, b in zip(params, before))
    assert flips.maybe_flip(50, params) == (2, 126)
    changed = [np.flatnonzero(bits(p) != b).tolist() for p, b in zip(params, before)]
    assert changed == [[], [], [126], []]


def test_the_environment_names_the_steps_and_its_errors_name_the_variable():
    env = faults.BitFlips.from_environment
    assert env({}) == faults.BitFlips()
    assert env({faults.AT_STEP_VARIABLE: ""}) == faults.BitFlips()
    assert env({faults.AT_STEP_VARIABLE: "0"}) == faults.BitFlips()
    assert env({faults.AT_STEP_VARIABLE: "50"}) == faults.BitFlips(at_step=50)
    assert env({faults.AT_STEP_VARIABLE: " 50 ", faults.REPEAT_EVERY_VARIABLE: "7"}) == \
        faults.BitFlips(at_step=50, repeat_every=7)
    for bad, variable in (({faults.AT_STEP_VARIABLE: "fifty"}, faults.AT_STEP_VARIABLE),
                          ({faults.AT_STEP_VARIABLE: "-3"}, faults.AT_STEP_VARIABLE),
                          ({faults.AT_STEP_VARIABLE: "5", faults.REPEAT_EVERY_VARIABLE: "-1"},
                           faults.REPEAT_EVERY_VARIABLE)):
        with pytest.raises(ValueError, match=variable):
            env(bad)
