#include "compute/adahessian.h"

#include <cmath>

#include "absl/strings/str_format.h"

namespace rebound {
namespace compute {
namespace {

constexpr double kPi = 3.14159265358979323846;

absl::Status OutOfRange(const char* field, const char* range, double value) {
  return absl::InvalidArgumentError(
      absl::StrFormat("adahessian.%s must be %s, got %g", field, range, value));
}

// Loop bodies specialised on the power mode so that the branch leaves the loop and the common
// cases (k = 1, k = 0) vectorise; the per-element expression is AdaHessianElement's.
template <int kPowerMode>
void AdaHessianLoop(const AdaHessianScalars& scalars, const float* __restrict g,
                    const float* __restrict d, float* __restrict m, float* __restrict v,
                    float* __restrict theta, int64_t n) {
  AdaHessianScalars s = scalars;
  s.power_mode = kPowerMode;
  for (int64_t i = 0; i < n; ++i) {
    float mi = m[i];
    float vi = v[i];
    float ti = theta[i];
    AdaHessianElement(s, g[i], d[i], &mi, &vi, &ti);
    m[i] = mi;
    v[i] = vi;
    theta[i] = ti;
  }
}

// The out-of-place loop of AdaHessianUpdateInto: the same per-element expression.
template <int kPowerMode>
void AdaHessianLoopInto(const AdaHessianScalars& scalars, const float* __restrict g,
                        const float* __restrict d, const float* __restrict m_in,
                        const float* __restrict v_in, const float* __restrict theta_in,
                        float* __restrict m_out, float* __restrict v_out,
                        float* __restrict theta_out, int64_t n) {
  AdaHessianScalars s = scalars;
  s.power_mode = kPowerMode;
  for (int64_t i = 0; i < n; ++i) {
    float mi = m_in[i];
    float vi = v_in[i];
    float ti = theta_in[i];
    AdaHessianElement(s, g[i], d[i], &mi, &vi, &ti);
    m_out[i] = mi;
    v_out[i] = vi;
    theta_out[i] = ti;
  }
}

}  // namespace

absl::Status ValidateAdaHessianConfig(const AdaHessianConfig& c) {
  if (!(c.lr() > 0.0)) return OutOfRange("lr", "> 0", c.lr());
  if (!(c.beta1() >= 0.0 && c.beta1() < 1.0)) return OutOfRange("beta1", "in [0, 1)", c.beta1());
  if (!(c.beta2() >= 0.0 && c.beta2() < 1.0)) return OutOfRange("beta2", "in [0, 1)", c.beta2());
  if (!(c.epsilon() > 0.0)) return OutOfRange("epsilon", "> 0", c.epsilon());
  if (!(c.hessian_power() >= 0.0 && c.hessian_power() <= 1.0)) {
    return OutOfRange("hessian_power", "in [0, 1]", c.hessian_power());
  }
  if (!(c.weight_decay() >= 0.0)) return OutOfRange("weight_decay", ">= 0", c.weight_decay());
  if (c.hessian_every() < 1) return OutOfRange("hessian_every", ">= 1", c.hessian_every());
  if (c.block_size() < 0) return OutOfRange("block_size", ">= 0", c.block_size());
  if (c.warmup_steps() < 0) return OutOfRange("warmup_steps", ">= 0", c.warmup_steps());
  if (c.lr_decay() == LR_DECAY_UNSPECIFIED) {
    return absl::InvalidArgumentError(
        "adahessian.lr_decay must be LR_CONSTANT, LR_COSINE, LR_LINEAR or LR_STEP");
  }
  if ((c.lr_decay() == LR_COSINE || c.lr_decay() == LR_LINEAR) &&
      c.decay_steps() <= c.warmup_steps()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "adahessian.decay_steps must be > adahessian.warmup_steps = %d under %s, got %d",
        c.warmup_steps(), LrDecay_Name(c.lr_decay()), c.decay_steps()));
  }
  if (!(c.final_lr_fraction() >= 0.0 && c.final_lr_fraction() <= 1.0)) {
    return OutOfRange("final_lr_fraction", "in [0, 1]", c.final_lr_fraction());
  }
  if (c.lr_decay() == LR_STEP && c.step_every() < 1) {
    return OutOfRange("step_every", ">= 1 under LR_STEP", c.step_every());
  }
  if (!(c.step_gamma() > 0.0 && c.step_gamma() <= 1.0)) {
    return OutOfRange("step_gamma", "in (0, 1]", c.step_gamma());
  }
  return absl::OkStatus();
}

