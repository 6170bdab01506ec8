"""python/rebound's rng, checksum and torch kernels against the real C++ code, bit for bit.

The C++ side is tests/python/kernel_oracle (its header describes the protocol), found through the
environment variable REBOUND_KERNEL_ORACLE (set by the sh_test; run by hand:
REBOUND_KERNEL_ORACLE=bazel-bin/tests/python/kernel_oracle). Without it the tests fail, never skip.
Inputs are random (fixed numpy seeds) plus awkward values: +-0, subnormals, tiny and huge
magnitudes, values whose products overflow.
"""

import math
import os
import struct
import subprocess

import numpy as np
import pytest
import torch

from rebound import checksum, rng
from rebound.torch import kernels

ORACLE_TIMEOUT_S = 60


def oracle(commands):
    """Runs the oracle on the commands (strings); returns its output lines, one per command."""
    path = os.environ.get("REBOUND_KERNEL_ORACLE")
    assert path, "REBOUND_KERNEL_ORACLE is not set"
    assert os.access(path, os.X_OK), f"oracle {path} is not executable"
    proc = subprocess.run([path], input="\n".join(commands) + "\n", capture_output=True,
                          text=True, timeout=ORACLE_TIMEOUT_S, check=False)
    assert proc.returncode == 0, f"oracle failed: {proc.stdout[-500:]} {proc.stderr[-500:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == len(commands), lines[-3:]
    return lines


def bits_of(array):
    return " ".join(f"{b:08x}" for b in np.asarray(array, dtype=np.float32).view(np.uint32))


def floats_of(line):
    words = line.split()
    return np.array([int(w, 16) for w in words], dtype=np.uint32).view(np.float32)


def u32(array):
    return np.asarray(array, dtype=np.float32).view(np.uint32)


def assert_bits_equal(python, cpp, what):
    p, c = u32(python), u32(cpp)
    assert p.shape == c.shape, what
    differ = np.nonzero(p != c)[0]
    assert differ.size == 0, (f"{what}: {differ.size} of {p.size} elements differ, first at "
                              f"{differ[0]}: python {p[differ[0]]:08x} c++ {c[differ[0]]:08x}")


def awkward_floats(n, seed, scale=1.0):
    """n float32 values: mostly normal(0, scale), with +-0, subnormals, tiny, huge, 1, -1."""
    r = np.random.default_rng(seed)
    x = (r.standard_normal(n) * scale).astype(np.float32)
    specials = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17549435e-38, 1e-30, -1e-20, 1e20,
                         -3e30, 3.0e38, -3.0e38, 1.0, -1.0, 0.5, 65504.0], dtype=np.float32)
    k = min(n, specials.size)
    where = r.choice(n, size=k, replace=False)
    x[where] = specials[:k]
    # Spread magnitudes over many binades.
    with np.errstate(over="ignore"):
        x *= np.float32(2.0) ** r.integers(-20, 20, size=n).astype(np.float32)
    return x.astype(np.float32)


# ---- RNG ------------------------------------------------------------------------------------------

RNG_KEYS = [
    (0, 0, 0, 0),
    (42, 0, 1, 0),
    (42, 3, 7, 5),
    (2**64 - 1, 2**32 - 1, 2**64 - 1, 2**32 - 1),
    (123456789123, 17, 2**33 + 5, 1000),
    (7, 1, 10**12, 2**31 + 3),
]


@pytest.mark.parametrize("key", RNG_KEYS)
def test_rademacher_matches_cpp(key):
    seed, replica, step, tensor_id = key
    n = 100_003
    lines = oracle([f"rademacher {seed} {replica} {step} {tensor_id} {rng.RNG_HUTCHINSON} {n}"])
    cpp = floats_of(lines[0])
    python = rng.rademacher(seed, replica, step, tensor_id, n)
    assert python.dtype == np.float32
    assert_bits_equal(python, cpp, f"rademacher {key}")
    # A sanity check that could fail: both signs occur about equally often.
    assert abs(float(python.mean())) < 0.02


def test_words_uniform_and_purposes_match_cpp():
    commands, expected = [], []
    for purpose in (rng.RNG_HUTCHINSON, rng.RNG_INIT, rng.RNG_SHUFFLE, 0, 99):
        for start in (0, 1, 3, 5, 2**33 + 1, 2**34 - 2, 2**40 + 7, 2**64 - 40):
            stream = rng.RngStream(seed=99, replica=2, step=11, tensor_id=3, purpose=purpose)
            commands.append(f"words 99 2 11 3 {purpose} {start} 37")
            expected.append(rng.rng_words(stream, start, 37))
        commands.append(f"uniform 5 1 2 3 {purpose} 1001")
        expected.append(rng.uniform(5, 1, 2, 3, 1001, purpose=purpose).view(np.uint32))
    lines = oracle(commands)
    for command, line, python in zip(commands, lines, expected):
        cpp = np.array([int(w, 16) for w in line.split()], dtype=np.uint32)
        assert np.array_equal(python, cpp), command


