#pragma once

// A bound on a server resource that calls hold while they run: how many calls may park a
// thread in a long poll (Pull with min_version, WaitForTask), or how many request bytes may be
// held at once. A call Enter()s with its units and holds a Pass until it returns; when the units
// would exceed the capacity it is refused with RESOURCE_EXHAUSTED (retry later) at once, so an
// attacker's calls cost no parked thread and no memory beyond the bound.
//
// Thread-safety: thread-safe (one internal mutex, a leaf). Ownership: a Pass points at its gate,
// which must outlive it. Status codes: Enter gives RESOURCE_EXHAUSTED naming the resource when
// the units would exceed the capacity.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace rebound::server {

class CallGate {
 public:
  // Releases its units when destroyed. Move-only.
  class Pass {
   public:
    Pass(Pass&& other) noexcept : gate_(other.gate_), units_(other.units_) {
      other.gate_ = nullptr;
    }
    Pass& operator=(Pass&&) = delete;
    Pass(const Pass&) = delete;
    ~Pass();

   private:
    friend class CallGate;
    Pass(CallGate* gate, int64_t units) : gate_(gate), units_(units) {}
    CallGate* gate_;
    int64_t units_;
  };

  // `what` names the resource in refusals ("parked long polls"); `unit` its unit ("calls").
  // REQUIRES: capacity >= 1.
  CallGate(std::string what, std::string unit, int64_t capacity)
      : what_(std::move(what)), unit_(std::move(unit)), capacity_(capacity) {}
  CallGate(const CallGate&) = delete;
  CallGate& operator=(const CallGate&) = delete;

  // A pass for `units` (>= 0), or RESOURCE_EXHAUSTED naming the resource, what is in use and the
  // capacity.
  absl::StatusOr<Pass> Enter(int64_t units = 1);

  int64_t in_use() const;
  int64_t capacity() const { return capacity_; }
  // Calls refused so far.
  int64_t refused() const;

 private:
  void Leave(int64_t units);

  const std::string what_;
  const std::string unit_;
  const int64_t capacity_;
  mutable absl::Mutex mu_;
  int64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t refused_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rebound::server

#include "proto/config.pb.h"

namespace rebound::server {

// The server's admission bounds: ServerConfig's max_parked_calls, max_inflight_bytes and
// max_threads where set, else sized from the job (docs/config.md):
//  * parked calls: 32 + 2 x (replicas x stages + spares): every spare's WaitForTask and a
//    Pull per worker fit twice over;
//  * bytes in flight: 8 x replicas x the model's bytes (every trainer syncing at once, with
//    room for optimizer state), at least 256 MiB;
//  * threads: parked calls + 4 x (replicas x stages + spares) + 64, so that parked long polls
//    never take the threads that heartbeats and syncs need.
struct AdmissionBounds {
  int64_t parked_calls = 0;
  int64_t inflight_bytes = 0;
  int threads = 0;
};
// `model_floats`: the parameters of all stages (the sum of their packed sizes).
AdmissionBounds EffectiveAdmissionBounds(const ServerConfig& config, int64_t model_floats);

}  // namespace rebound::server
