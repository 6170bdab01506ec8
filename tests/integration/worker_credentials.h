#pragma once

// The worker credentials a test client was given (proto/rebound.proto, Identity): the tests
// register themselves as workers and must send, as a worker does, the credential of the
// incarnation a request names. Thread-safe.

#include <cstdint>
#include <map>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/security.h"
#include "grpcpp/client_context.h"
#include "proto/rebound.pb.h"

namespace rebound::testing {

class WorkerCredentials {
 public:
  // Records the credential of a registration.
  void Remember(const RegisterResponse& registered) {
    absl::MutexLock lock(&mu_);
    by_incarnation_[registered.incarnation()] = registered.credential();
  }

  // A takeover keeps the spare's credential under the new incarnation.
  void Adopt(uint64_t new_incarnation, uint64_t old_incarnation) {
    absl::MutexLock lock(&mu_);
    by_incarnation_[new_incarnation] = by_incarnation_[old_incarnation];
  }

  // The credential of `incarnation`, empty if this test did not register it.
  std::string Of(uint64_t incarnation) const {
    absl::MutexLock lock(&mu_);
    auto it = by_incarnation_.find(incarnation);
    return it == by_incarnation_.end() ? std::string() : it->second;
  }

  // The credential of the incarnation `request` names (empty for requests that name none).
  template <typename Request>
  std::string For(const Request& request) const {
    return Of(IncarnationOf(request, 0));
  }

  // Adds `credential` to a call's metadata (nothing if empty).
  static void AddTo(grpc::ClientContext* context, const std::string& credential) {
    if (!credential.empty()) context->AddMetadata(kWorkerCredentialKey, credential);
  }

 private:
  template <typename Request>
  static auto IncarnationOf(const Request& request, int)
      -> decltype(uint64_t{request.incarnation()}) {
    return request.incarnation();
  }
  template <typename Request>
  static uint64_t IncarnationOf(const Request&, long) {
    return 0;
  }

  mutable absl::Mutex mu_;
  std::map<uint64_t, std::string> by_incarnation_ ABSL_GUARDED_BY(mu_);
};

}  // namespace rebound::testing
