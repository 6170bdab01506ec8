// ParameterServerService::Backup: an online, consistent copy of the durable state for an
// operator (docs/operations.md#backup-and-restore; reboundctl backup writes it with a manifest,
// rebound_server --restore_from starts from it). The store's checkpoint (RocksDB's, SST files
// hard-linked, plus a copy of every tensor file a record names, at one commit) is made in the
// data directory and streamed; commits wait only while the checkpoint is made, not while it is
// sent.

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/checkpoint_transfer.h"
#include "server/service.h"

namespace rebound::server {

grpc::Status ParameterServerService::Backup(grpc::ServerContext* context,
                                            const BackupRequest* request,
                                            grpc::ServerWriter<CheckpointChunk>* writer) {
  if (absl::Status allowed = CheckOperator(context); !allowed.ok()) return ToGrpcStatus(allowed);
  if (request->max_bytes_per_second() < 0) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "Backup: max_bytes_per_second must be >= 0 (0 = unpaced), got ",
        request->max_bytes_per_second())));
  }
  const std::string& data_dir = config_.durability().data_dir();
  if (store_ == nullptr || data_dir.empty()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        "Backup: this server keeps its state in memory only (no durability.data_dir): there is "
        "nothing durable to back up"));
  }
  absl::MutexLock lock(&backup_mu_);
  const std::string dir = absl::StrCat(data_dir, "/backup-checkpoints/backup-", ++backups_);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return SendCheckpoint(*store_, dir, context, writer, absl::StrCat("Backup ", backups_),
                        /*position=*/nullptr, request->max_bytes_per_second());
}

}  // namespace rebound::server
