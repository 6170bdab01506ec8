#include "bench/figures.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace rebound::bench {

double Median(std::vector<double> values) {
  if (values.empty()) return NAN;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

std::string JoinFigures(const std::vector<double>& values, int decimals) {
  return absl::StrJoin(values, " ", [decimals](std::string* out, double v) {
    absl::StrAppend(out, absl::StrFormat("%.*f", decimals, v));
  });
}

}  // namespace rebound::bench
