#include "coord/etcd_client.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/backoff.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "proto/etcd/rpc.grpc.pb.h"

namespace rebound {

// The channels and stubs of every endpoint, and which one calls go to now.
class EtcdClientShared {
 public:
  explicit EtcdClientShared(EtcdClientOptions options)
      : options_(std::move(options)),
        clock_(options_.clock != nullptr ? options_.clock : DefaultClock()) {
    grpc::ChannelArguments args;
    // A restarted member is found again within a second (gRPC's default reconnect backoff
    // grows to two minutes).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    // A member that stops answering (a hung host) breaks a watch stream: pings every 6 s (etcd
    // answers pings more often than every 5 s with GOAWAY), also on a stream that carries no
    // data, dead after 2 s without an answer.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 6000);
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
    args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    for (const std::string& endpoint : options_.endpoints) {
      auto channel =
          grpc::CreateCustomChannel(endpoint, grpc::InsecureChannelCredentials(), args);
      kv_.push_back(etcdserverpb::KV::NewStub(channel));
      lease_.push_back(etcdserverpb::Lease::NewStub(channel));
      watch_.push_back(etcdserverpb::Watch::NewStub(channel));
    }
  }

  const EtcdClientOptions& options() const { return options_; }
  const Clock* clock() const { return clock_; }
  const std::string& endpoint(int i) const { return options_.endpoints[i]; }
  etcdserverpb::KV::Stub* kv(int i) { return kv_[i].get(); }
  etcdserverpb::Lease::Stub* lease(int i) { return lease_[i].get(); }
  etcdserverpb::Watch::Stub* watch(int i) { return watch_[i].get(); }

  int current() const { return current_.load(); }
  // After a retryable failure at endpoint `failed`: the next one (unless another thread has
  // already moved on).
  void MoveOn(int failed) {
    const int next = (failed + 1) % static_cast<int>(options_.endpoints.size());
    current_.compare_exchange_strong(failed, next);
  }

  // A backoff of the client's policy, capped at `cap`.
  Backoff NewBackoff(absl::Duration cap) const {
    const absl::Duration max = std::max(std::min(options_.retry.max_backoff, cap),
                                        options_.retry.initial_backoff);
    return Backoff(options_.retry.initial_backoff, max,
                   static_cast<uint64_t>(absl::ToUnixNanos(clock_->Now())));
  }

  // Runs `attempt(context, endpoint index)` (returns grpc::Status) on the current endpoint,
  // moving on and retrying on a retryable status per the policy. `on_retryable_failure` is
  // set when an attempt failed retryably (its effect unknown) before the returned one.
  template <typename Attempt>
  absl::Status Call(const std::string& what, Attempt&& attempt,
                    bool* earlier_attempt_failed = nullptr) {
    RetryLoop loop(options_.retry, clock_, nullptr, absl::StrCat("etcd ", what));
    while (true) {
      const int i = current();
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_deadline));
      absl::Status status = Annotate(attempt(&context, i), what, i);
      if (IsRetryable(status.code())) MoveOn(i);
      if (!loop.ShouldRetry(&status)) return status;
      if (earlier_attempt_failed != nullptr) *earlier_attempt_failed = true;
    }
  }

  // etcd's status as the client's: "requested lease not found" is FAILED_PRECONDITION; the
  // message names the operation and the endpoint.
  absl::Status Annotate(const grpc::Status& grpc_status, const std::string& what, int i) const {
    if (grpc_status.ok()) return absl::OkStatus();
    absl::Status status = FromGrpcStatus(grpc_status);
    absl::StatusCode code = status.code();
    if (code == absl::StatusCode::kNotFound && absl::StrContains(status.message(), "lease")) {
      code = absl::StatusCode::kFailedPrecondition;
    }
    return absl::Status(code, absl::StrCat("etcd ", what, " at ", endpoint(i), ": ",
                                           status.message()));
  }

 private:
  const EtcdClientOptions options_;
  const Clock* const clock_;
  std::vector<std::unique_ptr<etcdserverpb::KV::Stub>> kv_;
  std::vector<std::unique_ptr<etcdserverpb::Lease::Stub>> lease_;
  std::vector<std::unique_ptr<etcdserverpb::Watch::Stub>> watch_;
  std::atomic<int> current_{0};
};

namespace {

absl::Status CheckKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("etcd: empty key");
  return absl::OkStatus();
}

