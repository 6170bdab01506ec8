#include "bench/synthetic_trainers.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "compute/model_layout.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"
#include "grpcpp/generic/generic_stub.h"
#include "proto/sharding.grpc.pb.h"

namespace rebound::bench {
namespace {

constexpr char kSyncMethod[] = "/rebound.ParameterServer/Sync";
constexpr char kSyncRangeMethod[] = "/rebound.CenterRange/SyncRange";
// rebound_worker's retry backoff (WorkerConfig's defaults: backoff_initial_ms, backoff_max_ms).
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(100);
constexpr absl::Duration kMaxBackoff = absl::Seconds(5);
// Heartbeats are small; a slow link may still hold one behind a sync's bytes for seconds.
constexpr absl::Duration kHeartbeatDeadline = absl::Seconds(20);

void SetDeadline(grpc::ClientContext* context, absl::Duration deadline) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(absl::ToInt64Milliseconds(deadline)));
}

// The status of a failed call, the call named.
absl::Status Failed(const grpc::Status& status, const std::string& what) {
  const absl::Status converted = FromGrpcStatus(status);
  return absl::Status(converted.code(), absl::StrCat(what, ": ", converted.message()));
}

// A channel of the trainer's own (a local subchannel pool: no TCP connection shared with
// another trainer's channel), carrying its credential as rebound_worker's channels do.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OwnChannel(
    const std::string& address, std::shared_ptr<const WorkerCredential> credential) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  return MakeChannel(address, SecurityConfig(), args, std::move(credential));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The closed loop

void CallsInFlight::Add(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  contexts_.push_back(context);
  if (cancelled_) context->TryCancel();
}

void CallsInFlight::Remove(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), context), contexts_.end());
}

void CallsInFlight::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (grpc::ClientContext* context : contexts_) context->TryCancel();
}

bool CallsInFlight::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

int64_t LoopRun::calls() const {
  int64_t n = 0;
  for (const std::vector<absl::Time>& client : done) n += static_cast<int64_t>(client.size());
  return n;
}

int64_t LoopRun::CallsBetween(absl::Time from, absl::Time to) const {
  int64_t n = 0;
  for (const std::vector<absl::Time>& client : done) {
    for (absl::Time t : client) n += t >= from && t < to ? 1 : 0;
  }
  return n;
}

double LoopRun::WindowRate() const {
  if (window_close == absl::InfiniteFuture()) return 0.0;
  return static_cast<double>(CallsBetween(window_open, window_close)) /
         absl::ToDoubleSeconds(window_close - window_open);
}

double LoopRun::PerClientRate() const {
  double rate = 0.0;
  for (const std::vector<absl::Time>& client : done) {
    std::vector<absl::Time> in_window;
    for (absl::Time t : client) {
      if (t >= window_open && t < window_close) in_window.push_back(t);
    }
    if (in_window.size() < 2) return 0.0;
    rate += static_cast<double>(in_window.size() - 1) /
            absl::ToDoubleSeconds(in_window.back() - in_window.front());
  }
  return rate;
}

