// ReplicationLeader with a real DurableStore, a real gRPC peer server and a real Standby (or a
// hand-driven Replicate stream) in one process: the two failover bugs of R15.
//
//  * A barrier that fails after the standby acknowledged the commit (the leader cut from etcd
//    while its standby still follows) must fence the store: the next sync, computed from the
//    center the failed sync left in memory, is never written, so the standby never holds two
//    commits of one center version.
//  * A standby dropped from the in-sync set while its stream stays open but silent (a firewall
//    drops its packets, nothing resets the connection) is not waited for again until it shows
//    progress or opens a new stream.

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/config.h"
#include "common/version.h"
#include "grpcpp/grpcpp.h"
#include "proto/replication.grpc.pb.h"
#include "server/center_table.h"
#include "server/group/peer_service.h"
#include "server/group/replication_leader.h"
#include "server/group/standby.h"
#include "storage/durable_store.h"
#include "storage/format_version.h"

namespace rebound::server {
namespace {

namespace fs = std::filesystem;

constexpr char kJob[] = R"pb(
  model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }
  topology { replicas: 2 stages: 1 }
)pb";

constexpr uint64_t kEpoch = 7;

// A fresh directory under the test's temporary directory.
std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const fs::path dir = fs::path(tmp != nullptr ? tmp : "/tmp") /
                       absl::StrCat("replication_leader_test-", getpid(), "-", name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

// Polls `done` every 5 ms for up to `limit`; true once it held.
template <typename F>
bool Eventually(F done, absl::Duration limit = absl::Seconds(10)) {
  const absl::Time deadline = absl::Now() + limit;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return done();
}

// A leader's store, its ReplicationLeader and the peer server its standbys follow.
struct LeaderSide {
  explicit LeaderSide(ReplicationLeaderOptions options) {
    storage::DurableStoreOptions store_options;
    store_options.data_dir = FreshDir(options.name);
    auto opened = storage::DurableStore::Open(store_options);
    REQUIRE(opened.ok());
    store = *std::move(opened);
    options.epoch = kEpoch;
    options.store = store.get();
    options.checkpoint_dir = store_options.data_dir + "-checkpoints";
    if (!options.record_in_sync) {
      options.record_in_sync = [](const std::vector<std::string>&, uint64_t) {
        return absl::OkStatus();
      };
    }
    leader = std::make_unique<ReplicationLeader>(options, store->LastApplied());
    ReplicationLeader* raw = leader.get();
    REQUIRE(store
                ->StartCapturing(
                    [raw](ReplicatedCommit commit) { raw->Append(std::move(commit)); },
                    [raw](const storage::DurableStore::Position& position) {
                      return raw->WaitReplicated(position);
                    },
                    kEpoch)
                .ok());
    REQUIRE(leader->Start().ok());
    peers = std::make_unique<PeerService>([](GroupStatus*) {});
    peers->SetLeader(leader.get());
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(peers.get());
    server = builder.BuildAndStart();
    REQUIRE(server != nullptr);
    REQUIRE(port > 0);
  }
  ~LeaderSide() {
    leader->BeginStop();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    server->Wait();
    leader->Stop();
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", port); }

  // The leader's view of standby `name`.
  StandbyStatus StatusOf(const std::string& name) const {
    GroupStatus status;
    leader->FillStatus(&status);
    for (const StandbyStatus& standby : status.standbys()) {
      if (standby.name() == name) return standby;
    }
    return StandbyStatus();
  }

  std::unique_ptr<storage::DurableStore> store;
  std::unique_ptr<ReplicationLeader> leader;
  std::unique_ptr<PeerService> peers;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
};

// A real Standby following the leader on a thread of its own.
struct FollowingStandby {
  FollowingStandby(const std::string& name, const std::string& leader_address) {
    StandbyOptions options;
    options.name = name;
    options.peer_address = "127.0.0.1:1";
    options.store_options.data_dir = data_dir = FreshDir(name);
    auto opened = Standby::Open(options);
    REQUIRE(opened.ok());
    standby = *std::move(opened);
    MemberAddress leader{"leader", "127.0.0.1:1", leader_address};
    thread = std::thread([this, leader] { (void)standby->Follow(leader, kEpoch); });
  }
  ~FollowingStandby() {
    standby->Cancel();
    thread.join();
  }
  uint64_t applied() const { return standby->store()->LastApplied().sequence; }

  std::string data_dir;
  std::unique_ptr<Standby> standby;
  std::thread thread;
};

storage::WriteBatch CenterBatch(int64_t version, absl::Span<const float> center) {
  CenterRecord record;
  record.set_stage(0);
  record.set_version(version);
  TensorBundle* params = record.mutable_params();
  Tensor* tensor = params->add_tensors();
  tensor->set_dtype(FLOAT32);
  tensor->add_shape(static_cast<int64_t>(center.size()));
  tensor->set_data(center.data(), center.size() * sizeof(float));
  storage::WriteBatch batch;
  batch.PutCenter(record);
  return batch;
}

std::vector<float> StoredCenter(const storage::DurableStore& store, int64_t* version) {
  auto loaded = store.LoadAll();
  REQUIRE(loaded.ok());
  REQUIRE(loaded->centers.count(0) == 1);
  const CenterRecord& record = loaded->centers.at(0);
  *version = record.version();
  const std::string& data = record.params().tensors(0).data();
  std::vector<float> values(data.size() / sizeof(float));
  std::memcpy(values.data(), data.data(), data.size());
  return values;
}

TEST_CASE("a barrier that fails after the standby acknowledged fences the store: the next sync "
          "computed from the old center is never written") {
  // The leadership check starts failing once the standby holds commit `fail_after` (the
  // leader cut from etcd while its standby still follows it).
  std::atomic<uint64_t> fail_after{~uint64_t{0}};
  FollowingStandby* follower = nullptr;
  ReplicationLeaderOptions options;
  options.name = "leader";
  options.standby_timeout = absl::Seconds(5);
  options.max_wait = absl::Seconds(20);
  options.tick = absl::Milliseconds(10);
  options.check_leadership = [&]() -> absl::Status {
    if (follower != nullptr && follower->applied() >= fail_after.load()) {
      return absl::FailedPreconditionError("not the leader any more: the lease was not renewed");
    }
    return absl::OkStatus();
  };
  LeaderSide leader(options);
  FollowingStandby standby("standby", leader.address());
  follower = &standby;

  auto job = ParseJobConfig(kJob, "job.pbtxt");
  REQUIRE(job.ok());
  auto created = CenterTable::Create(*job);
  REQUIRE(created.ok());
  CenterTable& table = **created;
  const size_t n = table.Read(0)->first.size();

  // Sync: an elastic move whose commit writes the new center and its version.
  auto sync = [&](float offset) {
    std::vector<float> x = table.Read(0)->first;
    for (float& value : x) value += offset;
    std::vector<float> worker_after(n);
    auto weight = [](int64_t, double) -> absl::StatusOr<double> { return 1.0; };
    auto commit = [&](int64_t version, absl::Span<const float> center, absl::Span<const float>,
                      absl::Span<const float>) {
      return leader.store->Commit(CenterBatch(version, center));
    };
    return table.ElasticSync(0, x, 0.5, weight, commit, absl::MakeSpan(worker_after));
  };

  // The standby joins the in-sync set (waited for) and holds a first, answered sync.
  REQUIRE(Eventually([&] { return leader.StatusOf("standby").state() == "in sync"; }));
  auto first = sync(1.0f);
  REQUIRE(first.ok());
  REQUIRE(first->version == 1);

  // Sync A: written and acknowledged by the standby, then the leadership check fails.
  const uint64_t a_sequence = leader.store->LastApplied().sequence + 1;
  fail_after = a_sequence;
  auto a = sync(2.0f);
  REQUIRE_FALSE(a.ok());
  CHECK(a.status().code() == absl::StatusCode::kUnavailable);
  REQUIRE(standby.applied() == a_sequence);
  int64_t a_version = 0;
  const std::vector<float> a_center = StoredCenter(*standby.standby->store(), &a_version);
  CHECK(a_version == 2);
  // The caller keeps the center from before A (the commit's failure is not undone in memory).
  CHECK(table.version(0) == 1);

  // Sync B, back to back: computed from that stale center, it must not be written anywhere.
  auto b = sync(3.0f);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(b.status().message(), "fenced"));
  CHECK(leader.store->LastApplied().sequence == a_sequence);
  CHECK_FALSE(leader.store->Fenced().ok());
  // Give a wrongly written B every chance to reach the standby before looking.
  absl::SleepFor(absl::Milliseconds(200));
  CHECK(standby.applied() == a_sequence);
  int64_t held_version = 0;
  const std::vector<float> held = StoredCenter(*standby.standby->store(), &held_version);
  CHECK(held_version == 2);
  CHECK(held == a_center);  // A's center, not a second "version 2" computed from version 1
}

TEST_CASE("a store whose barrier fails refuses every later commit before writing it") {
  std::atomic<bool> leading{true};
  ReplicationLeaderOptions options;
  options.name = "leader";
  options.sync = false;  // no standby: only the leadership decides
  options.tick = absl::Milliseconds(10);
  options.check_leadership = [&]() -> absl::Status {
    return leading ? absl::OkStatus() : absl::FailedPreconditionError("the leadership was lost");
  };
  LeaderSide leader(options);
  std::vector<float> center = {1.0f, 2.0f};
  REQUIRE(leader.store->Commit(CenterBatch(1, center)).ok());
  REQUIRE(leader.store->Fenced().ok());
  leading = false;
  const absl::Status failed = leader.store->Commit(CenterBatch(2, center));
  CHECK(failed.code() == absl::StatusCode::kUnavailable);
  const uint64_t written = leader.store->LastApplied().sequence;
  CHECK(written == 2);  // written and handed on, not acknowledged
  // Even with the leadership back (it never comes back for an epoch, but the store must not
  // depend on that), nothing more is written.
  leading = true;
  const absl::Status refused = leader.store->Commit(CenterBatch(3, center));
  CHECK(refused.code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(refused.message(), "fenced"));
  CHECK(absl::StrContains(leader.store->Fenced().message(), "commit 2"));
  CHECK(leader.store->LastApplied().sequence == written);
}

TEST_CASE("a commit made while the lease renewal is late waits, and is acknowledged once the "
          "lease is renewed in time") {
  // UNAVAILABLE: late, the lease may still be held (LeaderElection::CheckLeadership).
  std::atomic<bool> late{false};
  std::atomic<int> checks_while_late{0};
  ReplicationLeaderOptions options;
  options.name = "leader";
  options.sync = false;  // no standby: only the leadership decides
  options.tick = absl::Milliseconds(10);
  options.check_leadership = [&]() -> absl::Status {
    if (!late) return absl::OkStatus();
    ++checks_while_late;
    return absl::UnavailableError("the lease renewal is late");
  };
  LeaderSide leader(options);
  std::vector<float> center = {1.0f, 2.0f};
  REQUIRE(leader.store->Commit(CenterBatch(1, center)).ok());
  late = true;
  absl::Status committed = absl::UnknownError("not yet");
  absl::Notification done;
  std::thread commit([&] {
    committed = leader.store->Commit(CenterBatch(2, center));
    done.Notify();
  });
  // Held: not answered while the renewal is late (it looks at the lease again and again).
  CHECK_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(300)));
  CHECK(checks_while_late.load() >= 2);
  late = false;  // renewed before the TTL
  CHECK(done.WaitForNotificationWithTimeout(absl::Seconds(5)));
  commit.join();
  CHECK(committed.ok());
  CHECK(leader.store->Fenced().ok());
  CHECK(leader.store->Commit(CenterBatch(3, center)).ok());
  CHECK(leader.store->LastApplied().sequence == 3);
}