EtcdValue ToValue(const mvccpb::KeyValue& kv) {
  EtcdValue value;
  value.value = kv.value();
  value.create_revision = kv.create_revision();
  value.mod_revision = kv.mod_revision();
  value.lease_id = kv.lease();
  return value;
}

// The end of the range of keys that start with `prefix` (etcd's rule): the prefix with its last
// byte below 0xff incremented and the rest dropped; "\0" (every key) if there is none.
std::string PrefixRangeEnd(const std::string& prefix) {
  std::string end = prefix;
  for (int i = static_cast<int>(end.size()) - 1; i >= 0; --i) {
    if (static_cast<unsigned char>(end[i]) < 0xff) {
      end[i] = static_cast<char>(static_cast<unsigned char>(end[i]) + 1);
      end.resize(i + 1);
      return end;
    }
  }
  return std::string(1, '\0');
}

}  // namespace

// ---- EtcdClient --------------------------------------------------------------------------------

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd: no endpoints");
  for (const std::string& endpoint : options.endpoints) {
    if (endpoint.empty()) return absl::InvalidArgumentError("etcd: an empty endpoint");
  }
  if (options.call_deadline <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd: call_deadline must be positive");
  }
  return std::unique_ptr<EtcdClient>(
      new EtcdClient(std::make_shared<EtcdClientShared>(std::move(options))));
}

EtcdClient::~EtcdClient() = default;

std::string EtcdClient::current_endpoint() const {
  return shared_->endpoint(shared_->current());
}

absl::StatusOr<std::optional<EtcdValue>> EtcdClient::Get(const std::string& key) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  etcdserverpb::RangeRequest request;
  request.set_key(key);
  etcdserverpb::RangeResponse response;
  absl::Status status =
      shared_->Call(absl::StrCat("Get ", key), [&](grpc::ClientContext* context, int i) {
        response.Clear();
        return shared_->kv(i)->Range(context, request, &response);
      });
  if (!status.ok()) return status;
  if (response.kvs_size() == 0) return std::optional<EtcdValue>();
  return std::optional<EtcdValue>(ToValue(response.kvs(0)));
}

absl::StatusOr<int64_t> EtcdClient::Put(const std::string& key, const std::string& value,
                                        int64_t lease_id) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  etcdserverpb::PutRequest request;
  request.set_key(key);
  request.set_value(value);
  request.set_lease(lease_id);
  etcdserverpb::PutResponse response;
  absl::Status status =
      shared_->Call(absl::StrCat("Put ", key), [&](grpc::ClientContext* context, int i) {
        response.Clear();
        return shared_->kv(i)->Put(context, request, &response);
      });
  if (!status.ok()) return status;
  return response.header().revision();
}

absl::StatusOr<int64_t> EtcdClient::Delete(const std::string& key) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  etcdserverpb::DeleteRangeRequest request;
  request.set_key(key);
  etcdserverpb::DeleteRangeResponse response;
  absl::Status status =
      shared_->Call(absl::StrCat("Delete ", key), [&](grpc::ClientContext* context, int i) {
        response.Clear();
        return shared_->kv(i)->DeleteRange(context, request, &response);
      });
  if (!status.ok()) return status;
  return response.header().revision();
}

absl::StatusOr<PutIfAbsentResult> EtcdClient::PutIfAbsent(const std::string& key,
                                                          const std::string& value,
                                                          int64_t lease_id) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  etcdserverpb::TxnRequest request;
  etcdserverpb::Compare* compare = request.add_compare();
  compare->set_key(key);
  compare->set_target(etcdserverpb::Compare::CREATE);
  compare->set_result(etcdserverpb::Compare::EQUAL);
  compare->set_create_revision(0);
  etcdserverpb::PutRequest* put = request.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease_id);
  request.add_failure()->mutable_request_range()->set_key(key);
  etcdserverpb::TxnResponse response;
  bool earlier_attempt_failed = false;
  absl::Status status = shared_->Call(
      absl::StrCat("PutIfAbsent ", key),
      [&](grpc::ClientContext* context, int i) {
        response.Clear();
        return shared_->kv(i)->Txn(context, request, &response);
      },
      &earlier_attempt_failed);
  if (!status.ok()) return status;
  PutIfAbsentResult result;
  result.succeeded = response.succeeded();
  result.revision = response.header().revision();
  if (!result.succeeded && response.responses_size() > 0 &&
      response.responses(0).response_range().kvs_size() > 0) {
    result.existing = ToValue(response.responses(0).response_range().kvs(0));
    // An earlier attempt whose answer was lost may have created the key: with this value and
    // this lease (lease ids are never reused), it is this call's.
    if (earlier_attempt_failed && lease_id != 0 && result.existing->lease_id == lease_id &&
        result.existing->value == value) {
      result.succeeded = true;
      result.revision = result.existing->create_revision;
      result.existing.reset();
    }
  }
  return result;
}

