#include "server/group/replication_leader.h"

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"
#include "common/version.h"
#include "glog/logging.h"
#include "server/checkpoint_transfer.h"

namespace rebound::server {
namespace {

// A standby is waited for once it is at most this many commits behind; it is recorded in-sync
// once it has every commit answered before that.
constexpr uint64_t kJoinWindow = 64;
// Checkpoint files go to the standby in chunks of this size.
// How often, at most, the in-sync record's floor is moved up to the commits its members hold.
constexpr absl::Duration kFloorPeriod = absl::Seconds(1);
// How often a waiting writer or barrier looks at the leadership and its stop conditions.
constexpr absl::Duration kWaitSlice = absl::Milliseconds(100);
// How often a commit held by a late lease renewal looks at the lease again.
constexpr absl::Duration kLeaseSlice = absl::Milliseconds(10);

}  // namespace

ReplicationLeader::ReplicationLeader(ReplicationLeaderOptions options,
                                     storage::DurableStore::Position last)
    : options_(std::move(options)),
      clock_(options_.clock != nullptr ? options_.clock : DefaultClock()) {
  absl::MutexLock lock(&mu_);
  last_ = last;
}

ReplicationLeader::~ReplicationLeader() { Stop(); }

absl::Status ReplicationLeader::Start() {
  const std::vector<std::string> alone = {options_.name};
  uint64_t floor = 0;
  {
    absl::MutexLock lock(&mu_);
    floor = last_.sequence;
  }
  if (absl::Status recorded = options_.record_in_sync(alone, floor); !recorded.ok()) {
    return recorded;
  }
  {
    absl::MutexLock lock(&mu_);
    recorded_in_sync_ = alone;
    recorded_floor_ = floor;
    floor_recorded_at_ = clock_->Now();
  }
  monitor_ = std::thread([this] { Monitor(); });
  return absl::OkStatus();
}

void ReplicationLeader::BeginStop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& [name, standby] : standbys_) {
      if (standby.context != nullptr) standby.context->TryCancel();
    }
  }
  stop_.Notify();
}

void ReplicationLeader::Stop() {
  BeginStop();
  if (monitor_.joinable()) monitor_.join();
}

void ReplicationLeader::Append(ReplicatedCommit commit) {
  auto response = std::make_shared<ReplicateResponse>();
  *response->mutable_commit() = std::move(commit);
  const size_t bytes = response->ByteSizeLong();
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  last_ = storage::DurableStore::Position{response->commit().epoch(), response->commit().sequence()};
  buffer_.push_back(Buffered{std::move(response), bytes, now});
  buffered_bytes_ += static_cast<int64_t>(bytes);
  while (buffered_bytes_ > options_.max_buffered_bytes && buffer_.size() > 1) {
    buffered_bytes_ -= static_cast<int64_t>(buffer_.front().bytes);
    buffer_.pop_front();
  }
}

bool ReplicationLeader::AllAcked(uint64_t sequence) const {
  for (const auto& [name, standby] : standbys_) {
    if (standby.waited_for && standby.acked < sequence) return false;
  }
  return true;
}

absl::Status ReplicationLeader::WaitReplicated(const storage::DurableStore::Position& position) {
  // Never shorter than it takes to drop a silent standby: a failed barrier fences the store
  // (storage/durable_store.h), so a deadline that fired before the monitor could drop a
  // partitioned standby would hand the leadership over for a standby's fault.
  const absl::Duration bound =
      std::max(options_.max_wait, 2 * options_.standby_timeout + absl::Seconds(1));
  const absl::Time deadline = clock_->Now() + bound;
  const uint64_t sequence = position.sequence;
  absl::MutexLock lock(&mu_);
  auto acked = [this, sequence]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !options_.sync || AllAcked(sequence);
  };
  while (true) {
    if (stopping_) return absl::UnavailableError("not the leader any more: the leader is stopping");
    const bool replicated = acked();
    mu_.Unlock();
    const absl::Status leading = options_.check_leadership();
    mu_.Lock();
    // A late lease renewal (UNAVAILABLE) holds the answer: the lease may still be held, and a
    // renewal before its TTL lets the commit be acknowledged (LeaderElection, self-fencing).
    // The wait is bounded by the lease: at TTL without a renewal the leadership is lost.
    if (!leading.ok() && leading.code() != absl::StatusCode::kUnavailable) {
      return absl::UnavailableError(leading.message());
    }
    if (replicated && leading.ok()) return absl::OkStatus();
    if (!replicated) {
      const absl::Time now = clock_->Now();
      if (now >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "commit ", sequence, " was not acknowledged by every in-sync standby within ",
            absl::FormatDuration(bound), " (nor could the silent ones be dropped)"));
      }
      mu_.AwaitWithTimeout(absl::Condition(&acked), std::min(kWaitSlice, deadline - now));
    } else {
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), kLeaseSlice);
    }
  }
}

