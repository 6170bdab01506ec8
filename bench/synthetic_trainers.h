#pragma once

// Closed-loop clients without compute, in the benchmark's own process, for the benchmarks that
// measure how fast server groups answer syncs (sharding, server_capacity):
//
// RunClosedLoop: N clients, each on a thread of its own, each issuing its next call as soon as
// the last one answered, with a measured window: it opens once every client has completed a
// call and a warm-up has passed, and closes a set time later, when every call still in flight
// is cancelled (and not counted). Or, without a window, a fixed number of calls per client.
//
// SyntheticTrainers: trainers on such a loop. Each registers with group 0 as a TRAINER (a slot,
// an incarnation and a credential of its own), is kept alive by one heartbeat thread shared by
// all, and syncs the same precomputed parameters and optimizer state over and over, steps tau,
// 2 tau, ..., through the product's protocol as rebound_worker speaks it:
//   * a job of one group: ParameterServer.Sync (params + optimizer state out, c_before back);
//   * a sharded job of K groups (docs/design.md §10.2): CenterRange.SyncRange of every range at once
//     (range k to group k), then ParameterServer.CommitSync at group 0 once every range
//     answered, as worker/range_client.cc does.
// A call that fails with UNAVAILABLE or DEADLINE_EXCEEDED is retried after a backoff, as
// rebound_worker retries (worker/retry.h; a range group answers UNAVAILABLE when group 0 did not
// authorize the call in time), and counted (retries()).
// What a real trainer does besides is left out: no training step between two syncs; no packing
// of the parameters into a request (each request's tensor part, params and optimizer m, v and
// last_hdiag of the range, is serialized once and shared by every trainer's calls as one gRPC
// slice; only a small header is serialized per call: incarnation, slot, step, range and the
// optimizer state's step, which protobuf merges with the shared part's optimizer field); no
// elastic pull on the reply (it is parsed and checked: a fresh apply, then dropped). Each
// trainer has channels of its own (their own TCP connections, as a process of its own would
// have): one to group 0 for registration, heartbeats, commits and (K = 1) syncs, and for K > 1
// one to each group for its range.
//
// Thread-safety: one thread (the benchmark's main thread) calls RunClosedLoop, Start, Run and
// the destructor; the clients' calls run on threads of their own. Ownership: a SyntheticTrainers
// owns its channels and threads; the destructor stops the heartbeats and deregisters every
// trainer. Status codes: the first failing call's (gRPC's code, the call named in the message);
// INTERNAL for an answer that is not a fresh apply (or, to a retried call, the stored one), or a
// first commit found duplicate;
// FAILED_PRECONDITION for a Run after one whose window closed.

#include <atomic>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.grpc.pb.h"

namespace rebound::bench {

// The calls one client has in flight, so that the loop can cancel them when its window closes.
// Thread-safe.
class CallsInFlight {
 public:
  // Adds `context` (borrowed until Remove); cancels it at once when Cancel() came before.
  void Add(grpc::ClientContext* context) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(grpc::ClientContext* context) ABSL_LOCKS_EXCLUDED(mu_);
  // Cancels every call added and not removed, and every later one.
  void Cancel() ABSL_LOCKS_EXCLUDED(mu_);
  bool cancelled() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

struct LoopLimits {
  int calls = std::numeric_limits<int>::max();  // per client, then it stops
  // The window opens at the later of start + warmup and the completion of every client's first
  // call, and closes `window` later; a client then stops, its call in flight cancelled.
  absl::Duration warmup = absl::ZeroDuration();
  absl::Duration window = absl::InfiniteDuration();
  // ... and stays open until every client has completed this many calls in it, and until this
  // many calls in all have completed in it.
  int window_calls = 0;
  int window_total_calls = 0;
  // Called on the loop's own thread (RunClosedLoop's caller) as the window opens and closes,
  // e.g. to read the CPU the servers used in it. Optional.
  std::function<void()> at_open;
  std::function<void()> at_close;
};

// What one loop saw.
struct LoopRun {
  absl::Time start;
  absl::Time window_open = absl::InfiniteFuture();   // never opened: InfiniteFuture
  absl::Time window_close = absl::InfiniteFuture();  // never closed (calls ran out): InfiniteFuture
  absl::Time end;                                    // when the last client stopped
  // Per client, the time each of its calls completed.
  std::vector<std::vector<absl::Time>> done;

