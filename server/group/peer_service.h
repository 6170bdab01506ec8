#pragma once

// PeerService: the ServerPeer gRPC service of a replicated group's member (proto/replication.proto),
// served on its peer port whatever its role. Replicate and FetchCheckpoint go to the
// ReplicationLeader while this server leads (SetLeader), else UNAVAILABLE naming the leader it
// knows; GetGroup answers this member's view of the group.
//
// Thread-safety: thread-safe. Ownership: borrows the leader; the caller shuts the peer server
// down before the leader it set goes.

#include <functional>

#include "absl/synchronization/mutex.h"
#include "proto/replication.grpc.pb.h"
#include "server/group/replication_leader.h"

namespace rebound::server {

class PeerService final : public ServerPeer::Service {
 public:
  // `fill_status` fills this member's GroupStatus (GetGroup).
  explicit PeerService(std::function<void(GroupStatus*)> fill_status)
      : fill_status_(std::move(fill_status)) {}

  void SetLeader(ReplicationLeader* leader) {
    absl::MutexLock lock(&mu_);
    leader_ = leader;
  }

  grpc::Status Replicate(
      grpc::ServerContext* context,
      grpc::ServerReaderWriter<ReplicateResponse, ReplicateRequest>* stream) override;
  grpc::Status FetchCheckpoint(grpc::ServerContext* context, const FetchCheckpointRequest* request,
                               grpc::ServerWriter<CheckpointChunk>* writer) override;
  grpc::Status GetGroup(grpc::ServerContext* context, const GetGroupRequest* request,
                        GroupStatus* response) override;

 private:
  ReplicationLeader* leader() const;
  grpc::Status NotLeader() const;

  const std::function<void(GroupStatus*)> fill_status_;
  mutable absl::Mutex mu_;
  ReplicationLeader* leader_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace rebound::server