namespace {

// A Txn: if `compare` holds, put `key` = `value` (bound to `lease_id` unless 0).
etcdserverpb::TxnRequest GuardedPut(etcdserverpb::Compare compare, const std::string& key,
                                    const std::string& value, int64_t lease_id) {
  etcdserverpb::TxnRequest request;
  *request.add_compare() = std::move(compare);
  etcdserverpb::PutRequest* put = request.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_value(value);
  put->set_lease(lease_id);
  return request;
}

}  // namespace

absl::StatusOr<CompareAndPutResult> EtcdClient::CompareAndPut(const std::string& key,
                                                              int64_t expected_mod_revision,
                                                              const std::string& value,
                                                              int64_t lease_id) {
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (expected_mod_revision < 0) {
    return absl::InvalidArgumentError("etcd CompareAndPut: negative expected_mod_revision");
  }
  etcdserverpb::Compare compare;
  compare.set_key(key);
  compare.set_target(etcdserverpb::Compare::MOD);
  compare.set_result(etcdserverpb::Compare::EQUAL);
  compare.set_mod_revision(expected_mod_revision);
  return GuardedTxn(absl::StrCat("CompareAndPut ", key),
                    GuardedPut(std::move(compare), key, value, lease_id));
}

absl::StatusOr<CompareAndPutResult> EtcdClient::PutIfCreatedAt(const std::string& guard_key,
                                                               int64_t guard_create_revision,
                                                               const std::string& key,
                                                               const std::string& value) {
  if (absl::Status s = CheckKey(guard_key); !s.ok()) return s;
  if (absl::Status s = CheckKey(key); !s.ok()) return s;
  if (guard_create_revision <= 0) {
    return absl::InvalidArgumentError("etcd PutIfCreatedAt: guard revision must be > 0");
  }
  etcdserverpb::Compare compare;
  compare.set_key(guard_key);
  compare.set_target(etcdserverpb::Compare::CREATE);
  compare.set_result(etcdserverpb::Compare::EQUAL);
  compare.set_create_revision(guard_create_revision);
  return GuardedTxn(absl::StrCat("PutIfCreatedAt ", key),
                    GuardedPut(std::move(compare), key, value, /*lease_id=*/0));
}

absl::StatusOr<CompareAndPutResult> EtcdClient::GuardedTxn(
    const std::string& what, const etcdserverpb::TxnRequest& request) {
  etcdserverpb::TxnResponse response;
  absl::Status status = shared_->Call(what, [&](grpc::ClientContext* context, int i) {
    response.Clear();
    return shared_->kv(i)->Txn(context, request, &response);
  });
  if (!status.ok()) return status;
  CompareAndPutResult result;
  result.succeeded = response.succeeded();
  result.revision = response.header().revision();
  return result;
}

absl::StatusOr<EtcdLease> EtcdClient::GrantLease(absl::Duration ttl) {
  if (ttl <= absl::ZeroDuration()) return absl::InvalidArgumentError("etcd: non-positive TTL");
  etcdserverpb::LeaseGrantRequest request;
  request.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(ttl, absl::Seconds(1)))));
  etcdserverpb::LeaseGrantResponse response;
  absl::Status status =
      shared_->Call("GrantLease", [&](grpc::ClientContext* context, int i) {
        response.Clear();
        return shared_->lease(i)->LeaseGrant(context, request, &response);
      });
  if (!status.ok()) return status;
  if (!response.error().empty() || response.id() == 0) {
    return absl::InternalError(absl::StrCat("etcd GrantLease: ", response.error()));
  }
  return EtcdLease{response.id(), absl::Seconds(response.ttl())};
}

absl::Status EtcdClient::RevokeLease(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest request;
  request.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse response;
  bool earlier_attempt_failed = false;
  absl::Status status = shared_->Call(
      absl::StrCat("RevokeLease ", lease_id),
      [&](grpc::ClientContext* context, int i) {
        return shared_->lease(i)->LeaseRevoke(context, request, &response);
      },
      &earlier_attempt_failed);
  // A retry of an attempt that did revoke it (its answer lost) finds no lease: done.
  if (earlier_attempt_failed && status.code() == absl::StatusCode::kFailedPrecondition) {
    return absl::OkStatus();
  }
  return status;
}