absl::StatusOr<LoopRun> RunClosedLoop(
    int clients, const LoopLimits& limits,
    const std::function<absl::Status(int client, CallsInFlight* in_flight)>& call) {
  LoopRun run;
  run.done.resize(clients);
  std::vector<CallsInFlight> in_flight(clients);
  std::vector<int64_t> completed(clients, 0);  // under mu
  int running = clients;                       // under mu
  absl::Mutex mu;
  absl::Status first_error;
  std::atomic<bool> stop{false};
  run.start = absl::Now();
  std::vector<std::thread> threads;
  for (int i = 0; i < clients; ++i) {
    threads.emplace_back([&, i] {
      std::vector<absl::Time>& done = run.done[i];
      while (static_cast<int>(done.size()) < limits.calls && !stop.load()) {
        absl::Status status = call(i, &in_flight[i]);
        if (!status.ok()) {
          absl::MutexLock lock(&mu);
          if (!in_flight[i].cancelled() && first_error.ok()) {
            first_error = std::move(status);
            stop.store(true);
            for (CallsInFlight& calls : in_flight) calls.Cancel();
          }
          break;
        }
        done.push_back(absl::Now());
        absl::MutexLock lock(&mu);
        ++completed[i];
      }
      absl::MutexLock lock(&mu);
      --running;
    });
  }
  // The window: opened once every client completed a call and the warm-up passed.
  auto every_client_called = [&](int64_t calls) {
    return std::all_of(completed.begin(), completed.end(),
                       [calls](int64_t n) { return n >= calls; });
  };
  std::vector<int64_t> completed_at_open;
  while (true) {
    absl::SleepFor(absl::Milliseconds(5));
    absl::MutexLock lock(&mu);
    if (running == 0 || stop.load()) break;
    const absl::Time now = absl::Now();
    if (run.window_open == absl::InfiniteFuture()) {
      if (now >= run.start + limits.warmup && every_client_called(1)) {
        run.window_open = now;
        completed_at_open = completed;
        if (limits.at_open) limits.at_open();
      }
    } else if (now >= run.window_open + limits.window && [&] {
                 int64_t total = 0;
                 for (int i = 0; i < clients; ++i) {
                   if (completed[i] - completed_at_open[i] < limits.window_calls) return false;
                   total += completed[i] - completed_at_open[i];
                 }
                 return total >= limits.window_total_calls;
               }()) {
      run.window_close = now;
      if (limits.at_close) limits.at_close();
      stop.store(true);
      for (CallsInFlight& calls : in_flight) calls.Cancel();
      break;
    }
  }
  for (std::thread& thread : threads) thread.join();
  run.end = absl::Now();
  if (!first_error.ok()) return first_error;
  return run;
}

void RemoveDataDirectories(const std::string& run_dir) {
  std::error_code error;
  std::vector<std::filesystem::path> directories;
  for (const auto& entry : std::filesystem::directory_iterator(run_dir, error)) {
    if (entry.is_directory(error)) directories.push_back(entry.path());
  }
  for (const std::filesystem::path& directory : directories) {
    std::filesystem::remove_all(directory, error);
  }
}

struct SyntheticTrainers::Trainer {
  int index = 0;
  std::shared_ptr<WorkerCredential> credential = std::make_shared<WorkerCredential>();
  std::unique_ptr<ParameterServer::Stub> control;  // group 0: register, heartbeat, commit
  // K = 1: one, on the control channel; K > 1: one per group, on a channel of its own.
  std::vector<std::unique_ptr<grpc::GenericStub>> sync_stubs;
  RegisterResponse registration;
  std::atomic<int64_t> step{0};  // of the last completed sync
};

SyntheticTrainers::SyntheticTrainers(const SyntheticOptions& options)
    : options_(options), reply_bytes_(std::max(1, options.job.sharding().groups())) {}

