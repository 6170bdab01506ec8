#include "server/group/standby.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/grpc_status.h"
#include "server/checkpoint_transfer.h"
#include "server/group/peer_keepalive.h"
#include "storage/format_version.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"

namespace rebound::server {
namespace {

namespace fs = std::filesystem;

absl::Status FileError(const std::string& what, const std::error_code& error) {
  const std::string message = absl::StrCat(what, ": ", error.message());
  return error == std::errc::no_space_on_device ? absl::ResourceExhaustedError(message)
                                                : absl::UnavailableError(message);
}

}  // namespace

std::string MemberAddress::Encode() const {
  return absl::StrCat("name=", name, " serve=", serve_address, " peer=", peer_address);
}

absl::StatusOr<MemberAddress> MemberAddress::Decode(const std::string& value) {
  MemberAddress address;
  for (absl::string_view field : absl::StrSplit(value, ' ', absl::SkipEmpty())) {
    const std::vector<std::string> kv = absl::StrSplit(field, absl::MaxSplits('=', 1));
    if (kv.size() != 2) continue;
    if (kv[0] == "name") address.name = kv[1];
    if (kv[0] == "serve") address.serve_address = kv[1];
    if (kv[0] == "peer") address.peer_address = kv[1];
  }
  if (address.name.empty() || address.serve_address.empty() || address.peer_address.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("a group member's address needs name=, serve= and peer=, got \"", value,
                     "\""));
  }
  return address;
}

absl::StatusOr<std::unique_ptr<Standby>> Standby::Open(StandbyOptions options) {
  if (options.store_options.data_dir.empty()) {
    return absl::InvalidArgumentError("a standby needs durability.data_dir");
  }
  if (options.store_options.replication_sink) {
    return absl::InvalidArgumentError("a standby's store must not capture its commits");
  }
  const std::string dir = options.store_options.data_dir;
  std::error_code error;
  // A catch-up that a crash interrupted: the old store goes back, the partial copy away.
  if (!fs::exists(dir, error) && fs::exists(dir + ".replaced", error)) {
    LOG(WARNING) << "putting back " << dir << ".replaced (a catch-up was interrupted)";
    fs::rename(dir + ".replaced", dir, error);
    if (error) return FileError(absl::StrCat("renaming ", dir, ".replaced"), error);
  }
  fs::remove_all(dir + ".replaced", error);
  fs::remove_all(dir + ".incoming", error);
  std::unique_ptr<Standby> standby(new Standby(std::move(options)));
  ASSIGN_OR_RETURN(standby->store_, storage::OpenDataDir(standby->options_.store_options));
  return standby;
}

bool Standby::Register(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  live_ = context;
  return true;
}

void Standby::Unregister() {
  absl::MutexLock lock(&mu_);
  live_ = nullptr;
}

void Standby::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (live_ != nullptr) live_->TryCancel();
}

void Standby::Reset() {
  absl::MutexLock lock(&mu_);
  cancelled_ = false;
}

int64_t Standby::commits_applied() const {
  absl::MutexLock lock(&mu_);
  return applied_;
}

int64_t Standby::checkpoints_fetched() const {
  absl::MutexLock lock(&mu_);
  return checkpoints_;
}

