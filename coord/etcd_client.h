#pragma once

// EtcdClient: the project's own small client of etcd's v3 gRPC API (docs/design.md §10.1), over the
// proto subset of proto/etcd (etcd's wire format): KV (Get, Put, Delete, and two Txns:
// PutIfAbsent for leader election and CompareAndPut), leases (GrantLease, RevokeLease, and a
// LeaseKeeper thread that renews one lease) and watches (a Watcher thread per key or prefix).
//
// Endpoints and retries. The client holds one gRPC channel per endpoint ("host:port") and sends
// each call to the current endpoint with the per-call deadline. A call that fails with
// UNAVAILABLE or DEADLINE_EXCEEDED (the member is down, has no leader, timed out) moves the
// client to the next endpoint and is retried there after common/retry.h's backoff, until the
// retry policy's give_up_after has passed. A member that hangs (SIGSTOP, a stuck host) costs
// one call deadline; a watch stream on it is found dead by gRPC keepalive pings (every 6 s, 2 s
// timeout: etcd refuses pings more often than every 5 s).
//
// Retried writes. An attempt that timed out may still have been applied (etcd had it from the
// member before the member hung): a retried Put then applies the value again at a later
// revision (a watcher sees two PUT events of the same value; the value is right); Delete is
// idempotent; PutIfAbsent recognises its own earlier success (see there); RevokeLease treats
// "not found" after a lost answer as done; CompareAndPut retried after an attempt that did
// apply reports succeeded = false (the key's mod revision has moved on), so its caller
// re-reads.
//
// Leases: etcd grants whole seconds, and at least 1.5 x its election timeout (Debian's default
// 1 s: a 2 s minimum; testing/etcd runs members with 500 ms: 1 s).
//
// Revisions are etcd's store revisions (int64, increasing by one per write, shared by all
// keys); a Txn's writes all take its one revision.
//
// Status codes, by the retry rule of docs/design.md §5.1:
//   UNAVAILABLE          no endpoint answered within the retry policy (every member down, no
//                        quorum, DEADLINE_EXCEEDED on every attempt): try again later. The
//                        message names the operation, the last endpoint tried and its error,
//                        e.g. "etcd Put /a failed for 10000 ms: etcd Put /a at
//                        127.0.0.1:2379: failed to connect to all addresses; ...".
//   FAILED_PRECONDITION  the lease does not exist (any more): etcd's "requested lease not
//                        found" (a Put or PutIfAbsent with a lost lease, RevokeLease, a
//                        LeaseKeeper whose lease expired). Not retryable: the caller lost it.
//   INVALID_ARGUMENT     an empty key, no endpoints, a non-positive TTL or deadline, an
//                        expected_mod_revision < 0; and etcd's own INVALID_ARGUMENT.
//   OUT_OF_RANGE         a Watcher whose start revision etcd has compacted away.
//   CANCELLED            a Watcher or LeaseKeeper that was stopped.
//   INTERNAL             a Watcher that etcd canceled for another reason (named), a lease
//                        grant that etcd answered with an error.
//   others               etcd's own status (e.g. PERMISSION_DENIED), with the endpoint named.
//
// Thread-safety: an EtcdClient may be used from any number of threads at once. A LeaseKeeper
// and a Watcher run their own thread; their methods are thread-safe; the callback of a Watcher
// runs on the Watcher's thread, one event at a time, in revision order, and must not cancel
// its own Watcher. Calls block for at most about give_up_after + call_deadline.
//
// Ownership: Create returns the client; it borrows `options.clock`, which must outlive it. A
// LeaseKeeper or Watcher keeps the client's shared state alive itself (it may outlive the
// EtcdClient object); its destructor stops and joins its thread.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/retry.h"

namespace etcdserverpb {
class TxnRequest;
}  // namespace etcdserverpb