def test_rademacher_tensor_shape_matches_the_flat_draws():
    # No time bound here: a busy machine must not fail a test (speed belongs to bench/).
    z = rng.rademacher_tensor(1, 2, 3, 4, (1000, 1000))
    assert z.dtype == torch.float32 and z.shape == (1000, 1000)
    flat = rng.rademacher(1, 2, 3, 4, 10**6)
    assert np.array_equal(z.reshape(-1).numpy(), flat)
    assert set(np.unique(flat).tolist()) == {-1.0, 1.0}


def test_rng_rejects_out_of_range_keys():
    with pytest.raises(ValueError):
        rng.rademacher(-1, 0, 0, 0, 4)
    with pytest.raises(ValueError):
        rng.rademacher(0, 2**32, 0, 0, 4)


# ---- Checksums ------------------------------------------------------------------------------------

def test_checksum_floats_matches_cpp():
    commands, python = [], []
    for n, seed in ((0, 1), (1, 2), (7, 3), (1000, 4), (33333, 5)):
        x = awkward_floats(n, seed)
        commands.append(f"checksum_floats {n} {bits_of(x)}")
        python.append(checksum.checksum_floats(torch.from_numpy(x)))
        assert checksum.checksum_floats(x.tobytes()) == python[-1]
    lines = oracle(commands)
    assert [int(line, 16) for line in lines] == python


def bundle_command(entries):
    parts = [f"checksum_bundle {len(entries)}"]
    for tensor_id, dtype, shape, data in entries:
        parts.append(f"{tensor_id} {dtype} {len(shape)} {' '.join(str(s) for s in shape)} "
                     f"{len(data)} {data.hex() or '-'}")
    return " ".join(parts)


def test_checksum_bundle_matches_cpp():
    r = np.random.default_rng(9)
    tensors = [torch.from_numpy(awkward_floats(12, 1)).reshape(3, 4),
               torch.from_numpy(awkward_floats(4, 2)),
               torch.tensor(2.5),  # 0-d
               torch.zeros(0, 5),
               torch.from_numpy(r.standard_normal((2, 3, 4)).astype(np.float32))]
    as_tuples = [(i, 1, tuple(t.shape), t.numpy().tobytes()) for i, t in enumerate(tensors)]
    # Explicit tuples: other ids, another dtype, raw bytes.
    other = [(7, 1, (2,), np.array([1.0, -0.0], dtype=np.float32).tobytes()),
             (2**32 - 1, 2, (3,), np.array([1, 2, 3], dtype=np.int32).tobytes()),
             (3, 1, (), b"")]
    lines = oracle([bundle_command(as_tuples), bundle_command(other), bundle_command([])])
    assert int(lines[0], 16) == checksum.checksum_bundle(tensors)
    assert int(lines[0], 16) == checksum.checksum_bundle(as_tuples)
    assert int(lines[1], 16) == checksum.checksum_bundle(other)
    assert int(lines[2], 16) == checksum.checksum_bundle([])
    # A single flipped bit changes the checksum.
    flipped = [t.clone() for t in tensors]
    flipped[1][0] = -flipped[1][0] if flipped[1][0] != 0 else 1e-45
    assert checksum.checksum_bundle(flipped) != checksum.checksum_bundle(tensors)


# ---- Learning rate and scalars ----------------------------------------------------------------------

def config_command(c):
    d = lambda x: float(x).hex()  # noqa: E731 - exact doubles for strtod
    return (f"config {d(c.lr)} {d(c.beta1)} {d(c.beta2)} {d(c.epsilon)} {d(c.hessian_power)} "
            f"{d(c.weight_decay)} {c.hessian_every} {c.block_size} {c.warmup_steps} {c.lr_decay} "
            f"{c.decay_steps} {d(c.final_lr_fraction)} {c.step_every} {d(c.step_gamma)}")


CONFIGS = [
    kernels.AdaHessianConfig(),
    kernels.AdaHessianConfig(lr=0.037, beta1=0.0, beta2=0.5, epsilon=1e-8, hessian_power=0.5,
                             weight_decay=1e-3, warmup_steps=5, lr_decay=kernels.LR_COSINE,
                             decay_steps=60, final_lr_fraction=0.1),
    kernels.AdaHessianConfig(lr=0.3, beta1=0.95, beta2=0.9999, hessian_power=0.0,
                             lr_decay=kernels.LR_LINEAR, decay_steps=40, final_lr_fraction=0.25),
    kernels.AdaHessianConfig(lr=1.0 / 3.0, weight_decay=0.25, hessian_power=0.731, warmup_steps=3,
                             lr_decay=kernels.LR_STEP, step_every=4, step_gamma=0.7,
                             final_lr_fraction=0.05),
    kernels.AdaHessianConfig(lr=1e-3, lr_decay=kernels.LR_COSINE, decay_steps=1000,
                             epsilon=1e-30),
]
STEPS = [1, 2, 3, 4, 5, 6, 7, 10, 33, 59, 60, 61, 100, 999, 1000, 1001, 123456, 2**40]