absl::StatusOr<std::unique_ptr<LeaseKeeper>> EtcdClient::KeepAlive(const EtcdLease& lease) {
  if (lease.id == 0) return absl::InvalidArgumentError("etcd KeepAlive: lease id 0");
  if (lease.ttl < absl::Seconds(1)) {
    return absl::InvalidArgumentError("etcd KeepAlive: TTL below 1 s");
  }
  return std::unique_ptr<LeaseKeeper>(new LeaseKeeper(shared_, lease.id, lease.ttl));
}

absl::StatusOr<std::unique_ptr<Watcher>> EtcdClient::Watch(
    const WatchSpec& spec, std::function<void(const EtcdEvent&)> callback) {
  if (absl::Status s = CheckKey(spec.key); !s.ok()) return s;
  if (spec.start_revision < 0) {
    return absl::InvalidArgumentError("etcd Watch: negative start revision");
  }
  return std::unique_ptr<Watcher>(new Watcher(shared_, spec, std::move(callback)));
}

// ---- LeaseKeeper -------------------------------------------------------------------------------

namespace {

// One bidirectional LeaseKeepAlive stream driven through a completion queue, so that every step
// waits at most a deadline (a hung member cannot block the keeper).
class KeepAliveStream {
 public:
  KeepAliveStream(etcdserverpb::Lease::Stub* stub, const absl::Notification* stop)
      : stop_(stop), stream_(stub->PrepareAsyncLeaseKeepAlive(&context_, &queue_)) {}

  // Cancels the call and drains the queue: every operation still in flight (a read or a finish
  // an Await gave up on) completes into this object's own buffers before they go.
  ~KeepAliveStream() {
    context_.TryCancel();
    if (!finished_) stream_->Finish(&finish_status_, Tag(kFinish));
    queue_.Shutdown();
    void* tag;
    bool ok;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  // Starts the call, or sends one renewal and reads its answer; each step within `timeout`.
  absl::Status Start(absl::Duration timeout) {
    stream_->StartCall(Tag(kStart));
    return Await(kStart, timeout);
  }
  absl::Status Renew(int64_t lease_id, absl::Duration timeout,
                     etcdserverpb::LeaseKeepAliveResponse* response) {
    etcdserverpb::LeaseKeepAliveRequest request;
    request.set_id(lease_id);
    stream_->Write(request, Tag(kWrite));
    if (absl::Status s = Await(kWrite, timeout); !s.ok()) return s;
    // Into a member, not `response`: a read this Await gives up on (no answer within the
    // timeout) is still in flight until the destructor drains the queue, and gRPC deserializes
    // its answer then. Into the caller's message, gone by then, that was a call through a
    // destroyed protobuf's vtable ("pure virtual method called" under TSan's slowness).
    response_.Clear();
    stream_->Read(&response_, Tag(kRead));
    if (absl::Status s = Await(kRead, timeout); !s.ok()) return s;
    *response = response_;
    return absl::OkStatus();
  }

 private:
  enum Op { kStart = 1, kWrite, kRead, kFinish };
  static void* Tag(Op op) { return reinterpret_cast<void*>(static_cast<intptr_t>(op)); }

  // Waits for `op` (the one operation in flight). A failed operation means the stream ended:
  // its status, from Finish (into finish_status_, which outlives a Finish given up on).
  absl::Status Await(Op op, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      if (stop_->HasBeenNotified()) return absl::CancelledError("stopped");
      void* tag = nullptr;
      bool ok = false;
      const absl::Time slice = std::min(deadline, absl::Now() + absl::Milliseconds(50));
      const auto result = queue_.AsyncNext(&tag, &ok, absl::ToChronoTime(slice));
      if (result == grpc::CompletionQueue::GOT_EVENT) {
        if (tag != Tag(op)) return absl::InternalError("unexpected completion");
        if (ok) return absl::OkStatus();
        if (op == kFinish) return absl::UnavailableError("stream ended");
        stream_->Finish(&finish_status_, Tag(kFinish));
        finished_ = true;
        if (absl::Status s = Await(kFinish, timeout); !s.ok()) return s;
        if (finish_status_.ok()) return absl::UnavailableError("the stream was closed");
        return FromGrpcStatus(finish_status_);
      }
      if (result == grpc::CompletionQueue::SHUTDOWN) return absl::InternalError("queue shut down");
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("no answer within ", absl::FormatDuration(timeout)));
      }
    }
  }

  const absl::Notification* const stop_;
  grpc::ClientContext context_;
  grpc::CompletionQueue queue_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<etcdserverpb::LeaseKeepAliveRequest,
                                                etcdserverpb::LeaseKeepAliveResponse>>
      stream_;
  // The buffers of the operations in flight: members, so that they outlive every operation
  // until the destructor has drained the queue.
  etcdserverpb::LeaseKeepAliveResponse response_;
  grpc::Status finish_status_;
  bool finished_ = false;
};

}  // namespace

