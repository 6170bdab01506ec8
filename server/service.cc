#include "server/service.h"

#include <glog/logging.h>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace rebound::server {

const char kServerVersion[] = "rebound 0.1.0";

namespace {

grpc::Status NotYet(const char* rpc, const char* issue) {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                      absl::StrCat(rpc, " is not implemented in this version (planned: ", issue,
                                   ")"));
}

}  // namespace

ParameterServerService::ParameterServerService(const ServerConfig& config, Membership* membership,
                                               const Clock* clock)
    : config_(config), membership_(membership), clock_(clock), started_(clock->Now()) {}

grpc::Status ParameterServerService::Register(grpc::ServerContext* context,
                                              const RegisterRequest* request,
                                              RegisterResponse* response) {
  auto registered = membership_->Register(*request);
  if (!registered.ok()) {
    LOG(WARNING) << "rejected registration of '" << request->worker_name()
                 << "' from " << context->peer() << ": " << registered.status();
    return ToGrpcStatus(registered.status());
  }
  *response = *std::move(registered);
  LOG(INFO) << "registered '" << request->worker_name() << "' as "
            << WorkerRole_Name(response->role()) << " incarnation " << response->incarnation()
            << (response->has_slot() ? absl::StrCat(" slot (", response->slot().replica(), ", ",
                                                    response->slot().stage(), ")")
                                     : std::string());
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Heartbeat(grpc::ServerContext* context,
                                               const HeartbeatRequest* request,
                                               HeartbeatResponse* response) {
  auto reply = membership_->Heartbeat(*request);
  if (!reply.ok()) return ToGrpcStatus(reply.status());
  *response = *std::move(reply);
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Deregister(grpc::ServerContext* context,
                                                const DeregisterRequest* request,
                                                DeregisterResponse* response) {
  absl::Status status = membership_->Deregister(request->incarnation());
  if (status.ok()) LOG(INFO) << "incarnation " << request->incarnation() << " deregistered";
  return ToGrpcStatus(status);
}

grpc::Status ParameterServerService::GetStatus(grpc::ServerContext* context,
                                               const GetStatusRequest* request,
                                               GetStatusResponse* response) {
  const JobConfig& job = config_.job();
  response->set_job_id(job.job_id());
  response->set_server_version(kServerVersion);
  response->set_uptime_ms(absl::ToInt64Milliseconds(clock_->Now() - started_));
  response->set_replicas(job.topology().replicas());
  response->set_stages(job.topology().stages());
  response->set_weighting(job.weighting().policy());
  response->set_recovery_policy(job.fault_tolerance().policy());
  membership_->FillStatus(response);
  return grpc::Status::OK;
}

grpc::Status ParameterServerService::Sync(grpc::ServerContext*, const SyncRequest*,
                                          SyncResponse*) {
  return NotYet("Sync", "R3");
}

grpc::Status ParameterServerService::Push(grpc::ServerContext*, const PushRequest*,
                                          PushResponse*) {
  return NotYet("Push", "R3");
}

grpc::Status ParameterServerService::Pull(grpc::ServerContext*, const PullRequest*,
                                          PullResponse*) {
  return NotYet("Pull", "R3");
}

grpc::Status ParameterServerService::AppendLog(
    grpc::ServerContext*, grpc::ServerReaderWriter<AppendLogAck, AppendLogRequest>*) {
  return NotYet("AppendLog", "R4");
}

grpc::Status ParameterServerService::WaitForTask(grpc::ServerContext*, const WaitForTaskRequest*,
                                                 WaitForTaskResponse*) {
  return NotYet("WaitForTask", "R4");
}

grpc::Status ParameterServerService::ReadLog(grpc::ServerContext*, const ReadLogRequest*,
                                             grpc::ServerWriter<LogRecord>*) {
  return NotYet("ReadLog", "R4");
}

grpc::Status ParameterServerService::ReportRecovery(grpc::ServerContext*,
                                                    const ReportRecoveryRequest*,
                                                    ReportRecoveryResponse*) {
  return NotYet("ReportRecovery", "R4");
}

grpc::Status ParameterServerService::ReportEval(grpc::ServerContext*, const ReportEvalRequest*,
                                                ReportEvalResponse*) {
  return NotYet("ReportEval", "R3");
}

grpc::Status ParameterServerService::Drain(grpc::ServerContext*, const DrainRequest*,
                                           DrainResponse*) {
  return NotYet("Drain", "R6");
}

}  // namespace rebound::server