@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_learning_rate_and_scalars_match_cpp(index):
    config = CONFIGS[index].validate()
    commands = [config_command(config)]
    for t in STEPS + [0, -3]:
        commands.append(f"lr {t}")
    for t in STEPS:
        for w in (1.0, 0.05, 0.731):
            commands.append(f"scalars {t} {w.hex()}")
    lines = oracle(commands)
    assert lines[0] == "ok"
    position = 1
    for t in STEPS + [0, -3]:
        cpp = struct.unpack("<d", int(lines[position], 16).to_bytes(8, "little"))[0]
        python = kernels.learning_rate(config, t)
        assert struct.pack("<d", python) == struct.pack("<d", cpp), (t, python, cpp)
        position += 1
    for t in STEPS:
        for w in (1.0, 0.05, 0.731):
            words = lines[position].split()
            position += 1
            s = kernels.adahessian_scalars(config, t, weight=w)
            python = np.array([s.lr, s.beta1, s.beta2, s.m_coeff, s.v_coeff, s.bias1, s.bias2,
                               s.epsilon, s.weight_decay, s.half_power], dtype=np.float32)
            assert_bits_equal(python, floats_of(" ".join(words[:10])), f"scalars t={t} w={w}")
            assert int(words[10]) == s.power_mode


def test_hessian_due_matches_cpp():
    cases = [(t, k) for t in (-7, -1, 0, 1, 2, 3, 4, 5, 7, 9, 10, 2**40 + 1) for k in (0, 1, 2, 3)]
    lines = oracle([f"due {t} {k}" for t, k in cases])
    assert [kernels.hessian_due(t, k) for t, k in cases] == [line == "1" for line in lines]
    assert kernels.hessian_due(4, 3) and not kernels.hessian_due(3, 3)


def test_config_from_proto_and_validate():
    class Message:  # a stand-in with the proto's attribute names
        pass

    msg = Message()
    for field in dataclasses_fields():
        setattr(msg, field, getattr(CONFIGS[3], field))
    assert kernels.AdaHessianConfig.from_proto(msg) == CONFIGS[3]
    with pytest.raises(ValueError, match="beta2"):
        kernels.AdaHessianConfig(beta2=1.0).validate()
    with pytest.raises(ValueError, match="decay_steps"):
        kernels.AdaHessianConfig(lr_decay=kernels.LR_COSINE, decay_steps=0).validate()


def dataclasses_fields():
    import dataclasses

    return [f.name for f in dataclasses.fields(kernels.AdaHessianConfig)]


# ---- Element kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("index", range(len(CONFIGS)))
def test_adahessian_update_matches_cpp(index):
    config = CONFIGS[index]
    n = 4099 if config.hessian_power in (0.0, 1.0) else 1500  # powf runs element by element
    cases = []
    for case, (t, w) in enumerate(((1, 1.0), (2, 1.0), (17, 0.3), (1000, 1.0), (7, 0.05))):
        g = awkward_floats(n, 10 * case + 1)
        d = awkward_floats(n, 10 * case + 2, scale=1e-2)
        m = awkward_floats(n, 10 * case + 3, scale=1e-3)
        v = np.abs(awkward_floats(n, 10 * case + 4, scale=1e-4))
        theta = awkward_floats(n, 10 * case + 5)
        cases.append((t, w, g, d, m, v, theta))
    commands = [config_command(config)]
    for t, w, g, d, m, v, theta in cases:
        commands.append(f"adahessian {t} {w.hex()} {n} {bits_of(g)} {bits_of(d)} {bits_of(m)} "
                        f"{bits_of(v)} {bits_of(theta)}")
    commands.append(f"adahessian 3 {(1.0).hex()} 1 {bits_of(cases[0][2][:1])} "
                    f"{bits_of(cases[0][3][:1])} {bits_of(cases[0][4][:1])} "
                    f"{bits_of(cases[0][5][:1])} {bits_of(cases[0][6][:1])}")
    lines = oracle(commands)
    last = cases[0]
    cases.append((3, 1.0) + tuple(a[:1] for a in last[2:]))
    changed = 0
    for line, (t, w, g, d, m, v, theta) in zip(lines[1:], cases):
        size = g.size
        cpp = floats_of(line)
        tensors = [torch.from_numpy(a.copy()) for a in (g, d, m, v, theta)]
        kernels.adahessian_update_(kernels.adahessian_scalars(config, t, w), *tensors)
        assert_bits_equal(tensors[2].numpy(), cpp[:size], f"m t={t}")
        assert_bits_equal(tensors[3].numpy(), cpp[size:2 * size], f"v t={t}")
        assert_bits_equal(tensors[4].numpy(), cpp[2 * size:], f"theta t={t}")
        changed += int(np.sum(u32(tensors[4].numpy()) != u32(theta)))
    assert changed > 0  # the update moved some parameters


