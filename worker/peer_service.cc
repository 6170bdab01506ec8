#include "worker/peer_service.h"

#include <algorithm>
#include <chrono>

#include "common/grpc_status.h"

namespace rebound::worker {

grpc::Status WorkerPeerService::SendPartialSum(grpc::ServerContext* context,
                                               const PartialSum* request,
                                               PartialSumAck* response) {
  if (absl::Status allowed = token_.Check(context); !allowed.ok()) return ToGrpcStatus(allowed);
  // Take the request's contents instead of copying ~2 MB of sums: the synchronous API's request
  // object belongs to this call, which only destroys it after the handler returns, and it is
  // not on a protobuf arena, so Swap exchanges pointers.
  PartialSum message;
  auto* owned = const_cast<PartialSum*>(request);
  if (owned->GetArena() == nullptr) {
    message.Swap(owned);
  } else {
    message = *request;
  }
  absl::StatusOr<bool> mapped = mailbox_->PutPartial(std::move(message));
  if (!mapped.ok()) return ToGrpcStatus(mapped.status());
  if (*mapped) response->set_shm_mapped(true);
  return grpc::Status::OK;
}

grpc::Status WorkerPeerService::SendBoundary(grpc::ServerContext* context,
                                             const BoundaryMessage* request,
                                             BoundaryAck* response) {
  if (absl::Status allowed = token_.Check(context); !allowed.ok()) return ToGrpcStatus(allowed);
  if (port_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this worker runs no pipeline stages");
  }
  absl::StatusOr<BoundaryAck> ack = port_->Put(*request);
  if (!ack.ok()) return ToGrpcStatus(ack.status());
  *response = *std::move(ack);
  return grpc::Status::OK;
}

grpc::Status WorkerPeerService::FlushLog(grpc::ServerContext* context,
                                         const FlushLogRequest* /*request*/,
                                         FlushLogResponse* /*response*/) {
  if (absl::Status allowed = token_.Check(context); !allowed.ok()) return ToGrpcStatus(allowed);
  if (port_ == nullptr) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this worker runs no pipeline stages");
  }
  absl::Duration bound = absl::Seconds(10);
  if (context != nullptr) {
    // gRPC deadlines are wall-clock time points.
    const absl::Duration left =
        absl::FromChrono(context->deadline() - std::chrono::system_clock::now());
    bound = std::max(absl::ZeroDuration(), std::min(bound, left));
  }
  return ToGrpcStatus(port_->Flush(bound));
}

}  // namespace rebound::worker