LeaseKeeper::LeaseKeeper(std::shared_ptr<EtcdClientShared> shared, int64_t lease_id,
                         absl::Duration ttl)
    : shared_(std::move(shared)), lease_id_(lease_id) {
  {
    absl::MutexLock lock(&mu_);
    last_renewed_ = shared_->clock()->Now();
    ttl_ = ttl;
  }
  thread_ = std::thread([this] { Run(); });
}

LeaseKeeper::~LeaseKeeper() { Stop(); }

absl::Time LeaseKeeper::last_renewed() const {
  absl::MutexLock lock(&mu_);
  return last_renewed_;
}

absl::Duration LeaseKeeper::ttl() const {
  absl::MutexLock lock(&mu_);
  return ttl_;
}

int64_t LeaseKeeper::renewals() const {
  absl::MutexLock lock(&mu_);
  return renewals_;
}

absl::Status LeaseKeeper::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void LeaseKeeper::Stop() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  if (status_.ok()) status_ = absl::CancelledError("stopped");
}

void LeaseKeeper::Run() {
  const Clock* clock = shared_->clock();
  // Renewals every TTL/6, each given TTL/6 before it is tried elsewhere: the holder fences
  // itself at TTL/2 after the last renewal, so a member lost (or an etcd election, which a
  // lost raft leader costs: about one election timeout) leaves two more tries before that.
  const absl::Duration deadline = std::min(shared_->options().call_deadline, ttl() / 6);
  Backoff backoff = shared_->NewBackoff(ttl() / 6);
  while (!stop_.HasBeenNotified()) {
    const int i = shared_->current();
    absl::Status status;
    {
      KeepAliveStream stream(shared_->lease(i), &stop_);
      status = stream.Start(deadline);
      while (status.ok() && !stop_.HasBeenNotified()) {
        const absl::Time sent = clock->Now();
        etcdserverpb::LeaseKeepAliveResponse response;
        status = stream.Renew(lease_id_, deadline, &response);
        if (!status.ok()) break;
        if (response.ttl() <= 0) {
          absl::MutexLock lock(&mu_);
          status_ = absl::FailedPreconditionError(absl::StrCat(
              "etcd KeepAlive at ", shared_->endpoint(i), ": lease ", lease_id_, " not found"));
          return;
        }
        absl::Duration period;
        {
          absl::MutexLock lock(&mu_);
          // The lease lasts at least TTL from when the renewal was sent.
          last_renewed_ = sent;
          ttl_ = absl::Seconds(response.ttl());
          ++renewals_;
          period = ttl_ / 6;
        }
        backoff.Reset();
        clock->WaitFor(sent + period - clock->Now(), &stop_);
      }
    }
    if (stop_.HasBeenNotified()) return;
    status = shared_->Annotate(ToGrpcStatus(status), absl::StrCat("KeepAlive ", lease_id_), i);
    if (status.code() == absl::StatusCode::kFailedPrecondition) {
      absl::MutexLock lock(&mu_);
      status_ = status;
      return;
    }
    if (shared_->options().retry.log_retries) {
      LOG(WARNING) << status << "; renewing on the next endpoint";
    }
    shared_->MoveOn(i);
    clock->WaitFor(backoff.Next(), &stop_);
  }
}

// ---- Watcher -----------------------------------------------------------------------------------

Watcher::Watcher(std::shared_ptr<EtcdClientShared> shared, WatchSpec spec,
                 std::function<void(const EtcdEvent&)> callback)
    : shared_(std::move(shared)), spec_(std::move(spec)), callback_(std::move(callback)) {
  thread_ = std::thread([this] { Run(); });
}

Watcher::~Watcher() { Cancel(); }

absl::Status Watcher::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

int64_t Watcher::last_revision() const {
  absl::MutexLock lock(&mu_);
  return last_revision_;
}

int64_t Watcher::streams() const {
  absl::MutexLock lock(&mu_);
  return streams_;
}

