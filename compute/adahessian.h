#pragma once

// The optimizer arithmetic of docs/design.md §4.3, §4.4 and §4.6 as plain functions over host float
// spans, shared by the server (center updates) and the worker (whose CPU backend runs exactly
// these loops; the CUDA backend runs the same per-element expressions of
// compute/elementwise_math.h).
//
// Numerics. All element arithmetic is float32 in the fixed order written in
// compute/elementwise_math.h; scalar coefficients are computed once per call in double and
// rounded to float (MakeAdaHessianScalars). Every function is deterministic.
//
// Step numbering. `t` is the 1-based count of optimizer steps applied to the tensor, including
// this one: the first step uses t = 1 (bias corrections 1 - beta^1).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "compute/elementwise_math.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {

// OK iff the config's values lie in their documented ranges (lr > 0, beta1 and beta2 in [0, 1),
// epsilon > 0, hessian_power in [0, 1], weight_decay >= 0, hessian_every >= 1,
// block_size >= 0, warmup_steps >= 0, lr_decay not LR_DECAY_UNSPECIFIED, decay_steps >
// warmup_steps under LR_COSINE and LR_LINEAR, final_lr_fraction in [0, 1], step_every >= 1
// under LR_STEP, step_gamma in (0, 1]); INVALID_ARGUMENT naming the field otherwise.
absl::Status ValidateAdaHessianConfig(const AdaHessianConfig& config);

// The learning rate of step t (1-based, as below), in double: the schedule of the config, a pure
// function of (config, t) so that a replayed or DETERMINISTIC step uses the same lr bit for bit.
// With W = warmup_steps, f = final_lr_fraction and u = t - W:
//   t <= W (W > 0):  lr * max(t, 0) / W                         (linear warm-up; t = W gives lr)
//   LR_CONSTANT:     lr
//   LR_COSINE:       lr * (f + (1 - f) * (1 + cos(pi p)) / 2)
//   LR_LINEAR:       lr * (1 - (1 - f) p)
//         where p = clamp(u / (decay_steps - W), 0, 1): f * lr from t = decay_steps on
//   LR_STEP:         lr * max(f, step_gamma^floor(u / step_every))
// decay_steps must be resolved (common/config.h EffectiveAdaHessianConfig turns the config's 0
// into the job's length); with decay_steps <= warmup_steps the decay is off (lr after the
// warm-up). The caller rounds the result to float once per step (MakeAdaHessianScalars).
double LearningRate(const AdaHessianConfig& config, int64_t t);

// The scalars of one AdaHessian update at step t >= 1 with sample weight w (1 for a trainer's
// local step; the sender's reliability weight on the server, §4.6):
//   lr: float(LearningRate(config, t))
//   beta1, beta2, epsilon, weight_decay: float(config value)
//   m_coeff = float((1 - beta1) * w)       v_coeff = float((1 - beta2) * w)
//   bias1 = float(1 - beta1^t)             bias2 = float(1 - beta2^t)        (double pow)
//   power k: exact sqrtf for k = 1, constant 1 for k = 0, powf(x, k / 2) otherwise.
AdaHessianScalars MakeAdaHessianScalars(const AdaHessianConfig& config, int64_t t,
                                        double weight = 1.0);

// True iff step t (1-based) computes a fresh Hessian diagonal D under hessian_every = k:
// t = 1, 1 + k, 1 + 2k, ... In between, the last D is reused (§4.2).
bool HessianDue(int64_t t, int hessian_every);

// The element loop: AdaHessianElement(s, g[i], d[i], &m[i], &v[i], &theta[i]) for every i.
// REQUIRES: all spans have the same size (else INVALID_ARGUMENT and nothing changes); m, v and
// theta overlap neither each other nor g and d (this applies to every function below).
absl::Status AdaHessianUpdate(const AdaHessianScalars& s, absl::Span<const float> g,
                              absl::Span<const float> d, absl::Span<float> m,
                              absl::Span<float> v, absl::Span<float> theta);

// As AdaHessianUpdate, but out of place: reads m, v and theta from the *_in spans and writes the
// results to the *_out spans, bit-identical to the in-place update. The inputs stay as they
// were, so a caller can check the results before it keeps them (the server's center, issue R9).
// REQUIRES: all spans have the same size (else INVALID_ARGUMENT and nothing changes); no output
// overlaps another span.
absl::Status AdaHessianUpdateInto(const AdaHessianScalars& s, absl::Span<const float> g,
                                  absl::Span<const float> d, absl::Span<const float> m_in,
                                  absl::Span<const float> v_in, absl::Span<const float> theta_in,
                                  absl::Span<float> m_out, absl::Span<float> v_out,
                                  absl::Span<float> theta_out);

// A trainer's local AdaHessian step t on one tensor (§4.3), with gradient g and Hessian
// diagonal estimate d (already block-averaged if configured; see BlockAverageRows), lr = the
// schedule's LearningRate(config, t):
//   m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) d*d
//   theta <- theta - lr ((m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t))^k + eps) + wd theta)
absl::Status AdaHessianStep(const AdaHessianConfig& config, int64_t t,
                            absl::Span<const float> g, absl::Span<const float> d,
                            absl::Span<float> m, absl::Span<float> v, absl::Span<float> theta);

// The server's weighted apply of §4.6 on the center: as AdaHessianStep but with the sample
// weighted by the sender's reliability w in [0, 1]:
//   m <- beta1 m + (1 - beta1) w g;   v <- beta2 v + (1 - beta2) w d*d
// `t` is the center's own step count (number of pushes applied to it, this one included); the
// lr schedule is evaluated at this t, so its step counts are the center's (about R pushes per
// trainer step).
// With w = 1 the result is bit-identical to AdaHessianStep.
absl::Status ServerAdaHessianApply(const AdaHessianConfig& config, double weight, int64_t t,
                                   absl::Span<const float> g, absl::Span<const float> d,
                                   absl::Span<float> m, absl::Span<float> v,
                                   absl::Span<float> theta);

// Spatial averaging of D (§4.3, block_size b): every block of b consecutive elements along each
// row of the row-major rows x cols tensor is replaced by its mean (float sum in ascending order
// divided by the block length; a row's last block may be shorter). A bias is one row.
// b = 0 or 1 leaves d unchanged. INVALID_ARGUMENT if d.size() != rows * cols or b < 0.
absl::Status BlockAverageRows(int rows, int cols, int block_size, absl::Span<float> d);

// The elastic move y <- y + rate * (toward - y) for every element (ElasticMoveElement).
// REQUIRES: equal sizes (else INVALID_ARGUMENT and nothing changes); y and toward do not
// overlap.
absl::Status ElasticMove(float rate, absl::Span<const float> toward, absl::Span<float> y);

// The rate of the server's center move under moving rate alpha and weight w: float(alpha * w).
float CenterMoveRate(double alpha, double weight);

// §4.4, server side: center <- center + alpha w (x - center). The caller keeps a copy of the
// center from before the move (c_before) for the reply.
absl::Status ElasticMoveCenter(double alpha, double weight, absl::Span<const float> x,
                               absl::Span<float> center);

// §4.4, worker side (and the server's computation of the worker's post-sync snapshot):
// x <- x - alpha (x - c_before), bit-identical to ElasticMove(float(alpha), c_before, x).
absl::Status ElasticPullWorker(double alpha, absl::Span<const float> c_before,
                               absl::Span<float> x);

}  // namespace compute
}  // namespace rebound