double LearningRate(const AdaHessianConfig& c, int64_t t) {
  const double lr = c.lr();
  const int64_t warmup = c.warmup_steps();
  if (warmup > 0 && t <= warmup) {
    return lr * static_cast<double>(t > 0 ? t : 0) / static_cast<double>(warmup);
  }
  const int64_t after = t - (warmup > 0 ? warmup : 0);  // u >= 1 here unless t < 1
  const double f = c.final_lr_fraction();
  switch (c.lr_decay()) {
    case LR_COSINE:
    case LR_LINEAR: {
      const int64_t span = c.decay_steps() - (warmup > 0 ? warmup : 0);
      if (span <= 0) return lr;
      double p = static_cast<double>(after) / static_cast<double>(span);
      p = p < 0.0 ? 0.0 : (p > 1.0 ? 1.0 : p);
      if (c.lr_decay() == LR_LINEAR) return lr * (1.0 - (1.0 - f) * p);
      return lr * (f + (1.0 - f) * 0.5 * (1.0 + std::cos(kPi * p)));
    }
    case LR_STEP: {
      if (c.step_every() < 1 || after < 0) return lr;
      const double drops = static_cast<double>(after / c.step_every());
      const double factor = std::pow(c.step_gamma(), drops);
      return lr * (factor > f ? factor : f);
    }
    default:
      return lr;
  }
}

AdaHessianScalars MakeAdaHessianScalars(const AdaHessianConfig& c, int64_t t, double weight) {
  AdaHessianScalars s;
  s.lr = static_cast<float>(LearningRate(c, t));
  s.beta1 = static_cast<float>(c.beta1());
  s.beta2 = static_cast<float>(c.beta2());
  s.m_coeff = static_cast<float>((1.0 - c.beta1()) * weight);
  s.v_coeff = static_cast<float>((1.0 - c.beta2()) * weight);
  s.bias1 = static_cast<float>(1.0 - std::pow(c.beta1(), static_cast<double>(t)));
  s.bias2 = static_cast<float>(1.0 - std::pow(c.beta2(), static_cast<double>(t)));
  s.epsilon = static_cast<float>(c.epsilon());
  s.weight_decay = static_cast<float>(c.weight_decay());
  s.half_power = static_cast<float>(0.5 * c.hessian_power());
  if (c.hessian_power() == 1.0) {
    s.power_mode = 1;
  } else if (c.hessian_power() == 0.0) {
    s.power_mode = 0;
  } else {
    s.power_mode = 2;
  }
  return s;
}

bool HessianDue(int64_t t, int hessian_every) {
  if (hessian_every <= 1) return true;
  return (t - 1) % hessian_every == 0;
}

absl::Status AdaHessianUpdate(const AdaHessianScalars& s, absl::Span<const float> g,
                              absl::Span<const float> d, absl::Span<float> m,
                              absl::Span<float> v, absl::Span<float> theta) {
  const size_t n = theta.size();
  if (g.size() != n || d.size() != n || m.size() != n || v.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AdaHessianUpdate: sizes differ (g %d, d %d, m %d, v %d, theta %d)", g.size(), d.size(),
        m.size(), v.size(), n));
  }
  const int64_t count = static_cast<int64_t>(n);
  switch (s.power_mode) {
    case 0:
      AdaHessianLoop<0>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), count);
      break;
    case 1:
      AdaHessianLoop<1>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), count);
      break;
    default:
      AdaHessianLoop<2>(s, g.data(), d.data(), m.data(), v.data(), theta.data(), count);
      break;
  }
  return absl::OkStatus();
}

