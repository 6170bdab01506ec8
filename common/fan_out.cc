#include "common/fan_out.h"

#include <thread>

#include "absl/strings/str_cat.h"

namespace rebound {

std::vector<absl::Status> FanOut(size_t n, const std::function<absl::Status(size_t)>& fn) {
  std::vector<absl::Status> statuses(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    threads.emplace_back([&statuses, &fn, i] { statuses[i] = fn(i); });
  }
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

absl::Status FirstFailure(const std::vector<absl::Status>& statuses, absl::string_view what) {
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (!statuses[i].ok()) {
      return absl::Status(statuses[i].code(),
                          absl::StrCat(what, " ", i, ": ", statuses[i].message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace rebound