absl::StatusOr<std::unique_ptr<SyntheticTrainers>> SyntheticTrainers::Start(
    const SyntheticOptions& options) {
  const JobConfig& job = options.job;
  const int groups = std::max(1, job.sharding().groups());
  if (job.topology().stages() != 1 || options.trainers < 1 ||
      options.trainers > job.topology().replicas()) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic trainers need one stage and 1 .. replicas (",
                     job.topology().replicas(), ") trainers, got ", options.trainers));
  }
  std::unique_ptr<SyntheticTrainers> self(new SyntheticTrainers(options));
  ASSIGN_OR_RETURN(const compute::StageLayout layout,
                   compute::StageLayout::Create(job.model(), 0, job.model().layers_size()));
  const int64_t n = layout.packed_size();
  self->center_floats_ = n;

  // The parameters and optimizer state every trainer sends: finite, small, not the center.
  std::vector<float> x(n), m(n, 1e-4f), v(n, 1e-8f), d(n, 1e-3f);
  for (int64_t i = 0; i < n; ++i) x[i] = 0.01f * std::sin(0.001f * static_cast<float>(i));
  if (groups == 1) {
    SyncRequest body;
    *body.mutable_params() = compute::BundleFromPacked(layout, x);
    OptimizerState* optimizer = body.mutable_optimizer();
    *optimizer->mutable_m() = compute::BundleFromPacked(layout, m);
    *optimizer->mutable_v() = compute::BundleFromPacked(layout, v);
    *optimizer->mutable_last_hdiag() = compute::BundleFromPacked(layout, d);
    self->bodies_.push_back(body.SerializeAsString());
  } else {
    for (int k = 0; k < groups; ++k) {
      ASSIGN_OR_RETURN(const compute::StageLayout range, compute::RangeLayout(0, n, groups, k));
      const int64_t begin = compute::RangeBegin(n, groups, k);
      const int64_t size = compute::RangeBegin(n, groups, k + 1) - begin;
      auto part = [&](const std::vector<float>& all) {
        return compute::BundleFromPacked(range, absl::MakeConstSpan(all).subspan(begin, size));
      };
      SyncRangeRequest body;
      *body.mutable_params() = part(x);
      OptimizerState* optimizer = body.mutable_optimizer();
      *optimizer->mutable_m() = part(m);
      *optimizer->mutable_v() = part(v);
      *optimizer->mutable_last_hdiag() = part(d);
      self->bodies_.push_back(body.SerializeAsString());
    }
  }

  for (int i = 0; i < options.trainers; ++i) RETURN_IF_ERROR(self->Register(i));
  self->heartbeats_ = std::thread([raw = self.get()] { raw->Heartbeats(); });
  return self;
}

SyntheticTrainers::~SyntheticTrainers() {
  stop_heartbeats_.Notify();
  if (heartbeats_.joinable()) heartbeats_.join();
  for (const std::unique_ptr<Trainer>& trainer : trainers_) {
    DeregisterRequest request;
    request.set_incarnation(trainer->registration.incarnation());
    DeregisterResponse response;
    grpc::ClientContext context;
    SetDeadline(&context, absl::Seconds(5));
    (void)trainer->control->Deregister(&context, request, &response);
  }
}

absl::Status SyntheticTrainers::Register(int index) {
  auto trainer = std::make_unique<Trainer>();
  trainer->index = index;
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> control,
                   OwnChannel(options_.coordinator, trainer->credential));
  trainer->control = ParameterServer::NewStub(control);
  RegisterRequest request;
  request.set_job_id(options_.job.job_id());
  request.set_worker_name(absl::StrCat("synthetic-", index));
  request.set_requested_role(TRAINER);
  grpc::ClientContext context;
  SetDeadline(&context, options_.rpc_deadline);
  const grpc::Status status = trainer->control->Register(&context, request, &trainer->registration);
  const std::string what = absl::StrCat("registration of synthetic trainer ", index);
  if (!status.ok()) return Failed(status, what);
  const RegisterResponse& registration = trainer->registration;
  if (registration.role() != TRAINER) {
    return absl::InternalError(
        absl::StrCat(what, ": got role ", WorkerRole_Name(registration.role())));
  }
  trainer->credential->Set(registration.credential());
  if (groups() == 1) {
    trainer->sync_stubs.push_back(std::make_unique<grpc::GenericStub>(control));
  } else {
    if (registration.range_addresses_size() != groups()) {
      return absl::InternalError(absl::StrCat(what, ": ", registration.range_addresses_size(),
                                              " range addresses for ", groups(), " groups"));
    }
    for (const std::string& address : registration.range_addresses()) {
      ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                       OwnChannel(address, trainer->credential));
      trainer->sync_stubs.push_back(std::make_unique<grpc::GenericStub>(channel));
    }
  }
  trainers_.push_back(std::move(trainer));
  return absl::OkStatus();
}

int64_t SyntheticTrainers::request_bytes(int g) const {
  // The per-call header (incarnation, slot, step, range, optimizer step) is tens of bytes.
  SyncRangeRequest header;
  header.set_incarnation(std::numeric_limits<uint32_t>::max());
  header.mutable_slot()->set_replica(1);
  header.set_step(1 << 20);
  header.set_range(g);
  header.mutable_optimizer()->set_step(1 << 20);
  return static_cast<int64_t>(bodies_[g].size() + header.ByteSizeLong());
}

