#pragma once

// Per-element math shared by the CPU loops and the CUDA kernels, so that both backends evaluate
// the same expressions in the same order: activations with their first and second derivatives
// (docs/design.md §4.1, needed by the R-operator), the AdaHessian element update (§4.3, §4.6) and the
// elastic move (§4.4).
//
// Header-only, no dependencies, usable from CUDA device code. Every expression is written out
// in float with a fixed evaluation order. The compute libraries are built with
// -ffp-contract=off (gcc) and --fmad=false (nvcc), so a*b+c is never fused into an FMA: the
// AdaHessian and elastic updates are then bit-identical on CPU and CUDA (they use only + - * /
// and sqrt, which IEEE 754 rounds exactly on both). Activations call tanhf/expf, whose last bit
// differs between glibc and CUDA.

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define REBOUND_COMPUTE_HD __host__ __device__
#else
#define REBOUND_COMPUTE_HD
#endif

namespace rebound {
namespace compute {

// Activation after a layer's affine map. kIdentity is the output layer (its logits feed softmax
// cross-entropy) and may also be used for hidden layers.
enum class Activation : int32_t {
  kIdentity = 0,
  kRelu = 1,
  kTanh = 2,
  kGelu = 3,  // tanh approximation: 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
};

// Value f(a), first derivative f'(a) and second derivative f''(a) of an activation.
// ReLU: f' = [a > 0] (0 at a = 0), f'' = 0.
struct ActivationDerivatives {
  float f;
  float d1;
  float d2;
};

REBOUND_COMPUTE_HD inline ActivationDerivatives EvalActivation(Activation act, float a) {
  ActivationDerivatives r;
  switch (act) {
    case Activation::kRelu:
      r.f = a > 0.0f ? a : 0.0f;
      r.d1 = a > 0.0f ? 1.0f : 0.0f;
      r.d2 = 0.0f;
      break;
    case Activation::kTanh: {
      const float t = tanhf(a);
      r.f = t;
      r.d1 = 1.0f - t * t;
      r.d2 = -2.0f * t * r.d1;
      break;
    }
    case Activation::kGelu: {
      const float kC = 0.7978845608028654f;  // sqrt(2 / pi)
      const float kK = 0.044715f;
      const float a2 = a * a;
      const float u = kC * (a + kK * a2 * a);
      const float t = tanhf(u);
      const float s = 1.0f - t * t;            // tanh'(u)
      const float du = kC * (1.0f + 3.0f * kK * a2);
      const float d2u = kC * (6.0f * kK * a);
      r.f = 0.5f * a * (1.0f + t);
      r.d1 = 0.5f * (1.0f + t) + 0.5f * a * s * du;
      r.d2 = s * du - a * t * s * du * du + 0.5f * a * s * d2u;
      break;
    }
    case Activation::kIdentity:
    default:
      r.f = a;
      r.d1 = 1.0f;
      r.d2 = 0.0f;
      break;
  }
  return r;
}

// One row of softmax cross-entropy with its R-op (Backend::SoftmaxCrossEntropy):
//   p = softmax(a);  loss = log(sum_j exp(a_j - max)) - (a_label - max)
//   delta_j = scale (p_j - [j == label])
//   rdelta_j = scale p_j (ra_j - sum_i p_i ra_i)
// `correct` is 1 iff the first maximum of a is at `label`. delta (and with it rdelta) may be
// null (evaluation); ra and rdelta may be null (no R-op). Sums run over j = 0, 1, ... in order.
REBOUND_COMPUTE_HD inline void SoftmaxCrossEntropyRow(const float* a, const float* ra,
                                                      int classes, int label, float scale,
                                                      float* delta, float* rdelta, float* loss,
                                                      int* correct) {
  float max = a[0];
  int argmax = 0;
  for (int j = 1; j < classes; ++j) {
    if (a[j] > max) {
      max = a[j];
      argmax = j;
    }
  }
  float sum = 0.0f;
  for (int j = 0; j < classes; ++j) sum += expf(a[j] - max);
  *loss = logf(sum) - (a[label] - max);
  *correct = argmax == label ? 1 : 0;
  if (delta == nullptr) return;
  float dot = 0.0f;
  if (ra != nullptr) {
    for (int j = 0; j < classes; ++j) dot += (expf(a[j] - max) / sum) * ra[j];
  }
  for (int j = 0; j < classes; ++j) {
    const float p = expf(a[j] - max) / sum;
    delta[j] = scale * (p - (j == label ? 1.0f : 0.0f));
    if (ra != nullptr) rdelta[j] = scale * (p * (ra[j] - dot));
  }
}

// Scalars of one AdaHessian element update, precomputed once per call (see compute/adahessian.h
// for how they derive from AdaHessianConfig, the step t and the sample weight w):
//   m' = beta1 * m + m_coeff * g                       m_coeff = (1 - beta1) * w
//   v' = beta2 * v + v_coeff * (d * d)                 v_coeff = (1 - beta2) * w
//   den = (v' / bias2) ^ (k / 2) + eps                 bias2 = 1 - beta2^t
//   theta' = theta - lr * ((m' / bias1) / den + weight_decay * theta)     bias1 = 1 - beta1^t
// where x^(k/2) is sqrtf(x) for k = 1, 1 for k = 0 and powf(x, k / 2) otherwise.
struct AdaHessianScalars {
  float lr = 0.0f;
  float beta1 = 0.0f;
  float beta2 = 0.0f;
  float m_coeff = 0.0f;
  float v_coeff = 0.0f;
  float bias1 = 1.0f;
  float bias2 = 1.0f;
  float epsilon = 0.0f;
  float weight_decay = 0.0f;
  float half_power = 0.5f;  // k / 2
  int32_t power_mode = 1;   // 0: k = 0, 1: k = 1 (sqrtf), 2: powf(x, half_power)
};

REBOUND_COMPUTE_HD inline void AdaHessianElement(const AdaHessianScalars& s, float g, float d,
                                                 float* m, float* v, float* theta) {
  const float m_new = s.beta1 * *m + s.m_coeff * g;
  const float v_new = s.beta2 * *v + s.v_coeff * (d * d);
  const float m_hat = m_new / s.bias1;
  const float v_hat = v_new / s.bias2;
  float root;
  if (s.power_mode == 1) {
    root = sqrtf(v_hat);
  } else if (s.power_mode == 0) {
    root = 1.0f;
  } else {
    root = powf(v_hat, s.half_power);
  }
  const float den = root + s.epsilon;
  const float th = *theta;
  *m = m_new;
  *v = v_new;
  *theta = th - s.lr * (m_hat / den + s.weight_decay * th);
}

// The elastic move of docs/design.md §4.4: y' = y + rate * (toward - y).
// Server: ElasticMoveElement(rate = alpha * w, toward = x) on the center c.
// Worker: ElasticMoveElement(rate = alpha, toward = c_before) on its parameters x, which is
// bit-identical to x - alpha * (x - c_before) since negation is exact.
REBOUND_COMPUTE_HD inline float ElasticMoveElement(float y, float toward, float rate) {
  const float diff = toward - y;
  return y + rate * diff;
}

}  // namespace compute
}  // namespace rebound
