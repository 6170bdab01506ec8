#pragma once

// An independent double-precision MLP for the compute tests: plain loops written from the
// formulas of docs/design.md §4.1, sharing no code with compute/mlp.cc. Parameters are in the packed
// layout of compute/model_layout.h (per layer: weight out x in row-major, then bias).

#include <vector>

#include "compute/model_layout.h"

namespace rebound {
namespace compute {
namespace testing {

struct RefActivation {
  double f;
  double d1;
  double d2;
};

// f, f', f'' of `act` at a, in double.
RefActivation RefEval(Activation act, double a);

// Mean softmax cross-entropy over `rows` samples of x (rows x input_dim row-major) with labels y.
double RefLoss(const std::vector<LayerInfo>& layers, const std::vector<double>& params,
               const std::vector<double>& x, const std::vector<int>& y, int rows);

// The gradient of RefLoss by ordinary back-propagation, in the packed layout.
std::vector<double> RefGradient(const std::vector<LayerInfo>& layers,
                                const std::vector<double>& params, const std::vector<double>& x,
                                const std::vector<int>& y, int rows);

// Number of parameters of the packed layout.
int RefParamCount(const std::vector<LayerInfo>& layers);

}  // namespace testing
}  // namespace compute
}  // namespace rebound
