#pragma once

// WorkerPeerService: the WorkerPeer gRPC service of a worker (docs/design.md §5.3, docs/protocol.md).
// Parallel replay's partial sums go to the ReplayMailbox (worker/replay_mailbox.h), pipeline
// boundary tensors to the PipelinePort (worker/pipeline_port.h), FlushLog to the port's flush
// (the trainer's step log).
//
// Thread-safety: the handlers run on gRPC's threads, any number at once; SetTokenChecker must be
// called before the service is registered. Ownership: the mailbox and the port are borrowed and
// must outlive the gRPC server that serves this service.
//
// Status codes: UNAUTHENTICATED without the configured bearer token; SendPartialSum the
// mailbox's codes (UNAVAILABLE: task not open yet, FAILED_PRECONDITION: task or step over, or a
// reference to an unmapped region, RESOURCE_EXHAUSTED: mailbox full); SendBoundary the port's
// codes; SendBoundary and FlushLog UNIMPLEMENTED on a worker without a port, FlushLog the
// flush's status (DEADLINE_EXCEEDED when the log could not be shipped within the call's
// deadline, at most 10 s).

#include <utility>

#include "common/security.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.grpc.pb.h"
#include "worker/pipeline_port.h"
#include "worker/replay_mailbox.h"

namespace rebound::worker {

// The WorkerPeer service of a worker: replay messages go to the mailbox, pipeline boundary
// tensors to the port (worker/pipeline_port.h), FlushLog to the port's flush (the trainer's step
// log). Without a port, SendBoundary and FlushLog answer UNIMPLEMENTED.
class WorkerPeerService final : public WorkerPeer::Service {
 public:
  explicit WorkerPeerService(ReplayMailbox* mailbox, PipelinePort* port = nullptr)
      : mailbox_(mailbox), port_(port) {}

  // The bearer token every call must carry (none by default). Call before serving.
  void SetTokenChecker(TokenChecker token) { token_ = std::move(token); }

  grpc::Status SendPartialSum(grpc::ServerContext* context, const PartialSum* request,
                              PartialSumAck* response) override;
  grpc::Status SendBoundary(grpc::ServerContext* context, const BoundaryMessage* request,
                            BoundaryAck* response) override;
  // Ships every buffered record of the trainer's step log, bounded by the call's deadline (at
  // most 10 s).
  grpc::Status FlushLog(grpc::ServerContext* context, const FlushLogRequest* request,
                        FlushLogResponse* response) override;

 private:
  ReplayMailbox* const mailbox_;
  PipelinePort* const port_;
  TokenChecker token_{""};
};

// The largest message the WorkerPeer service accepts (a step's sums are about 2 x 4 bytes per
// parameter: 8 MiB for a million parameters).
inline constexpr int kMaxPeerMessageBytes = 1 << 30;
// HTTP/2 flow-control window of WorkerPeer connections (both ends), so that a step's sums travel
// without waiting for window updates.
inline constexpr int kPeerWindowBytes = 16 << 20;
// Larger HTTP/2 frames and socket reads for the same messages (HTTP/2 allows frames up to
// 2^24 - 1 bytes).
inline constexpr int kPeerFrameBytes = (1 << 24) - 1;
inline constexpr int kPeerReadChunkBytes = 4 << 20;

}  // namespace rebound::worker
