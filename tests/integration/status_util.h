#pragma once

// Small helpers the integration tests share for reading a cluster's state: GetStatus answers,
// centers, and the tails of process logs for failure messages.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "grpcpp/support/status.h"
#include "proto/rebound.pb.h"

namespace rebound::testing {


// True iff the status lists slots and every one is FINISHED.
bool AllFinished(const GetStatusResponse& s);

// The newest incarnation of worker `name` in `role`, or null.
const WorkerStatus* FindWorker(const GetStatusResponse& s, const std::string& name,
                               WorkerRole role);

// The worker with this incarnation, or null.
const WorkerStatus* FindIncarnation(const GetStatusResponse& s, uint64_t incarnation);

// True iff both bundles hold the same number of tensors with byte-identical data.
bool SameBytes(const TensorBundle& a, const TensorBundle& b);

// `bundle` with every FLOAT32 value v at index i of its tensor replaced by f(i, v).
TensorBundle Mapped(TensorBundle bundle, const std::function<float(size_t, float)>& f);

// `bundle` with every value moved by `delta`.
TensorBundle Shifted(TensorBundle bundle, float delta);

// Catch2 checks that `status` has `code` and a message containing `part` (the message is shown
// when it does not).
void CheckStatus(const grpc::Status& status, grpc::StatusCode code, const std::string& part);

}  // namespace rebound::testing