void Watcher::Cancel() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  {
    absl::MutexLock lock(&mu_);
    if (context_ != nullptr) static_cast<grpc::ClientContext*>(context_)->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
  absl::MutexLock lock(&mu_);
  if (status_.ok()) status_ = absl::CancelledError("stopped");
}

void Watcher::Run() {
  int64_t next_revision = spec_.start_revision;
  Backoff backoff = shared_->NewBackoff(shared_->options().retry.max_backoff);
  while (!stop_.HasBeenNotified()) {
    const int i = shared_->current();
    bool confirmed = false;
    absl::Status status = RunStream(i, &next_revision, &confirmed);
    if (stop_.HasBeenNotified()) return;
    if (!IsRetryable(status.code())) {
      absl::MutexLock lock(&mu_);
      status_ = status;
      return;
    }
    if (confirmed) backoff.Reset();
    if (shared_->options().retry.log_retries) {
      LOG(WARNING) << status << "; watching again from revision " << next_revision
                   << " on the next endpoint";
    }
    shared_->MoveOn(i);
    shared_->clock()->WaitFor(backoff.Next(), &stop_);
  }
}

absl::Status Watcher::RunStream(int i, int64_t* next_revision, bool* confirmed) {
  const std::string what = absl::StrCat("Watch ", spec_.key);
  grpc::ClientContext context;
  // etcd closes the stream (UNAVAILABLE) when its member loses the raft leader, instead of
  // keeping a watch that would see nothing.
  context.AddMetadata("hasleader", "true");
  {
    absl::MutexLock lock(&mu_);
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    context_ = &context;
  }
  auto stream = shared_->watch(i)->Watch(&context);
  etcdserverpb::WatchRequest request;
  etcdserverpb::WatchCreateRequest* create = request.mutable_create_request();
  create->set_key(spec_.key);
  if (spec_.prefix) create->set_range_end(PrefixRangeEnd(spec_.key));
  create->set_start_revision(*next_revision);
  absl::Status end;
  if (stream->Write(request)) {
    etcdserverpb::WatchResponse response;
    while (stream->Read(&response)) {
      if (response.created()) {
        *confirmed = true;
        // From now on: changes after the revision at creation.
        if (*next_revision == 0) *next_revision = response.header().revision() + 1;
        absl::MutexLock lock(&mu_);
        ++streams_;
      }
      if (response.canceled()) {
        if (response.compact_revision() > 0) {
          end = absl::OutOfRangeError(absl::StrCat(
              "etcd ", what, " at ", shared_->endpoint(i), ": revision ", *next_revision,
              " has been compacted (oldest left: ", response.compact_revision(), ")"));
        } else {
          end = absl::InternalError(absl::StrCat("etcd ", what, " at ", shared_->endpoint(i),
                                                 ": canceled by etcd: ",
                                                 response.cancel_reason()));
        }
        break;
      }
      int64_t last = 0;
      for (const mvccpb::Event& event : response.events()) {
        // A re-established stream starts at next_revision: anything older was delivered.
        if (event.kv().mod_revision() < *next_revision) continue;
        EtcdEvent out;
        out.type = event.type() == mvccpb::Event::DELETE ? EtcdEvent::Type::kDelete
                                                         : EtcdEvent::Type::kPut;
        out.key = event.kv().key();
        out.value = event.kv().value();
        out.create_revision = event.kv().create_revision();
        out.mod_revision = event.kv().mod_revision();
        out.lease_id = event.kv().lease();
        if (stop_.HasBeenNotified()) break;
        callback_(out);
        last = out.mod_revision;
        absl::MutexLock lock(&mu_);
        last_revision_ = last;
      }
      // A revision's events come in one response: the next to deliver is the one after.
      if (last > 0) *next_revision = last + 1;
    }
  }
  {
    absl::MutexLock lock(&mu_);
    context_ = nullptr;
  }
  // Broken out of a stream that is still open (etcd canceled the watch, or Cancel()): close
  // it; a stream that ended by itself keeps its status for Finish.
  if (!end.ok() || stop_.HasBeenNotified()) context.TryCancel();
  const grpc::Status finish = stream->Finish();
  if (!end.ok()) return end;
  if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
  absl::Status status = shared_->Annotate(finish, what, i);
  // A stream that ended without an error status (the member shut down cleanly) is retried.
  if (status.ok() || status.code() == absl::StatusCode::kCancelled) {
    return absl::UnavailableError(
        absl::StrCat("etcd ", what, " at ", shared_->endpoint(i), ": the stream ended ",
                     finish.error_message()));
  }
  return status;
}

}  // namespace rebound
