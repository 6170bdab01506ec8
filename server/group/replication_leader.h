#pragma once

// ReplicationLeader: the leader's half of a replicated server group (docs/design.md §10.1,
// docs/coordination.md "Replication").
//
// The leader's DurableStore hands every commit to Append (its replication sink) in commit order;
// the ServerPeer.Replicate stream of each standby (Replicate below) sends them on, in order, and
// takes the standby's acknowledgements (the commit is durable there). Commit then waits in
// WaitReplicated (the store's barrier) until every standby of the in-sync set has acknowledged
// it, so a worker's call is answered only then.
//
// The in-sync set. The leader (always) and the standbys it waits for. A standby joins in two
// steps: once it has acknowledged everything committed so far it is waited for (from then on
// no commit is answered without it), and once it has also acknowledged every commit answered
// before that (its join sequence) the set is recorded in etcd with it (record_in_sync), which
// makes it eligible to take over. A standby that leaves a commit unacknowledged for
// standby_timeout is recorded out of the set first and then no longer waited for: the set in
// etcd never names a standby that lacks an answered commit. A dropped standby is waited for
// again only once it shows progress (it acknowledges a commit past the one it stood at when
// dropped) or opens a new stream: a silent peer whose connection looks alive is not re-admitted
// (docs/coordination.md "When a standby is re-admitted"). Only the monitor thread changes the
// set, one change at a time. The record also carries a floor (every member holds the commits up
// to it), moved up at most once a second while commits go on: a member whose disk is lost is
// behind it and does not campaign (server/group/server_group.h).
//
// Resuming. A standby's first message says where its store stands (epoch, sequence). The
// leader streams from the next commit when it can tell that commit's predecessor is the
// standby's last (it holds the commits of the last max_buffered_bytes, and its own last
// position); otherwise it answers FAILED_PRECONDITION "needs a checkpoint" and the standby
// fetches one (FetchCheckpoint) and comes back with the checkpoint's position.
//
// Fencing. WaitReplicated answers only while check_leadership is OK (the lease renewed within
// TTL/2). While it says UNAVAILABLE (a late renewal: the lease may still be held) the commit
// waits, and is acknowledged if the lease is renewed in time; once it fails otherwise (the
// lease lost: not renewed within TTL) WaitReplicated fails with UNAVAILABLE, whatever the
// standbys acknowledged: the commit is then never answered.
//
// Status codes. WaitReplicated: OK; UNAVAILABLE ("not the leader any more: ...", or the leader
// is stopping); DEADLINE_EXCEEDED after max_wait (a standby neither acknowledging nor dropped,
// e.g. etcd refusing the record of the smaller set). Replicate: INVALID_ARGUMENT for a first
// message without a name; FAILED_PRECONDITION for another leader epoch, "needs a checkpoint",
// or a standby whose version is not compatible with this leader's ("incompatible versions: ...",
// common/version.h); UNAVAILABLE when the leader stops or another stream of the same standby
// replaced this one. FetchCheckpoint: the store's Checkpoint errors; FAILED_PRECONDITION for
// another leader epoch or an incompatible version.
//
// Thread-safety: thread-safe. Lock order: mu_ only (the store's locks are taken by Append's
// caller before Append takes mu_; nothing here calls into the store while holding mu_).
// Ownership: borrows the store and the clock.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "grpcpp/grpcpp.h"
#include "proto/rebound.pb.h"
#include "proto/replication.grpc.pb.h"
#include "proto/storage.pb.h"
#include "storage/durable_store.h"

namespace rebound::server {

struct ReplicationLeaderOptions {
  std::string name;   // this leader's name: the first of the in-sync set
  uint64_t epoch = 0;  // the epoch it won
  bool sync = true;   // replication.sync: false answers without waiting for standbys
  int64_t max_buffered_bytes = int64_t{256} << 20;
  absl::Duration standby_timeout = absl::Seconds(3);  // the job's failure_timeout
  // Bound of one WaitReplicated, at least 2 x standby_timeout + 1 s (the time to drop a silent
  // standby and record it): a barrier that fails fences the store, so it must not fail for a
  // standby's fault that the monitor would have handled.
  absl::Duration max_wait = absl::Seconds(30);
  absl::Duration tick = absl::Milliseconds(50);       // the monitor's period
  // Records the in-sync set (this leader's name first) in etcd, guarded by the leadership, with
  // `floor`: a sequence every member of the set has made durable (a member whose store is
  // behind it, e.g. one whose disk was lost, must not lead).
  std::function<absl::Status(const std::vector<std::string>& in_sync, uint64_t floor)>
      record_in_sync;
  // OK while this server leads; UNAVAILABLE while its lease renewal is late (it may come back);
  // another error once the leadership is lost (LeaderElection::CheckLeadership).
  std::function<absl::Status()> check_leadership;
  storage::DurableStore* store = nullptr;  // borrowed: checkpoints for catching up
  std::string checkpoint_dir;              // where checkpoints are made, each removed when sent
  const Clock* clock = nullptr;            // borrowed; nullptr: DefaultClock()
};

class ReplicationLeader {
 public:
  // `last` is the store's LastApplied() when this leadership began (nothing is buffered yet).
  ReplicationLeader(ReplicationLeaderOptions options, storage::DurableStore::Position last);
  ~ReplicationLeader();  // Stop()
  ReplicationLeader(const ReplicationLeader&) = delete;
  ReplicationLeader& operator=(const ReplicationLeader&) = delete;

