#pragma once

// Summaries of a benchmark's per-round or per-run figures.

#include <string>
#include <vector>

namespace rebound::bench {

// The median of `values`: the middle one, or the mean of the two middle ones when there is an
// even number of them; NaN when `values` is empty.
double Median(std::vector<double> values);

// `values` printed with `decimals` digits after the point, separated by single spaces
// ("1.5 2.0").
std::string JoinFigures(const std::vector<double>& values, int decimals);

}  // namespace rebound::bench