absl::Status AdaHessianUpdateInto(const AdaHessianScalars& s, absl::Span<const float> g,
                                  absl::Span<const float> d, absl::Span<const float> m_in,
                                  absl::Span<const float> v_in, absl::Span<const float> theta_in,
                                  absl::Span<float> m_out, absl::Span<float> v_out,
                                  absl::Span<float> theta_out) {
  const size_t n = theta_in.size();
  if (g.size() != n || d.size() != n || m_in.size() != n || v_in.size() != n ||
      m_out.size() != n || v_out.size() != n || theta_out.size() != n) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AdaHessianUpdateInto: sizes differ (g %d, d %d, m %d/%d, v %d/%d, theta %d/%d)",
        g.size(), d.size(), m_in.size(), m_out.size(), v_in.size(), v_out.size(), n,
        theta_out.size()));
  }
  const int64_t count = static_cast<int64_t>(n);
  switch (s.power_mode) {
    case 0:
      AdaHessianLoopInto<0>(s, g.data(), d.data(), m_in.data(), v_in.data(), theta_in.data(),
                            m_out.data(), v_out.data(), theta_out.data(), count);
      break;
    case 1:
      AdaHessianLoopInto<1>(s, g.data(), d.data(), m_in.data(), v_in.data(), theta_in.data(),
                            m_out.data(), v_out.data(), theta_out.data(), count);
      break;
    default:
      AdaHessianLoopInto<2>(s, g.data(), d.data(), m_in.data(), v_in.data(), theta_in.data(),
                            m_out.data(), v_out.data(), theta_out.data(), count);
      break;
  }
  return absl::OkStatus();
}

absl::Status AdaHessianStep(const AdaHessianConfig& config, int64_t t, absl::Span<const float> g,
                            absl::Span<const float> d, absl::Span<float> m, absl::Span<float> v,
                            absl::Span<float> theta) {
  if (t < 1) return absl::InvalidArgumentError(absl::StrFormat("AdaHessianStep: t = %d < 1", t));
  return AdaHessianUpdate(MakeAdaHessianScalars(config, t, 1.0), g, d, m, v, theta);
}

absl::Status ServerAdaHessianApply(const AdaHessianConfig& config, double weight, int64_t t,
                                   absl::Span<const float> g, absl::Span<const float> d,
                                   absl::Span<float> m, absl::Span<float> v,
                                   absl::Span<float> theta) {
  if (t < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("ServerAdaHessianApply: t = %d < 1", t));
  }
  if (!(weight >= 0.0 && weight <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ServerAdaHessianApply: weight must be in [0, 1], got %g", weight));
  }
  return AdaHessianUpdate(MakeAdaHessianScalars(config, t, weight), g, d, m, v, theta);
}

absl::Status BlockAverageRows(int rows, int cols, int block_size, absl::Span<float> d) {
  if (rows < 0 || cols < 0 || block_size < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BlockAverageRows: bad arguments rows %d cols %d block %d", rows, cols, block_size));
  }
  if (static_cast<int64_t>(d.size()) != static_cast<int64_t>(rows) * cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "BlockAverageRows: span has %d elements, expected %d x %d", d.size(), rows, cols));
  }
  if (block_size <= 1) return absl::OkStatus();
  for (int r = 0; r < rows; ++r) {
    float* row = d.data() + static_cast<int64_t>(r) * cols;
    for (int begin = 0; begin < cols; begin += block_size) {
      const int end = begin + block_size < cols ? begin + block_size : cols;
      float sum = 0.0f;
      for (int i = begin; i < end; ++i) sum += row[i];
      const float mean = sum / static_cast<float>(end - begin);
      for (int i = begin; i < end; ++i) row[i] = mean;
    }
  }
  return absl::OkStatus();
}

absl::Status ElasticMove(float rate, absl::Span<const float> toward, absl::Span<float> y) {
  if (toward.size() != y.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ElasticMove: sizes differ (toward %d, y %d)", toward.size(), y.size()));
  }
  const float* __restrict src = toward.data();
  float* __restrict dst = y.data();
  const size_t n = y.size();
  for (size_t i = 0; i < n; ++i) dst[i] = ElasticMoveElement(dst[i], src[i], rate);
  return absl::OkStatus();
}

float CenterMoveRate(double alpha, double weight) { return static_cast<float>(alpha * weight); }

absl::Status ElasticMoveCenter(double alpha, double weight, absl::Span<const float> x,
                               absl::Span<float> center) {
  return ElasticMove(CenterMoveRate(alpha, weight), x, center);
}

absl::Status ElasticPullWorker(double alpha, absl::Span<const float> c_before,
                               absl::Span<float> x) {
  return ElasticMove(static_cast<float>(alpha), c_before, x);
}

}  // namespace compute
}  // namespace rebound
