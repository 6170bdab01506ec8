"""Compiler options of the compute libraries."""

# Never fuse a*b+c into an FMA: the optimizer and elastic kernels must evaluate exactly the
# expressions of compute/elementwise_math.h on every build (bit-exact replay, docs/design.md §5.6).
COMPUTE_COPTS = ["-ffp-contract=off"]

# Hot element loops (CPU backend, optimizer loops): vectorise in every compilation mode.
# -O3 enables no unsafe float transformation (no reassociation), so results are unchanged;
# -fno-math-errno only stops sqrtf from setting errno, which blocks vectorisation.
HOT_LOOP_COPTS = COMPUTE_COPTS + [
    "-O3",
    "-fno-math-errno",
]

# nvcc: no FMA contraction either (see above), IEEE division and square root.
NVCC_FLAGS = [
    "--fmad=false",
    "--prec-div=true",
    "--prec-sqrt=true",
]