namespace rebound {

struct EtcdClientOptions {
  // "host:port" of each etcd member's client listener. At least one.
  std::vector<std::string> endpoints;
  // Deadline of one attempt of one call (a LeaseKeeper's steps: at most a quarter of its TTL).
  absl::Duration call_deadline = absl::Seconds(2);
  // Backoff between attempts and the time after which a call gives up (UNAVAILABLE). A
  // Watcher re-establishing its stream and a LeaseKeeper renewing use the same backoff but
  // never give up on their own: they retry until stopped (or the lease is lost).
  RetryPolicy retry = [] {
    RetryPolicy policy;
    policy.initial_backoff = absl::Milliseconds(50);
    policy.max_backoff = absl::Seconds(1);
    policy.give_up_after = absl::Seconds(10);
    return policy;
  }();
  // Borrowed; must outlive the client. nullptr: DefaultClock().
  const Clock* clock = nullptr;
};

// A key's current value.
struct EtcdValue {
  std::string value;
  int64_t create_revision = 0;
  int64_t mod_revision = 0;
  int64_t lease_id = 0;  // 0: not bound to a lease
};

struct PutIfAbsentResult {
  // True iff this call created the key.
  bool succeeded = false;
  // The Txn's revision (the store revision after it). When succeeded, the key's
  // create_revision: the winner's epoch in docs/design.md §10.1's election.
  int64_t revision = 0;
  // When !succeeded: the key's value and create_revision (the current holder's), if the key
  // still existed when the Txn ran.
  std::optional<EtcdValue> existing;
};

struct CompareAndPutResult {
  // True iff the key's mod_revision was the expected one and the value was written.
  bool succeeded = false;
  // The Txn's revision: when succeeded, the key's new mod_revision.
  int64_t revision = 0;
};

struct EtcdLease {
  int64_t id = 0;
  // As granted by etcd (whole seconds; etcd raises a TTL below its minimum).
  absl::Duration ttl;
};

// One change of a watched key.
struct EtcdEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  std::string key;
  std::string value;            // kPut: the new value; kDelete: empty
  int64_t create_revision = 0;  // kPut: the key's; kDelete: 0
  int64_t mod_revision = 0;     // the revision of this put or delete
  int64_t lease_id = 0;
};

class EtcdClientShared;  // the channels and the current endpoint, shared with the threads

// Renews one lease on one LeaseKeepAlive stream every ttl/6 from a thread of its own. A failed
// renewal (the member died, the stream broke, no answer within min(call_deadline, ttl/6)) moves
// to the next endpoint and is retried with the client's backoff, until Stop(). When etcd answers
// that the lease no longer exists, the keeper ends with FAILED_PRECONDITION.
//
// Self-fencing (docs/design.md §10.1): a holder of the lease must treat it as lost once
// `last_renewed() + ttl() / 2` has passed and stop acting on it; etcd may expire it at
// last_renewed + ttl at the earliest.
class LeaseKeeper {
 public:
  ~LeaseKeeper();  // Stop()
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  int64_t lease_id() const { return lease_id_; }
  // The time (of the client's clock) at which the last renewal was acknowledged (when
  // started: the time of KeepAlive()).
  absl::Time last_renewed() const;
  // The TTL etcd returned on the last renewal (at the start: the one passed to KeepAlive()).
  absl::Duration ttl() const;
  // Successful renewals so far.
  int64_t renewals() const;
  // OK while renewing; FAILED_PRECONDITION once the lease is lost; CANCELLED after Stop().
  absl::Status status() const;

  // Ends the renewals and joins the thread (within about 50 ms). The lease itself is not
  // revoked: it expires after its TTL unless the caller revokes it. Idempotent.
  void Stop();

 private:
  friend class EtcdClient;
  LeaseKeeper(std::shared_ptr<EtcdClientShared> shared, int64_t lease_id, absl::Duration ttl);
  void Run();

  const std::shared_ptr<EtcdClientShared> shared_;
  const int64_t lease_id_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  absl::Time last_renewed_ ABSL_GUARDED_BY(mu_);
  absl::Duration ttl_ ABSL_GUARDED_BY(mu_);
  int64_t renewals_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

struct WatchSpec {
  // A key, or with `prefix` every key that starts with it. Not empty.
  std::string key;
  bool prefix = false;
  // The first revision whose events are delivered; 0: changes after the watch is created.
  int64_t start_revision = 0;
};

// Receives the events of one watch on a thread of its own and calls the callback with each, in
// revision order. A stream that breaks (the member died, a retryable error) is re-established,
// on the next endpoint after a backoff, from the last delivered revision + 1, so no event is
// lost or delivered twice. Ends on Cancel() (status CANCELLED), or when etcd cancels the watch
// (OUT_OF_RANGE when the start revision was compacted, else etcd's reason).
class Watcher {
 public:
  ~Watcher();  // Cancel()
  Watcher(const Watcher&) = delete;
  Watcher& operator=(const Watcher&) = delete;

  // OK while watching (or re-establishing); the reason once it has ended.
  absl::Status status() const;
  // The mod revision of the last event delivered; 0 before any.
  int64_t last_revision() const;
  // Times the stream was (re-)established and etcd confirmed the watch.
  int64_t streams() const;

  // Stops the thread (cancels the stream) and joins it. Idempotent. After it returns the
  // callback is not called again. REQUIRES: not called from the callback.
  void Cancel();

