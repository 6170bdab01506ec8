#include "server/call_gate.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace rebound::server {

CallGate::Pass::~Pass() {
  if (gate_ != nullptr) gate_->Leave(units_);
}

absl::StatusOr<CallGate::Pass> CallGate::Enter(int64_t units) {
  absl::MutexLock lock(&mu_);
  if (units > capacity_ - in_use_) {
    ++refused_;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the server's bound on ", what_, " is reached (", in_use_, " ", unit_, " in use of ",
        capacity_, ", this call needs ", units, "); retry later"));
  }
  in_use_ += units;
  return Pass(this, units);
}

void CallGate::Leave(int64_t units) {
  absl::MutexLock lock(&mu_);
  in_use_ -= units;
}

int64_t CallGate::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

int64_t CallGate::refused() const {
  absl::MutexLock lock(&mu_);
  return refused_;
}

AdmissionBounds EffectiveAdmissionBounds(const ServerConfig& config, int64_t model_floats) {
  const JobConfig& job = config.job();
  const int64_t workers =
      int64_t{job.topology().replicas()} * job.topology().stages() + job.topology().spares();
  AdmissionBounds bounds;
  bounds.parked_calls =
      config.max_parked_calls() > 0 ? config.max_parked_calls() : 32 + 2 * workers;
  bounds.inflight_bytes =
      config.max_inflight_bytes() > 0
          ? config.max_inflight_bytes()
          : std::max<int64_t>(int64_t{256} << 20,
                              8 * int64_t{job.topology().replicas()} * 4 * model_floats);
  bounds.threads = config.max_threads() > 0
                       ? config.max_threads()
                       : static_cast<int>(std::min<int64_t>(
                             bounds.parked_calls + 4 * workers + 64, 1 << 20));
  return bounds;
}

}  // namespace rebound::server