int64_t SyntheticTrainers::sync_bytes() const {
  int64_t bytes = 0;
  for (int g = 0; g < groups(); ++g) bytes += request_bytes(g) + reply_bytes(g);
  return bytes;
}

absl::Status SyntheticTrainers::Sync(Trainer& trainer, CallsInFlight* in_flight) {
  const int64_t step = trainer.step.load() + options_.job.easgd().sync_period();
  const RegisterResponse& registration = trainer.registration;
  const int groups = this->groups();
  const std::string what =
      absl::StrCat("sync of synthetic trainer ", trainer.index, " at step ", step);
  std::vector<std::string> headers(groups);
  for (int g = 0; g < groups; ++g) {
    if (groups == 1) {
      SyncRequest request;
      request.set_incarnation(registration.incarnation());
      *request.mutable_slot() = registration.slot();
      request.set_step(step);
      request.mutable_optimizer()->set_step(step);
      request.set_loss(0.5);
      request.set_data_epoch(0);
      request.set_data_offset(0);
      headers[g] = request.SerializeAsString();
    } else {
      SyncRangeRequest request;
      request.set_incarnation(registration.incarnation());
      *request.mutable_slot() = registration.slot();
      request.set_step(step);
      request.set_range(g);
      request.mutable_optimizer()->set_step(step);
      headers[g] = request.SerializeAsString();
    }
  }

  // Every range at once; the ranges that failed with UNAVAILABLE or DEADLINE_EXCEEDED again
  // after a backoff, as rebound_worker retries a call (worker/retry.h), until the deadline.
  struct Call {
    grpc::ClientContext context;
    grpc::ByteBuffer request;
    grpc::ByteBuffer reply;
    grpc::Status status;
  };
  std::vector<grpc::ByteBuffer> replies(groups);
  std::vector<bool> retried(groups, false);
  std::vector<int> todo(groups);
  for (int g = 0; g < groups; ++g) todo[g] = g;
  const absl::Time give_up = absl::Now() + options_.rpc_deadline;
  absl::Duration backoff = kFirstBackoff;
  while (!todo.empty()) {
    std::vector<std::unique_ptr<Call>> calls;
    absl::BlockingCounter pending(static_cast<int>(todo.size()));
    for (int g : todo) {
      // The header, then the shared tensors: protobuf merges the two optimizer fields.
      grpc::Slice slices[2] = {
          grpc::Slice(headers[g]),
          grpc::Slice(bodies_[g].data(), bodies_[g].size(), grpc::Slice::STATIC_SLICE)};
      calls.push_back(std::make_unique<Call>());
      Call& call = *calls.back();
      call.request = grpc::ByteBuffer(slices, 2);
      SetDeadline(&call.context, give_up - absl::Now());
      in_flight->Add(&call.context);
      trainer.sync_stubs[g]->UnaryCall(&call.context, groups == 1 ? kSyncMethod : kSyncRangeMethod,
                                       grpc::StubOptions(), &call.request, &call.reply,
                                       [&call, &pending](grpc::Status status) {
                                         call.status = std::move(status);
                                         pending.DecrementCount();
                                       });
    }
    pending.Wait();
    std::vector<int> again;
    for (size_t i = 0; i < todo.size(); ++i) {
      const int g = todo[i];
      Call& call = *calls[i];
      in_flight->Remove(&call.context);
      if (call.status.ok()) {
        replies[g] = std::move(call.reply);
        continue;
      }
      const grpc::StatusCode code = call.status.error_code();
      if ((code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) &&
          !in_flight->cancelled() && absl::Now() + backoff < give_up) {
        again.push_back(g);
        retried[g] = true;
        ++retries_;
        continue;
      }
      return Failed(call.status, groups == 1 ? what : absl::StrCat(what, ", range ", g));
    }
    if (!again.empty()) {
      absl::SleepFor(backoff);
      backoff = std::min(2 * backoff, kMaxBackoff);
    }
    todo = std::move(again);
  }

  CommitSyncRequest commit;
  for (int g = 0; g < groups; ++g) {
    const std::string range = groups == 1 ? what : absl::StrCat(what, ", range ", g);
    reply_bytes_[g].store(static_cast<int64_t>(replies[g].Length()));
    // A retried call may find its first attempt applied (its reply lost): then the answer is
    // the stored post-sync state, as the product promises.
    bool fresh = false, stored = false;
    if (groups == 1) {
      SyncResponse reply;
      if (grpc::SerializationTraits<SyncResponse>::Deserialize(&replies[g], &reply).ok()) {
        fresh = reply.center_before().tensors_size() > 0;
        stored = reply.has_worker_params_after();
      }
    } else {
      SyncRangeResponse reply;
      if (grpc::SerializationTraits<SyncRangeResponse>::Deserialize(&replies[g], &reply).ok()) {
        fresh = reply.center_before().tensors_size() == 1;
        stored = reply.has_worker_params_after();
      }
      RangeSyncResult* result = commit.add_ranges();
      result->set_range(g);
      result->set_center_version(reply.center_version());
      result->set_partial_sq_norm(reply.partial_sq_norm());
    }
    if (!(fresh || (stored && retried[g]))) {
      return absl::InternalError(absl::StrCat(range, ": neither a fresh apply nor a retry's"));
    }
  }
  if (groups > 1) {
    commit.set_incarnation(registration.incarnation());
    *commit.mutable_slot() = registration.slot();
    commit.set_step(step);
    commit.set_loss(0.5);
    bool commit_retried = false;
    absl::Duration commit_backoff = kFirstBackoff;
    while (true) {
      CommitSyncResponse committed;
      grpc::ClientContext context;
      SetDeadline(&context, give_up - absl::Now());
      in_flight->Add(&context);
      const grpc::Status status = trainer.control->CommitSync(&context, commit, &committed);
      in_flight->Remove(&context);
      if (status.ok()) {
        if (committed.duplicate() && !commit_retried) {
          return absl::InternalError(absl::StrCat(what, ": the commit was a duplicate"));
        }
        break;
      }
      const grpc::StatusCode code = status.error_code();
      if ((code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::DEADLINE_EXCEEDED) &&
          !in_flight->cancelled() && absl::Now() + commit_backoff < give_up) {
        commit_retried = true;
        ++retries_;
        absl::SleepFor(commit_backoff);
        commit_backoff = std::min(2 * commit_backoff, kMaxBackoff);
        continue;
      }
      return Failed(status, absl::StrCat(what, ": commit"));
    }
  }
  trainer.step.store(step);
  return absl::OkStatus();
}