  int64_t calls() const;
  // The calls that completed in [from, to).
  int64_t CallsBetween(absl::Time from, absl::Time to) const;
  // Calls completed in the window per second; 0 when it did not close.
  double WindowRate() const;
  // The same from each client's own completions in the window: the sum over the clients of
  // (n - 1) / (its last's time - its first's), each a whole number of its cycles. Unlike
  // WindowRate it does not depend on where the window's ends fall between two completions,
  // which matters when there are few (long calls) and they come in bursts (clients that started
  // together); 0 unless every client completed at least two calls in the window.
  double PerClientRate() const;
};

// Runs `call(client, in_flight)` in a closed loop on `clients` threads until `limits` end it.
// `call` registers the ClientContexts of its calls with `in_flight` while they run. A failed
// call stops every client and its error is returned, except one that failed because the window
// closed (in_flight cancelled).
absl::StatusOr<LoopRun> RunClosedLoop(
    int clients, const LoopLimits& limits,
    const std::function<absl::Status(int client, CallsInFlight* in_flight)>& call);

struct SyntheticOptions {
  // The job the groups run: its model spec (stage 0's layout), easgd.sync_period, topology
  // (one stage; replicas >= trainers), sharding.groups (K) and heartbeat interval.
  JobConfig job;
  // Where group 0 is (host:port); the other groups' addresses come with the registration.
  std::string coordinator;
  int trainers = 1;
  // Of every sync and commit; a sync of a large center behind a slow link takes long.
  absl::Duration rpc_deadline = absl::Minutes(10);
};

// Removes every directory inside `run_dir`: the data directories of the servers a run started
// (RocksDB and tensor files: GBs for a large center), which are kept neither with --keep_logs nor
// after a failed run; the logs and configs, files beside them, stay.
void RemoveDataDirectories(const std::string& run_dir);

class SyntheticTrainers {
 public:
  // Builds the shared request parts, registers `trainers` trainers one after the other and
  // starts the heartbeats.
  static absl::StatusOr<std::unique_ptr<SyntheticTrainers>> Start(const SyntheticOptions& options);
  ~SyntheticTrainers();

  SyntheticTrainers(const SyntheticTrainers&) = delete;
  SyntheticTrainers& operator=(const SyntheticTrainers&) = delete;

  int groups() const { return static_cast<int>(bodies_.size()); }
  int trainers() const { return static_cast<int>(trainers_.size()); }
  int64_t center_floats() const { return center_floats_; }
  // Bytes of one trainer's sync that group g receives (its request) and sends back (its reply),
  // each as gRPC carries them (the serialized message, without HTTP/2 framing); the reply's as
  // measured by the last sync (0 before one).
  int64_t request_bytes(int g) const;
  int64_t reply_bytes(int g) const { return reply_bytes_[g].load(); }
  // Summed over the groups: one whole sync (without its small commit).
  int64_t sync_bytes() const;
  // Heartbeats that failed (a slow link may delay one: the job's failure_timeout says when that
  // would fence a trainer).
  int64_t heartbeat_errors() const { return heartbeat_errors_.load(); }
  // Calls retried (UNAVAILABLE or DEADLINE_EXCEEDED, as rebound_worker retries them).
  int64_t retries() const { return retries_.load(); }

  // Every trainer syncs in a closed loop (RunClosedLoop) until `limits` end it. After a Run whose
  // window closed (its cancelled syncs were applied by some groups and not committed) the
  // trainers cannot run again: FAILED_PRECONDITION.
  absl::StatusOr<LoopRun> Run(const LoopLimits& limits);

 private:
  struct Trainer;

  explicit SyntheticTrainers(const SyntheticOptions& options);

  absl::Status Register(int index);
  // One sync of `trainer` at its next step.
  absl::Status Sync(Trainer& trainer, CallsInFlight* in_flight);
  void Heartbeats();

  const SyntheticOptions options_;
  int64_t center_floats_ = 0;
  // Per group: the requests' shared tensor part, serialized (SyncRequest for K = 1,
  // SyncRangeRequest of range g for K > 1).
  std::vector<std::string> bodies_;
  std::vector<std::atomic<int64_t>> reply_bytes_;
  std::vector<std::unique_ptr<Trainer>> trainers_;
  bool window_closed_ = false;
  std::atomic<int64_t> heartbeat_errors_{0};
  std::atomic<int64_t> retries_{0};
  absl::Notification stop_heartbeats_;
  std::thread heartbeats_;
};

}  // namespace rebound::bench