// A Replicate stream driven by hand: it says hello, reads what the leader sends and
// acknowledges only when told to (a standby whose packets a firewall drops).
class SilentStandby {
 public:
  explicit SilentStandby(const std::string& leader_address) {
    channel_ = grpc::CreateChannel(leader_address, grpc::InsecureChannelCredentials());
    stub_ = ServerPeer::NewStub(channel_);
    stream_ = stub_->Replicate(&context_);
    ReplicateRequest hello;
    hello.set_name("silent");
    hello.set_peer_address("127.0.0.1:1");
    hello.set_leader_epoch(kEpoch);
    hello.set_epoch(0);
    hello.set_sequence(0);
    REQUIRE(stream_->Write(hello));
    reader_ = std::thread([this] {
      ReplicateResponse response;
      while (stream_->Read(&response)) received_ = response.commit().sequence();
    });
  }
  ~SilentStandby() {
    context_.TryCancel();
    reader_.join();
  }
  // Acknowledges everything received so far.
  void AckAll() {
    ReplicateRequest ack;
    ack.set_acked_sequence(received_.load());
    REQUIRE(stream_->Write(ack));
  }
  uint64_t received() const { return received_.load(); }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<ServerPeer::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<ReplicateRequest, ReplicateResponse>> stream_;
  std::thread reader_;
  std::atomic<uint64_t> received_{0};
};