absl::Status Standby::Follow(const MemberAddress& leader, int64_t leader_epoch) {
  if (store_ == nullptr) return absl::FailedPreconditionError("Follow: the store was taken");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options_.max_message_bytes);
  args.SetMaxSendMessageSize(options_.max_message_bytes);
  AddPeerKeepalive(&args);  // a silent leader (partitioned, stopped) ends the stream in <= 1.5 s
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                   MakeChannel(leader.peer_address, options_.security, args));
  std::unique_ptr<ServerPeer::Stub> stub = ServerPeer::NewStub(channel);
  // A checkpoint, then the stream from its position: at most twice in a row (a standby that
  // falls behind again at once comes back through the group's loop).
  for (int attempt = 0; attempt < 3; ++attempt) {
    grpc::ClientContext context;
    if (!Register(&context)) return absl::CancelledError("the standby was cancelled");
    const storage::DurableStore::Position from = store_->LastApplied();
    std::unique_ptr<grpc::ClientReaderWriter<ReplicateRequest, ReplicateResponse>> stream =
        stub->Replicate(&context);
    ReplicateRequest hello;
    hello.set_name(options_.name);
    hello.set_peer_address(options_.peer_address);
    hello.set_epoch(from.epoch);
    hello.set_sequence(from.sequence);
    hello.set_leader_epoch(static_cast<uint64_t>(leader_epoch));
    hello.set_version(ProjectVersion());
    absl::Status applied;
    if (stream->Write(hello)) {
      ReplicateResponse response;
      while (stream->Read(&response)) {
        applied = store_->ApplyReplicated(response.commit());
        if (!applied.ok()) {
          context.TryCancel();
          break;
        }
        {
          absl::MutexLock lock(&mu_);
          ++applied_;
        }
        ReplicateRequest ack;
        ack.set_acked_sequence(response.commit().sequence());
        if (!stream->Write(ack)) break;
      }
    }
    const grpc::Status finished = stream->Finish();
    Unregister();
    const bool needs_checkpoint =
        applied.code() == absl::StatusCode::kFailedPrecondition ||
        (finished.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
         absl::StartsWith(finished.error_message(), "needs a checkpoint"));
    if (needs_checkpoint) {
      LOG(INFO) << "catching up from a checkpoint of '" << leader.name << "': "
                << (applied.ok() ? finished.error_message() : std::string(applied.message()));
      RETURN_IF_ERROR(CatchUp(stub.get(), leader, leader_epoch));
      continue;
    }
    if (!applied.ok()) return applied;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("the standby was cancelled");
    }
    if (finished.ok()) return absl::UnavailableError("the leader ended the stream");
    absl::Status status = FromGrpcStatus(finished);
    if (status.code() == absl::StatusCode::kCancelled) {
      status = absl::UnavailableError(absl::StrCat("the stream broke: ", status.message()));
    }
    return status;
  }
  return absl::UnavailableError("the leader asked for a checkpoint three times in a row");
}

absl::Status Standby::CatchUp(ServerPeer::Stub* stub, const MemberAddress& leader,
                              int64_t leader_epoch) {
  const std::string dir = options_.store_options.data_dir;
  const std::string incoming = dir + ".incoming";
  std::error_code error;
  fs::remove_all(incoming, error);
  fs::create_directories(incoming, error);
  if (error) return FileError(absl::StrCat("creating ", incoming), error);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options_.rpc_deadline * 10));
  if (!Register(&context)) return absl::CancelledError("the standby was cancelled");
  FetchCheckpointRequest request;
  request.set_name(options_.name);
  request.set_leader_epoch(static_cast<uint64_t>(leader_epoch));
  request.set_version(ProjectVersion());
  std::unique_ptr<grpc::ClientReader<CheckpointChunk>> reader =
      stub->FetchCheckpoint(&context, request);
  absl::StatusOr<CheckpointChunk> received =
      ReceiveCheckpoint(reader.get(), &context, incoming, absl::StrCat("'", leader.name, "'"));
  Unregister();
  RETURN_IF_ERROR(received.status());
  const CheckpointChunk& done = *received;
  const uint64_t files = done.files();
  // The leader's format; OpenDataDir below refuses one newer than this build's.
  RETURN_IF_ERROR(storage::WriteDataFormat(
      incoming, done.has_data_format_version() ? done.data_format_version()
                                               : storage::kUnrecordedDataFormat));
  store_.reset();
  fs::rename(dir, dir + ".replaced", error);
  if (error) return FileError(absl::StrCat("renaming ", dir), error);
  fs::rename(incoming, dir, error);
  if (error) return FileError(absl::StrCat("renaming ", incoming), error);
  fs::remove_all(dir + ".replaced", error);
  ASSIGN_OR_RETURN(store_, storage::OpenDataDir(options_.store_options));
  const storage::DurableStore::Position position = store_->LastApplied();
  if (position.sequence != done.sequence() || position.epoch != done.epoch()) {
    return absl::DataLossError(absl::StrCat(
        "the checkpoint from '", leader.name, "' opens at (epoch ", position.epoch, ", sequence ",
        position.sequence, "), it was announced at (", done.epoch(), ", ", done.sequence(), ")"));
  }
  {
    absl::MutexLock lock(&mu_);
    ++checkpoints_;
  }
  LOG(INFO) << "caught up from a checkpoint of '" << leader.name << "' (" << files
            << " files) at sequence " << position.sequence;
  return absl::OkStatus();
}

}  // namespace rebound::server
