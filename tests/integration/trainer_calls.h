#pragma once

// A LocalCluster whose test plays trainers itself: it registers them, builds Sync and Push
// requests and sends them with their credentials, and reads the center through an observer
// (a spare that only pulls). Shared by the tests that send hostile or extreme updates
// (bad_input_test, center_integrity_test).
//
// Thread-safety: as LocalCluster (the test case's thread; REQUIREs). Ownership: owns its
// processes through LocalCluster.

#include <cstdint>
#include <string>
#include <utility>

#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {

class TrainerCallsCluster : public LocalCluster {
 public:
  TrainerCallsCluster(const std::string& job_text, const LocalClusterOptions& options)
      : LocalCluster(job_text, options), observer_(RegisterObserver("observer")) {}

  // Registers this test as the trainer of the next free slot.
  RegisterResponse RegisterTrainer(const std::string& name) {
    RegisterResponse response = Register(name, TRAINER);
    REQUIRE(response.role() == TRAINER);
    return response;
  }

  PullResponse Center() { return Pull(observer_); }

  SyncRequest MakeSync(const RegisterResponse& trainer, int64_t step, TensorBundle params) {
    SyncRequest request;
    request.set_incarnation(trainer.incarnation());
    *request.mutable_slot() = trainer.slot();
    request.set_step(step);
    *request.mutable_params() = std::move(params);
    return request;
  }

  grpc::Status Sync(const SyncRequest& request, SyncResponse* response = nullptr) {
    SyncResponse ignored;
    return Call(&ParameterServer::Stub::Sync, request, response != nullptr ? response : &ignored);
  }

  // A push of (g, D) = (g, d) at every element of the slot's stage.
  PushRequest MakePush(const RegisterResponse& trainer, uint64_t sequence, float g, float d) {
    PushRequest request;
    request.set_incarnation(trainer.incarnation());
    *request.mutable_slot() = trainer.slot();
    request.set_sequence(sequence);
    request.set_step(static_cast<int64_t>(sequence));
    const TensorBundle center = Center().center();
    *request.mutable_gradient() = Mapped(center, [g](size_t, float) { return g; });
    *request.mutable_hessian_diag() = Mapped(center, [d](size_t, float) { return d; });
    return request;
  }

  grpc::Status Push(const PushRequest& request, PushResponse* response = nullptr) {
    PushResponse ignored;
    return Call(&ParameterServer::Stub::Push, request, response != nullptr ? response : &ignored);
  }

 private:
  const uint64_t observer_;
};

}  // namespace rebound::testing