absl::StatusOr<LoopRun> SyntheticTrainers::Run(const LoopLimits& limits) {
  if (window_closed_) {
    return absl::FailedPreconditionError(
        "the trainers ran a window that closed: their cancelled syncs are not committed");
  }
  absl::StatusOr<LoopRun> run = RunClosedLoop(
      trainers(), limits,
      [this](int i, CallsInFlight* in_flight) { return Sync(*trainers_[i], in_flight); });
  if (run.ok() && run->window_close != absl::InfiniteFuture()) window_closed_ = true;
  return run;
}

void SyntheticTrainers::Heartbeats() {
  const absl::Duration interval =
      absl::Milliseconds(options_.job.fault_tolerance().heartbeat_interval_ms());
  while (!stop_heartbeats_.WaitForNotificationWithTimeout(interval)) {
    for (const std::unique_ptr<Trainer>& trainer : trainers_) {
      HeartbeatRequest request;
      request.set_incarnation(trainer->registration.incarnation());
      request.set_step(trainer->step.load());
      request.set_loss(0.5);
      HeartbeatResponse response;
      grpc::ClientContext context;
      SetDeadline(&context, kHeartbeatDeadline);
      if (!trainer->control->Heartbeat(&context, request, &response).ok()) ++heartbeat_errors_;
    }
  }
}

}  // namespace rebound::bench