TEST_CASE("a dropped standby whose stream stays open but silent is not waited for again until it "
          "acknowledges") {
  ReplicationLeaderOptions options;
  options.name = "leader";
  options.standby_timeout = absl::Milliseconds(300);
  options.max_wait = absl::Seconds(20);
  options.tick = absl::Milliseconds(10);
  options.check_leadership = [] { return absl::OkStatus(); };
  LeaderSide leader(options);
  SilentStandby silent(leader.address());
  const std::vector<float> center = {1.0f};

  // It stands at the leader's last commit (0), so it is waited for and recorded at once.
  REQUIRE(Eventually([&] { return leader.StatusOf("silent").state() == "in sync"; }));
  // Its first unacknowledged commit waits standby_timeout, then it is dropped.
  const absl::Time start = absl::Now();
  REQUIRE(leader.store->Commit(CenterBatch(1, center)).ok());
  CHECK(absl::Now() - start >= options.standby_timeout);
  REQUIRE(silent.received() == 1);
  REQUIRE(absl::StartsWith(leader.StatusOf("silent").state(), "dropped"));

  // Its stream is still open and it is within the join window: before R15 it was waited for
  // again at the next monitor pass, and every commit stalled for standby_timeout. Now it is
  // not waited for: its state stays "dropped" over many monitor passes while commits go on.
  for (int64_t version = 2; version <= 6; ++version) {
    REQUIRE(leader.store->Commit(CenterBatch(version, center)).ok());
    absl::SleepFor(options.tick * 5);
    CHECK(absl::StartsWith(leader.StatusOf("silent").state(), "dropped"));
  }
  CHECK(leader.leader->standbys_dropped() == 1);

  // Progress brings it back: once it acknowledges past where it was dropped it is waited for
  // again, and recorded in sync once it holds every commit.
  REQUIRE(Eventually([&] { return silent.received() == 6; }));
  silent.AckAll();
  REQUIRE(Eventually([&] { return leader.StatusOf("silent").state() == "in sync"; }));
}

