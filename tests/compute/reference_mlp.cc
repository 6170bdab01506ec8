#include "tests/compute/reference_mlp.h"

#include <algorithm>
#include <cmath>

namespace rebound {
namespace compute {
namespace testing {

RefActivation RefEval(Activation act, double a) {
  switch (act) {
    case Activation::kRelu:
      return {a > 0 ? a : 0.0, a > 0 ? 1.0 : 0.0, 0.0};
    case Activation::kTanh: {
      const double t = std::tanh(a);
      return {t, 1 - t * t, -2 * t * (1 - t * t)};
    }
    case Activation::kGelu: {
      // g(a) = a/2 (1 + tanh(u)), u = c (a + k a^3).
      const double c = std::sqrt(2.0 / M_PI);
      const double k = 0.044715;
      const double u = c * (a + k * a * a * a);
      const double up = c * (1 + 3 * k * a * a);
      const double upp = c * 6 * k * a;
      const double t = std::tanh(u);
      const double sech2 = 1 - t * t;
      const double f = 0.5 * a * (1 + t);
      const double d1 = 0.5 * (1 + t) + 0.5 * a * sech2 * up;
      // d/da of d1: 0.5 sech2 up + 0.5 sech2 up + 0.5 a (-2 t sech2 up) up + 0.5 a sech2 upp.
      const double d2 = sech2 * up - a * t * sech2 * up * up + 0.5 * a * sech2 * upp;
      return {f, d1, d2};
    }
    case Activation::kIdentity:
    default:
      return {a, 1.0, 0.0};
  }
}

int RefParamCount(const std::vector<LayerInfo>& layers) {
  int n = 0;
  for (const LayerInfo& l : layers) n += l.out * l.in + l.out;
  return n;
}

namespace {

// Forward pass keeping every layer's input h_l and pre-activation a_l.
void Forward(const std::vector<LayerInfo>& layers, const std::vector<double>& params,
             const std::vector<double>& x, int rows, std::vector<std::vector<double>>* hs,
             std::vector<std::vector<double>>* as) {
  hs->assign(1, x);
  as->clear();
  size_t offset = 0;
  for (const LayerInfo& l : layers) {
    const double* w = params.data() + offset;
    const double* b = w + l.out * l.in;
    offset += l.out * l.in + l.out;
    const std::vector<double>& h = hs->back();
    std::vector<double> a(rows * l.out), next(rows * l.out);
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < l.out; ++o) {
        double s = b[o];
        for (int i = 0; i < l.in; ++i) s += h[r * l.in + i] * w[o * l.in + i];
        a[r * l.out + o] = s;
        next[r * l.out + o] = RefEval(l.activation, s).f;
      }
    }
    as->push_back(a);
    hs->push_back(next);
  }
}

}  // namespace

double RefLoss(const std::vector<LayerInfo>& layers, const std::vector<double>& params,
               const std::vector<double>& x, const std::vector<int>& y, int rows) {
  std::vector<std::vector<double>> hs, as;
  Forward(layers, params, x, rows, &hs, &as);
  const std::vector<double>& logits = as.back();
  const int classes = layers.back().out;
  double total = 0;
  for (int r = 0; r < rows; ++r) {
    const double* z = logits.data() + r * classes;
    const double mx = *std::max_element(z, z + classes);
    double s = 0;
    for (int j = 0; j < classes; ++j) s += std::exp(z[j] - mx);
    total += std::log(s) + mx - z[y[r]];
  }
  return total / rows;
}

std::vector<double> RefGradient(const std::vector<LayerInfo>& layers,
                                const std::vector<double>& params, const std::vector<double>& x,
                                const std::vector<int>& y, int rows) {
  std::vector<std::vector<double>> hs, as;
  Forward(layers, params, x, rows, &hs, &as);
  const int num_layers = static_cast<int>(layers.size());
  std::vector<size_t> offsets(num_layers);
  size_t offset = 0;
  for (int l = 0; l < num_layers; ++l) {
    offsets[l] = offset;
    offset += layers[l].out * layers[l].in + layers[l].out;
  }
  std::vector<double> grad(offset, 0.0);
  // delta of the logits: (softmax - onehot) / rows.
  const int classes = layers.back().out;
  std::vector<double> delta(rows * classes);
  for (int r = 0; r < rows; ++r) {
    const double* z = as.back().data() + r * classes;
    const double mx = *std::max_element(z, z + classes);
    double s = 0;
    for (int j = 0; j < classes; ++j) s += std::exp(z[j] - mx);
    for (int j = 0; j < classes; ++j) {
      delta[r * classes + j] = (std::exp(z[j] - mx) / s - (j == y[r] ? 1.0 : 0.0)) / rows;
    }
  }
  for (int l = num_layers - 1; l >= 0; --l) {
    const LayerInfo& L = layers[l];
    const double* w = params.data() + offsets[l];
    double* gw = grad.data() + offsets[l];
    double* gb = gw + L.out * L.in;
    const std::vector<double>& h = hs[l];
    for (int r = 0; r < rows; ++r) {
      for (int o = 0; o < L.out; ++o) {
        const double d = delta[r * L.out + o];
        gb[o] += d;
        for (int i = 0; i < L.in; ++i) gw[o * L.in + i] += d * h[r * L.in + i];
      }
    }
    if (l == 0) break;
    std::vector<double> below(rows * L.in, 0.0);
    for (int r = 0; r < rows; ++r) {
      for (int i = 0; i < L.in; ++i) {
        double e = 0;
        for (int o = 0; o < L.out; ++o) e += delta[r * L.out + o] * w[o * L.in + i];
        below[r * L.in + i] = e * RefEval(layers[l - 1].activation, as[l - 1][r * L.in + i]).d1;
      }
    }
    delta.swap(below);
  }
  return grad;
}

}  // namespace testing
}  // namespace compute
}  // namespace rebound