bool ReplicationLeader::CanResumeAfter(uint64_t epoch, uint64_t sequence) const {
  if (sequence == last_.sequence) return epoch == last_.epoch;
  if (sequence > last_.sequence || buffer_.empty()) return false;
  const uint64_t first = buffer_.front().commit->commit().sequence();
  // The commit after `sequence` must be buffered, and its predecessor must be the standby's.
  if (sequence + 1 < first) return false;
  const ReplicatedCommit& next = buffer_[sequence + 1 - first].commit->commit();
  return next.previous_epoch() == epoch;
}

absl::Time ReplicationLeader::OldestUnackedSince(uint64_t acked) const {
  if (buffer_.empty() || acked >= last_.sequence) return clock_->Now();
  const uint64_t first = buffer_.front().commit->commit().sequence();
  if (acked + 1 < first) return buffer_.front().appended;
  return buffer_[acked + 1 - first].appended;
}

grpc::Status ReplicationLeader::Replicate(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<ReplicateResponse, ReplicateRequest>* stream) {
  ReplicateRequest hello;
  if (!stream->Read(&hello)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "the standby closed the stream at once");
  }
  if (hello.name().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "Replicate: the first message must name the standby");
  }
  if (hello.name() == options_.name) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("Replicate: '", hello.name(), "' is this leader's own name"));
  }
  if (absl::Status compatible =
          CheckPeerVersion(absl::StrCat("this leader '", options_.name, "'"), hello.version(),
                           absl::StrCat("the standby '", hello.name(), "'"));
      !compatible.ok()) {
    LOG(WARNING) << "Replicate: " << compatible;
    return ToGrpcStatus(compatible);
  }
  if (hello.leader_epoch() != options_.epoch) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("Replicate: this leader is of epoch ", options_.epoch,
                                     ", the standby expects epoch ", hello.leader_epoch()));
  }
  const std::string name = hello.name();
  uint64_t stream_id = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the leader is stopping");
    if (!CanResumeAfter(hello.epoch(), hello.sequence())) {
      return grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat("needs a checkpoint: the standby is at (epoch ", hello.epoch(),
                       ", sequence ", hello.sequence(), "), this leader at (epoch ", last_.epoch,
                       ", sequence ", last_.sequence, ") holds commits from ",
                       buffer_.empty() ? last_.sequence + 1
                                       : buffer_.front().commit->commit().sequence()));
    }
    Standby& standby = standbys_[name];
    if (standby.context != nullptr) standby.context->TryCancel();  // a reconnected standby
    stream_id = next_stream_id_++;
    standby.peer_address = hello.peer_address();
    // A standby that reconnects keeps its place in the in-sync set: it acknowledged before.
    standby.acked = hello.sequence();
    standby.connected = true;
    standby.stream_id = stream_id;
    standby.context = context;
    standby.state = standby.recorded ? "in sync" : "catching up";
  }
  LOG(INFO) << "standby '" << name << "' (" << hello.peer_address() << ") follows from sequence "
            << hello.sequence() + 1;

  // The standby's acknowledgements, on a thread of their own while this one writes.
  std::atomic<uint64_t> sent{hello.sequence()};
  bool reader_done = false;  // guarded by mu_
  std::thread reader([&] {
    ReplicateRequest ack;
    while (stream->Read(&ack)) {
      absl::MutexLock lock(&mu_);
      auto it = standbys_.find(name);
      if (it == standbys_.end() || it->second.stream_id != stream_id) break;
      // An acknowledgement of a commit never sent is ignored beyond what was sent.
      const uint64_t acked = std::min(ack.acked_sequence(), sent.load());
      it->second.acked = std::max(it->second.acked, acked);
    }
    absl::MutexLock lock(&mu_);
    reader_done = true;
  });

  grpc::Status result = grpc::Status::OK;
  uint64_t next = hello.sequence() + 1;
  while (true) {
    std::shared_ptr<const ReplicateResponse> response;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        const auto it = standbys_.find(name);
        return stopping_ || reader_done || it == standbys_.end() ||
               it->second.stream_id != stream_id || last_.sequence >= next;
      };
      mu_.AwaitWithTimeout(absl::Condition(&ready), kWaitSlice);
      const auto it = standbys_.find(name);
      if (stopping_) {
        result = grpc::Status(grpc::StatusCode::UNAVAILABLE, "the leader is stopping");
        break;
      }
      if (it == standbys_.end() || it->second.stream_id != stream_id) {
        result = grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "replaced by a newer stream of the same standby");
        break;
      }
      if (reader_done || context->IsCancelled()) break;
      if (last_.sequence < next) continue;
      const uint64_t first = buffer_.empty() ? last_.sequence + 1
                                             : buffer_.front().commit->commit().sequence();
      if (next < first) {
        result = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                              absl::StrCat("needs a checkpoint: the standby fell behind, commit ",
                                           next, " is no longer buffered (the buffer starts at ",
                                           first, ")"));
        break;
      }
      response = buffer_[next - first].commit;
    }
    sent.store(next);
    if (!stream->Write(*response)) break;
    ++next;
  }
  context->TryCancel();
  reader.join();
  {
    absl::MutexLock lock(&mu_);
    auto it = standbys_.find(name);
    if (it != standbys_.end() && it->second.stream_id == stream_id) {
      it->second.connected = false;
      it->second.context = nullptr;
      it->second.state = absl::StrCat("disconnected", result.ok() ? "" : ": ",
                                      result.error_message());
    }
  }
  LOG(INFO) << "standby '" << name << "' stream ended"
            << (result.ok() ? "" : absl::StrCat(": ", result.error_message()));
  return result;
}

