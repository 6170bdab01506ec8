#include "server/group/peer_service.h"

#include "absl/strings/str_cat.h"

namespace rebound::server {

ReplicationLeader* PeerService::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

grpc::Status PeerService::NotLeader() const {
  GroupStatus status;
  fill_status_(&status);
  return grpc::Status(
      grpc::StatusCode::UNAVAILABLE,
      absl::StrCat("not the leader: '", status.name(), "' is ",
                   GroupStatus::Role_Name(status.role()),
                   status.leader_name().empty()
                       ? std::string("; no leader known")
                       : absl::StrCat("; the leader is '", status.leader_name(), "' at ",
                                      status.leader_peer_address())));
}

grpc::Status PeerService::Replicate(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<ReplicateResponse, ReplicateRequest>* stream) {
  ReplicationLeader* leading = leader();
  if (leading == nullptr) return NotLeader();
  return leading->Replicate(context, stream);
}

grpc::Status PeerService::FetchCheckpoint(grpc::ServerContext* context,
                                          const FetchCheckpointRequest* request,
                                          grpc::ServerWriter<CheckpointChunk>* writer) {
  ReplicationLeader* leading = leader();
  if (leading == nullptr) return NotLeader();
  return leading->FetchCheckpoint(context, *request, writer);
}

grpc::Status PeerService::GetGroup(grpc::ServerContext*, const GetGroupRequest*,
                                   GroupStatus* response) {
  fill_status_(response);
  if (ReplicationLeader* leading = leader(); leading != nullptr) leading->FillStatus(response);
  return grpc::Status::OK;
}

}  // namespace rebound::server