// Says hello as standby `name` of `version` ("" = a standby from before versions were sent) and
// returns how the stream ended once the leader ends it, or OK while the leader keeps it open.
grpc::Status HelloFrom(const std::string& address, const std::string& name,
                       const std::string& version) {
  auto stub = ServerPeer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  auto stream = stub->Replicate(&context);
  ReplicateRequest hello;
  hello.set_name(name);
  hello.set_peer_address("127.0.0.1:1");
  hello.set_leader_epoch(kEpoch);
  if (!version.empty()) hello.set_version(version);
  REQUIRE(stream->Write(hello));
  ReplicateResponse response;
  while (stream->Read(&response)) {
  }
  const grpc::Status finished = stream->Finish();
  // A stream the leader kept ends at our deadline.
  return finished.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ? grpc::Status::OK
                                                                      : finished;
}

TEST_CASE("a standby of an incompatible version is refused, naming both versions; one of a "
          "compatible version or from before versions were sent follows") {
  ReplicationLeaderOptions options;
  options.name = "leader";
  options.check_leadership = [] { return absl::OkStatus(); };
  LeaderSide leader(options);
  const std::string mine = ProjectVersion();

  const grpc::Status refused = HelloFrom(leader.address(), "far", "999.0.0");
  REQUIRE(refused.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  INFO(refused.error_message());
  CHECK(absl::StrContains(refused.error_message(),
                          absl::StrCat("this leader 'leader' is rebound ", mine)));
  CHECK(absl::StrContains(refused.error_message(), "the standby 'far' is rebound 999.0.0"));
  CHECK(leader.StatusOf("far").name().empty());  // never became one of its standbys

  // FetchCheckpoint refuses it too.
  auto stub = ServerPeer::NewStub(
      grpc::CreateChannel(leader.address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  FetchCheckpointRequest fetch;
  fetch.set_name("far");
  fetch.set_leader_epoch(kEpoch);
  fetch.set_version("999.0.0");
  auto reader = stub->FetchCheckpoint(&context, fetch);
  CheckpointChunk chunk;
  CHECK_FALSE(reader->Read(&chunk));
  const grpc::Status fetched = reader->Finish();
  CHECK(fetched.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(absl::StrContains(fetched.error_message(), "the standby 'far' is rebound 999.0.0"));

  // A standby of this build (Standby sends ProjectVersion()) follows and applies a commit.
  FollowingStandby same("same", leader.address());
  REQUIRE(leader.store->Commit(CenterBatch(1, std::vector<float>{1.0f})).ok());
  REQUIRE(Eventually([&] { return same.applied() == 1; }));
  // One that sends no version (rebound 0.12) counts as 0.12.0: compatible with 0.13 (and
  // refused from 0.14 on).
  const grpc::Status legacy = HelloFrom(leader.address(), "legacy", "");
  if (CheckPeerVersion("this leader", kVersionBeforeExchange, "a standby").ok()) {
    CHECK(legacy.ok());
    CHECK(leader.StatusOf("legacy").name() == "legacy");
  } else {
    CHECK(legacy.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(absl::StrContains(legacy.error_message(), "0.12.0 or older (it sent no version)"));
  }
}

TEST_CASE("a standby that catches up from a checkpoint records the leader's data format") {
  ReplicationLeaderOptions options;
  options.name = "leader";
  // Every commit leaves the buffer at once: a standby that comes later needs a checkpoint.
  options.max_buffered_bytes = 1;
  options.check_leadership = [] { return absl::OkStatus(); };
  LeaderSide leader(options);
  for (int64_t version = 1; version <= 3; ++version) {
    REQUIRE(leader.store->Commit(CenterBatch(version, std::vector<float>{1.0f})).ok());
  }
  FollowingStandby late("late", leader.address());
  REQUIRE(Eventually([&] { return late.standby->checkpoints_fetched() == 1; }));
  REQUIRE(Eventually([&] { return late.applied() == 3; }));
  std::ifstream format(late.data_dir + "/FORMAT");
  std::string line;
  REQUIRE(std::getline(format, line));
  CHECK(line == absl::StrCat("rebound data directory format ", storage::kDataFormatVersion));
}

}  // namespace
}  // namespace rebound::server