std::vector<std::string> ReplicationLeader::InSyncWith(const std::string& name, bool add) const {
  std::vector<std::string> names = {options_.name};
  for (const auto& [other, standby] : standbys_) {
    if (other == name) {
      if (add) names.push_back(other);
    } else if (standby.recorded) {
      names.push_back(other);
    }
  }
  return names;
}

uint64_t ReplicationLeader::FloorOf(const std::vector<std::string>& names) const {
  uint64_t floor = last_.sequence;
  for (const std::string& name : names) {
    const auto it = standbys_.find(name);
    if (it != standbys_.end()) floor = std::min(floor, it->second.acked);
  }
  return floor;
}

void ReplicationLeader::Monitor() {
  while (!clock_->WaitFor(options_.tick, &stop_)) MonitorPass();
}

void ReplicationLeader::MonitorPass() {
  std::string name;
  bool add = false;
  std::vector<std::string> names;
  uint64_t floor = 0;
  std::string why;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    const absl::Time now = clock_->Now();
    for (auto& [other, standby] : standbys_) {
      if (!standby.waited_for || standby.acked >= last_.sequence) continue;
      const absl::Duration behind = now - OldestUnackedSince(standby.acked);
      if (behind < options_.standby_timeout) continue;
      why = absl::StrCat("commit ", standby.acked + 1, " unacknowledged for ",
                         absl::FormatDuration(behind),
                         standby.connected ? "" : " (disconnected)");
      if (!standby.recorded) {  // never named in etcd: just stop waiting
        Drop(other, standby, why);
        continue;
      }
      name = other;
      add = false;
      break;
    }
    if (name.empty()) {
      for (auto& [other, standby] : standbys_) {
        if (!standby.connected) continue;
        const bool alive = !standby.dropped || standby.acked > standby.dropped_acked ||
                           standby.stream_id != standby.dropped_stream_id;
        if (!standby.waited_for && alive && standby.acked + kJoinWindow >= last_.sequence) {
          // From now on no commit is answered without it.
          standby.dropped = false;
          standby.waited_for = true;
          standby.join_sequence = last_.sequence;
          standby.state = "joining the in-sync set";
        }
        if (standby.waited_for && !standby.recorded && standby.acked >= standby.join_sequence) {
          name = other;
          add = true;
          break;
        }
      }
    }
    if (name.empty()) {
      // No change of the set: its floor follows the commits, at most once a period, so that a
      // member that loses its disk is soon behind it (an empty store never leads).
      names = recorded_in_sync_;
      floor = FloorOf(names);
      if (floor <= recorded_floor_ || now - floor_recorded_at_ < kFloorPeriod) return;
    } else {
      names = InSyncWith(name, add);
      floor = FloorOf(names);
    }
  }
  const absl::Status recorded = options_.record_in_sync(names, floor);
  absl::MutexLock lock(&mu_);
  if (!recorded.ok()) {
    LOG_EVERY_N(WARNING, 20) << "cannot record the in-sync set [" << absl::StrJoin(names, ", ")
                             << "] in etcd: " << recorded;
    return;
  }
  recorded_in_sync_ = names;
  recorded_floor_ = floor;
  floor_recorded_at_ = clock_->Now();
  if (name.empty()) return;
  auto it = standbys_.find(name);
  if (it == standbys_.end()) return;
  if (add) {
    it->second.recorded = true;
    it->second.state = "in sync";
    LOG(INFO) << "standby '" << name << "' is in sync; in-sync set [" << absl::StrJoin(names, ", ")
              << "]";
  } else {
    it->second.recorded = false;
    Drop(name, it->second, why);
    LOG(WARNING) << "standby '" << name << "' dropped from the in-sync set; in-sync set ["
                 << absl::StrJoin(names, ", ")
                 << "]: what is answered now is lost with this leader's host";
  }
}