 private:
  friend class EtcdClient;
  Watcher(std::shared_ptr<EtcdClientShared> shared, WatchSpec spec,
          std::function<void(const EtcdEvent&)> callback);
  void Run();
  // One stream on endpoint `i` from `*next_revision` (advanced past each delivered event):
  // returns its end status (retryable or not); `*confirmed` when etcd created the watch.
  absl::Status RunStream(int i, int64_t* next_revision, bool* confirmed);

  const std::shared_ptr<EtcdClientShared> shared_;
  const WatchSpec spec_;
  const std::function<void(const EtcdEvent&)> callback_;
  absl::Notification stop_;
  mutable absl::Mutex mu_;
  void* context_ ABSL_GUARDED_BY(mu_) = nullptr;  // the live stream's grpc::ClientContext
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  int64_t last_revision_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t streams_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

class EtcdClient {
 public:
  // INVALID_ARGUMENT for no endpoints, an empty one, or a non-positive call_deadline. Connects
  // lazily: a client of a cluster that is down is created, and its calls return UNAVAILABLE.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);

  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // The key's value (a linearizable read), or nullopt when it does not exist.
  absl::StatusOr<std::optional<EtcdValue>> Get(const std::string& key);
  // Writes the key (bound to `lease_id` unless 0); returns the put's revision (the key's new
  // mod_revision). FAILED_PRECONDITION when the lease does not exist.
  absl::StatusOr<int64_t> Put(const std::string& key, const std::string& value,
                              int64_t lease_id = 0);
  // Deletes the key if it exists; returns the store revision after the call (the deletion's
  // revision when it deleted one).
  absl::StatusOr<int64_t> Delete(const std::string& key);
  // One Txn: if the key does not exist (create_revision == 0), put it bound to `lease_id`
  // (0: none); else read it. A retry of an attempt that did create the key (its answer lost)
  // finds the key with this value and this lease (lease ids are unique) and reports it as this
  // call's success, with revision = the key's create_revision. FAILED_PRECONDITION when the
  // lease does not exist.
  absl::StatusOr<PutIfAbsentResult> PutIfAbsent(const std::string& key, const std::string& value,
                                                int64_t lease_id);
  // One Txn: if the key's mod_revision is `expected_mod_revision` (0: the key does not exist),
  // put the value (bound to `lease_id` unless 0).
  absl::StatusOr<CompareAndPutResult> CompareAndPut(const std::string& key,
                                                    int64_t expected_mod_revision,
                                                    const std::string& value,
                                                    int64_t lease_id = 0);

  // One Txn: if `guard_key` exists with create_revision `guard_create_revision` (e.g. a leader
  // key created at the leader's epoch), put `key` = `value` (no lease). Retrying an applied
  // attempt writes the same value again and succeeds again: a guarded write is idempotent
  // while the guard holds. INVALID_ARGUMENT for an empty key or a guard revision <= 0.
  absl::StatusOr<CompareAndPutResult> PutIfCreatedAt(const std::string& guard_key,
                                                     int64_t guard_create_revision,
                                                     const std::string& key,
                                                     const std::string& value);

  // A new lease of `ttl` (rounded up to whole seconds, at least 1 s); etcd may grant more.
  absl::StatusOr<EtcdLease> GrantLease(absl::Duration ttl);
  // Revokes the lease, deleting every key bound to it. FAILED_PRECONDITION when it does not
  // exist (expired or revoked).
  absl::Status RevokeLease(int64_t lease_id);
  // Starts renewing `lease` (as returned by GrantLease) until the keeper is stopped.
  // INVALID_ARGUMENT for id 0 or a TTL below 1 s.
  absl::StatusOr<std::unique_ptr<LeaseKeeper>> KeepAlive(const EtcdLease& lease);

  // Starts watching. INVALID_ARGUMENT for an empty key or a negative start revision. The first
  // stream is established by the Watcher's thread (its status() says if it fails for good).
  absl::StatusOr<std::unique_ptr<Watcher>> Watch(const WatchSpec& spec,
                                                 std::function<void(const EtcdEvent&)> callback);

  // The endpoint calls go to now (it moves on after a retryable failure).
  std::string current_endpoint() const;

 private:
  explicit EtcdClient(std::shared_ptr<EtcdClientShared> shared) : shared_(std::move(shared)) {}
  // One conditional put Txn (CompareAndPut, PutIfCreatedAt), retried as every call.
  absl::StatusOr<CompareAndPutResult> GuardedTxn(const std::string& what,
                                                 const etcdserverpb::TxnRequest& request);
  const std::shared_ptr<EtcdClientShared> shared_;
};

}  // namespace rebound