def test_elastic_moves_match_cpp():
    commands, python = [], []
    for n, alpha, seed in ((1, 0.9, 1), (1000, 0.225, 2), (4097, 1.0 / 3.0, 3), (64, 1e-7, 4),
                           (5000, 1.0, 5)):
        x = awkward_floats(n, seed)
        c = awkward_floats(n, seed + 100)
        commands.append(f"elastic_pull {alpha.hex()} {n} {bits_of(x)} {bits_of(c)}")
        python.append(kernels.elastic_pull_worker(torch.from_numpy(x), torch.from_numpy(c),
                                                  alpha).numpy())
        w = 0.6180339887
        commands.append(f"elastic_center {alpha.hex()} {w.hex()} {n} {bits_of(c)} {bits_of(x)}")
        python.append(kernels.elastic_move_center(torch.from_numpy(c), torch.from_numpy(x), alpha,
                                                  w).numpy())
    lines = oracle(commands)
    for command, line, p in zip(commands, lines, python):
        assert_bits_equal(p, floats_of(line), command[:30])


def test_block_average_matches_cpp():
    commands, python = [], []
    for rows, cols, b, seed in ((1, 10, 3, 1), (5, 7, 2, 2), (4, 16, 4, 3), (3, 9, 0, 4),
                                (3, 9, 1, 5), (2, 5, 8, 6), (64, 100, 7, 7)):
        d = awkward_floats(rows * cols, seed, scale=1e-3)
        commands.append(f"block_average {rows} {cols} {b} {bits_of(d)}")
        tensor = torch.from_numpy(d.copy())
        kernels.block_average_rows_(tensor, rows, cols, b)
        python.append(tensor.numpy())
    lines = oracle(commands)
    for command, line, p in zip(commands, lines, python):
        assert_bits_equal(p, floats_of(line), command[:30])


def test_kernels_reject_bad_input():
    with pytest.raises(ValueError):
        kernels.elastic_pull_worker(torch.zeros(3), torch.zeros(4), 0.5)
    with pytest.raises(TypeError):
        kernels.elastic_pull_worker(torch.zeros(3, dtype=torch.float64), torch.zeros(3), 0.5)
    with pytest.raises(ValueError):
        kernels.adahessian_scalars(kernels.AdaHessianConfig(), 0)
    assert math.isfinite(kernels.learning_rate(kernels.AdaHessianConfig(), 1))


def test_adahessian_optimizer_step_matches_cpp_update():
    """One rebound.torch.AdaHessian step equals the C++ AdaHessianUpdate on the same g and D."""
    from rebound.torch.adahessian import AdaHessian

    config = CONFIGS[1]
    torch.manual_seed(3)
    model = torch.nn.Linear(7, 5)
    x, y = torch.randn(16, 7), torch.randint(0, 5, (16,))
    opt = AdaHessian(model.parameters(), config, seed=77, replica=2)
    commands = [config_command(config)]
    expected = []
    for t in (1, 2, 3):
        before_step, m0, v0, _ = opt.export_state()
        theta0 = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward(create_graph=True)
        grads = [p.grad.detach().clone() for p in model.parameters()]
        opt.step()
        _, m1, v1, d1 = opt.export_state()
        for g, d, m, v, th, m_out, v_out, p in zip(grads, d1, m0, v0, theta0, m1, v1,
                                                  model.parameters()):
            n = g.numel()
            commands.append(f"adahessian {t} {(1.0).hex()} {n} {bits_of(g.reshape(-1))} "
                            f"{bits_of(d.reshape(-1))} {bits_of(m.reshape(-1))} "
                            f"{bits_of(v.reshape(-1))} {bits_of(th.reshape(-1))}")
            expected.append(np.concatenate([m_out.reshape(-1).numpy(), v_out.reshape(-1).numpy(),
                                            p.detach().reshape(-1).numpy()]))
        assert before_step == t - 1
    lines = oracle(commands)
    for command, line, python in zip(commands[1:], lines[1:], expected):
        assert_bits_equal(python, floats_of(line), command[:20])
