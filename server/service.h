#pragma once

// The ParameterServer gRPC service. Membership calls (Register, Heartbeat, Deregister) and
// GetStatus are served here; the training calls are owned by later issues (R3-R6) and answer
// UNIMPLEMENTED until then. Handlers validate their input and never crash on it.

#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "server/membership.h"

namespace rebound::server {

class ParameterServerService final : public ParameterServer::Service {
 public:
  // REQUIRES: `membership` and `clock` outlive the service.
  ParameterServerService(const ServerConfig& config, Membership* membership, const Clock* clock);

  grpc::Status Register(grpc::ServerContext* context, const RegisterRequest* request,
                        RegisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context, const HeartbeatRequest* request,
                         HeartbeatResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context, const DeregisterRequest* request,
                          DeregisterResponse* response) override;
  grpc::Status GetStatus(grpc::ServerContext* context, const GetStatusRequest* request,
                         GetStatusResponse* response) override;

  grpc::Status Sync(grpc::ServerContext* context, const SyncRequest* request,
                    SyncResponse* response) override;
  grpc::Status Push(grpc::ServerContext* context, const PushRequest* request,
                    PushResponse* response) override;
  grpc::Status Pull(grpc::ServerContext* context, const PullRequest* request,
                    PullResponse* response) override;
  grpc::Status AppendLog(grpc::ServerContext* context,
                         grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>* stream) override;
  grpc::Status WaitForTask(grpc::ServerContext* context, const WaitForTaskRequest* request,
                           WaitForTaskResponse* response) override;
  grpc::Status ReadLog(grpc::ServerContext* context, const ReadLogRequest* request,
                       grpc::ServerWriter<LogRecord>* writer) override;
  grpc::Status ReportRecovery(grpc::ServerContext* context, const ReportRecoveryRequest* request,
                              ReportRecoveryResponse* response) override;
  grpc::Status ReportEval(grpc::ServerContext* context, const ReportEvalRequest* request,
                          ReportEvalResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const DrainRequest* request,
                     DrainResponse* response) override;

 private:
  const ServerConfig config_;
  Membership* const membership_;
  const Clock* const clock_;
  const absl::Time started_;
};

// The version string reported in GetStatus.
extern const char kServerVersion[];

}  // namespace rebound::server