  // Records the in-sync set {name} in etcd and starts the monitor thread. The error of the
  // record: the leadership cannot be used.
  absl::Status Start();
  // Ends every stream and the monitor; WaitReplicated fails from now on. Idempotent.
  void Stop();
  // Stop's first half, without waiting for the monitor (which may be in an etcd call): from now
  // on nothing is answered and the streams end. Idempotent; Stop() still joins.
  void BeginStop();

  // The store's replication sink.
  void Append(ReplicatedCommit commit);
  // The store's barrier: see the header comment.
  absl::Status WaitReplicated(const storage::DurableStore::Position& position);

  // ServerPeer handlers.
  grpc::Status Replicate(grpc::ServerContext* context,
                         grpc::ServerReaderWriter<ReplicateResponse, ReplicateRequest>* stream);
  grpc::Status FetchCheckpoint(grpc::ServerContext* context, const FetchCheckpointRequest& request,
                               grpc::ServerWriter<CheckpointChunk>* writer);

  // The standbys and the in-sync set, into `status` (role, epoch and names are the caller's).
  void FillStatus(GroupStatus* status) const;

  // Times a standby was dropped from the in-sync set (for metrics).
  int64_t standbys_dropped() const;

 private:
  struct Buffered {
    std::shared_ptr<const ReplicateResponse> commit;  // the message each stream sends
    size_t bytes = 0;
    absl::Time appended;
  };
  struct Standby {
    std::string peer_address;
    uint64_t acked = 0;       // the last sequence it acknowledged (or reported at its start)
    bool connected = false;
    uint64_t stream_id = 0;   // the live stream's; a newer stream replaces it
    grpc::ServerContext* context = nullptr;  // the live stream's, to cancel it
    bool waited_for = false;  // WaitReplicated waits for it
    bool recorded = false;    // in the in-sync set recorded in etcd
    uint64_t join_sequence = 0;  // waited_for && !recorded: recorded once acked >= this
    // Dropped from the set and not yet back: it may rejoin only once it shows it is alive, by
    // acknowledging past `dropped_acked` or on a stream newer than `dropped_stream_id`. A
    // partitioned standby's stream can stay "connected" for as long as TCP keeps it, and one
    // re-admitted on that alone would stall every commit for standby_timeout again and again.
    bool dropped = false;
    uint64_t dropped_acked = 0;
    uint64_t dropped_stream_id = 0;
    std::string state;
  };
  // Marks `standby` dropped (not waited for, not recorded) for `why`.
  void Drop(const std::string& name, Standby& standby, const std::string& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void Monitor();
  // One pass of the monitor: at most one change of the in-sync set.
  void MonitorPass();
  // The names of the in-sync set to record (this leader first), with `name` added or removed.
  std::vector<std::string> InSyncWith(const std::string& name, bool add) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The least sequence the members of `names` have made durable (this leader: its last).
  uint64_t FloorOf(const std::vector<std::string>& names) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the commit after `sequence` (epoch `epoch`) can be streamed from the buffer.
  bool CanResumeAfter(uint64_t epoch, uint64_t sequence) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool AllAcked(uint64_t sequence) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The time the oldest commit after `acked` was appended (now if there is none).
  absl::Time OldestUnackedSince(uint64_t acked) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const ReplicationLeaderOptions options_;
  const Clock* const clock_;

  mutable absl::Mutex mu_;
  std::deque<Buffered> buffer_ ABSL_GUARDED_BY(mu_);  // consecutive sequences
  int64_t buffered_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  storage::DurableStore::Position last_ ABSL_GUARDED_BY(mu_);  // the last appended
  std::map<std::string, Standby> standbys_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> recorded_in_sync_ ABSL_GUARDED_BY(mu_);
  uint64_t recorded_floor_ ABSL_GUARDED_BY(mu_) = 0;      // the floor recorded with it
  absl::Time floor_recorded_at_ ABSL_GUARDED_BY(mu_);     // when

  uint64_t next_stream_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex checkpoint_mu_;  // one checkpoint at a time
  uint64_t checkpoints_ ABSL_GUARDED_BY(checkpoint_mu_) = 0;

  absl::Notification stop_;
  std::thread monitor_;
};

}  // namespace rebound::server