void ReplicationLeader::Drop(const std::string& name, Standby& standby, const std::string& why) {
  standby.waited_for = false;
  standby.dropped = true;
  standby.dropped_acked = standby.acked;
  standby.dropped_stream_id = standby.stream_id;
  standby.state = absl::StrCat("dropped: ", why);
  ++dropped_;
  LOG(WARNING) << "standby '" << name << "' no longer waited for: " << why
               << "; waited for again once it acknowledges past commit " << standby.acked
               << " or opens a new stream";
}

grpc::Status ReplicationLeader::FetchCheckpoint(grpc::ServerContext* context,
                                                const FetchCheckpointRequest& request,
                                                grpc::ServerWriter<CheckpointChunk>* writer) {
  if (absl::Status compatible =
          CheckPeerVersion(absl::StrCat("this leader '", options_.name, "'"), request.version(),
                           absl::StrCat("the standby '", request.name(), "'"));
      !compatible.ok()) {
    return ToGrpcStatus(compatible);
  }
  if (request.leader_epoch() != options_.epoch) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("FetchCheckpoint: this leader is of epoch ", options_.epoch,
                                     ", the standby expects epoch ", request.leader_epoch()));
  }
  absl::MutexLock lock(&checkpoint_mu_);
  const std::string dir = (std::filesystem::path(options_.checkpoint_dir) /
                           absl::StrCat("checkpoint-", ++checkpoints_)).string();
  std::error_code error;
  std::filesystem::remove_all(dir, error);
  return SendCheckpoint(*options_.store, dir, context, writer,
                        absl::StrCat("FetchCheckpoint for standby '", request.name(), "'"));
}

void ReplicationLeader::FillStatus(GroupStatus* status) const {
  absl::MutexLock lock(&mu_);
  status->set_last_sequence(last_.sequence);
  status->set_sync(options_.sync);
  for (const std::string& name : recorded_in_sync_) status->add_in_sync(name);
  const absl::Time now = clock_->Now();
  for (const auto& [name, standby] : standbys_) {
    StandbyStatus* out = status->add_standbys();
    out->set_name(name);
    out->set_peer_address(standby.peer_address);
    out->set_in_sync(standby.recorded);
    out->set_acked_sequence(standby.acked);
    out->set_lag_commits(last_.sequence > standby.acked ? last_.sequence - standby.acked : 0);
    out->set_lag_ms(absl::ToInt64Milliseconds(now - OldestUnackedSince(standby.acked)));
    out->set_state(standby.state);
  }
}

int64_t ReplicationLeader::standbys_dropped() const {
  absl::MutexLock lock(&mu_);
  return dropped_;
}

}  // namespace rebound::server
