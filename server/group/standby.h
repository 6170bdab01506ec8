#pragma once

// Standby: a replicated group's follower (docs/design.md §10.1, docs/coordination.md). It owns the
// server's DurableStore while the server does not lead, and keeps it a copy of the leader's:
// Follow opens the leader's ServerPeer.Replicate stream from the store's last applied commit,
// applies every commit in order (DurableStore::ApplyReplicated: durable before it is
// acknowledged) and acknowledges it. When the leader cannot resume it (it lacks the commits, or
// the histories diverged: a standby that held commits a new leader never had), it catches up
// from a checkpoint of the leader's store: the files are written to <data_dir>.incoming, the
// store is closed, <data_dir> is replaced by the copy (the old one kept as <data_dir>.replaced
// until the copy is in place) and opened again. Open puts a <data_dir>.replaced back when a
// crash interrupted that swap, and removes a partial <data_dir>.incoming.
//
// Status codes: Open: the store's Open errors; INVALID_ARGUMENT without a data_dir or with a
// replication sink. Follow: CANCELLED after Cancel(); UNAVAILABLE when the stream to the leader
// breaks (the leader died, or stopped leading); FAILED_PRECONDITION when the leader refuses this
// standby (another epoch, or a version it is not compatible with: the standby sends its own,
// common/version.h); DATA_LOSS for a malformed checkpoint (a path leaving the directory, a
// chunk out of order, no end); the store's errors when applying fails (this standby's disk).
//
// Thread-safety: Follow, TakeStore and store() from one thread (the group's); Cancel, Reset,
// position() and the counters from any thread. Ownership: owns the store until TakeStore.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/replication.grpc.pb.h"
#include "storage/durable_store.h"

namespace rebound::server {

// A group member as advertised in etcd (the leader key's value).
struct MemberAddress {
  std::string name;
  std::string serve_address;  // where workers reach it while it leads
  std::string peer_address;   // ServerPeer

  // "name=<name> serve=<host:port> peer=<host:port>".
  std::string Encode() const;
  // INVALID_ARGUMENT naming what is missing.
  static absl::StatusOr<MemberAddress> Decode(const std::string& value);
};

struct StandbyOptions {
  std::string name;          // this server's name in the group
  std::string peer_address;  // where this server serves ServerPeer (told to the leader)
  storage::DurableStoreOptions store_options;  // data_dir required; no replication_sink
  SecurityConfig security;   // the channel to the leader's peer port
  int max_message_bytes = 256 << 20;
  absl::Duration rpc_deadline = absl::Seconds(10);  // of a checkpoint transfer: 10 x this
};

class Standby {
 public:
  static absl::StatusOr<std::unique_ptr<Standby>> Open(StandbyOptions options);
  Standby(const Standby&) = delete;
  Standby& operator=(const Standby&) = delete;

  // Follows `leader` (of epoch `leader_epoch`) until Cancel() or the stream ends; see above.
  absl::Status Follow(const MemberAddress& leader, int64_t leader_epoch);
  // Ends the Follow in progress (and any later one until Reset) soon.
  void Cancel();
  void Reset();

  // The store; null after TakeStore.
  storage::DurableStore* store() { return store_.get(); }
  std::unique_ptr<storage::DurableStore> TakeStore() { return std::move(store_); }

  int64_t commits_applied() const;
  int64_t checkpoints_fetched() const;

 private:
  explicit Standby(StandbyOptions options) : options_(std::move(options)) {}
  // Fetches a checkpoint from the leader and makes it this standby's store.
  absl::Status CatchUp(ServerPeer::Stub* stub, const MemberAddress& leader, int64_t leader_epoch);
  // Registers the live call's context for Cancel; false when cancelled already.
  bool Register(grpc::ClientContext* context);
  void Unregister();

  const StandbyOptions options_;
  std::unique_ptr<storage::DurableStore> store_;

  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* live_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t applied_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoints_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace rebound::server
