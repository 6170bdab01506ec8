// Policy GLOBAL_CHECKPOINT (docs/recovery.md, docs/design.md §5.4) against the real rebound_server and
// rebound_worker binaries on loopback. Every K steps the trainers meet at a barrier and the
// server checkpoints the center and every slot; a SIGKILLed trainer rolls every slot back: the
// live trainer is fenced as ROLLED_BACK, registers again as a spare, and spares restore every
// slot from the checkpoint. With DETERMINISTIC scheduling and UNIFORM weights the rolled-back
// run must end with the clean run's center, bit for bit: the rollback restores exactly the
// state of the cut (centers, parameters, optimizer state, data cursors, bookkeeping).

#include <catch2/catch.hpp>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checksum.h"
#include "common/safetensors.h"
#include "common/file.h"
#include "proto/rebound.grpc.pb.h"
#include "proto/storage.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"

namespace rebound::testing {
namespace {

constexpr int kSyncPeriod = 50;
constexpr int kEvery = 100;  // checkpoint_every_steps
constexpr int kMaxSteps = 600;

std::string JobText() {
  return absl::StrCat(
      "  job_id: \"ck\"\n",
      "  model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n",
      "  topology { replicas: 2 }\n",
      "  weighting { policy: UNIFORM }\n",
      "  scheduling: DETERMINISTIC\n",
      "  fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: ", kEvery,
      " heartbeat_interval_ms: 200 failure_timeout_ms: 1500 }\n",
      "  data { batch_size: 64 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n",
      "  adahessian { lr: 0.01 }\n",
      "  easgd { sync_period: ", kSyncPeriod, " }\n",
      "  training { max_steps: ", kMaxSteps, " }\n");
}

// The checkpoint file the server keeps in its data directory.
CheckpointRecord ReadCheckpointFile(const std::string& data_dir) {
  const std::string dir = data_dir + "/checkpoints";
  std::string path;
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    path = entry.path().string();
    ++files;
  }
  INFO(dir);
  REQUIRE(files == 1);  // the newest only; older ones are removed
  absl::StatusOr<std::string> bytes = ReadFile(path, kNoFileSizeLimit);
  INFO(bytes.status());
  REQUIRE(bytes.ok());
  CheckpointRecord record;
  REQUIRE(record.ParseFromString(*bytes));
  CHECK(path == absl::StrCat(dir, "/checkpoint-", record.step(), ".pb"));
  return record;
}

// Runs the job with trainers "a" (slot 0) and "b" (slot 1) and returns its final center; with
// `kill`, "b" is SIGKILLed once the second checkpoint is taken and a spare waits.
TensorBundle RunJob(bool kill) {
  LocalCluster cluster(JobText(), LocalClusterOptions{"checkpoint", 500, /*durable=*/true,
                                                      absl::Seconds(60)});
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  const uint64_t a_first = FindWorker(cluster.Status(), "a", TRAINER)->incarnation();
  int64_t rolled_back_to = -1;
  if (kill) {
    cluster.StartWorker("spare", SPARE);
    const GetStatusResponse taken = cluster.WaitFor(
        "the checkpoint of step 200",
        [](const GetStatusResponse& s) { return s.checkpoint().step() >= 2 * kEvery; },
        absl::Seconds(60), absl::Milliseconds(1));
    REQUIRE(taken.checkpoint().step() < kMaxSteps);
    cluster.Kill("b");
    const GetStatusResponse rolled = cluster.WaitFor(
        "the rollback", [](const GetStatusResponse& s) { return s.checkpoint().rollbacks() == 1; });
    rolled_back_to = rolled.checkpoint().step();
    CHECK(rolled_back_to >= taken.checkpoint().step());
    // The checkpoint on disk is the one rolled back to: both centers and both slots at its step.
    const CheckpointRecord file = ReadCheckpointFile(cluster.data_dir());
    CHECK(file.step() == rolled_back_to);
    CHECK(file.job_id() == "ck");
    REQUIRE(file.centers_size() == 1);
    REQUIRE(file.snapshots_size() == 2);
    for (const Snapshot& snapshot : file.snapshots()) CHECK(snapshot.step() == rolled_back_to);
    REQUIRE(file.books_size() == 2);
    for (const WeightRecord& book : file.books()) {
      CHECK(book.last_update_step() == rolled_back_to);
      CHECK(book.update_count() == rolled_back_to / kSyncPeriod);
    }
  }
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  CHECK(done.recovery_policy() == GLOBAL_CHECKPOINT);
  CHECK(done.checkpoint().every_steps() == kEvery);
  CHECK(done.checkpoint().step() == kMaxSteps);
  CHECK(done.checkpoint().write_ms() >= 0);
  CHECK(done.checkpoint().bytes() > 0);
  if (!kill) {
    CHECK(done.checkpoint().rollbacks() == 0);
    CHECK(done.checkpoint().count() == kMaxSteps / kEvery);
    CHECK(done.recoveries_size() == 0);
  } else {
    CHECK(done.checkpoint().rollbacks() == 1);
    // Both slots were restored from the checkpoint, each by a spare.
    REQUIRE(done.recoveries_size() == 2);
    bool restored[2] = {false, false};
    for (const RecoveryStatus& r : done.recoveries()) {
      CHECK(r.policy() == GLOBAL_CHECKPOINT);
      CHECK(r.outcome() == RECOVERED);
      CHECK(r.steps_replayed() == 0);
      CHECK_FALSE(r.verified());
      CHECK(r.failed_step() >= rolled_back_to);
      CHECK(absl::StartsWith(
          r.detail(), absl::StrCat("restored from the global checkpoint of step ", rolled_back_to)));
      restored[r.slot().replica()] = true;
    }
    CHECK(restored[0]);
    CHECK(restored[1]);
    // "a" lived through it: its first incarnation was rolled back, it registered again.
    const WorkerStatus* first = FindIncarnation(done, a_first);
    REQUIRE(first != nullptr);
    CHECK(first->state() == ROLLED_BACK);
    CHECK(absl::StrContains(first->state_reason(),
                            absl::StrCat("rolled back to the global checkpoint of step ",
                                         rolled_back_to)));
    const WorkerStatus* b = FindWorker(done, "b", TRAINER);
    REQUIRE(b != nullptr);
    CHECK(b->state() == FAILED);
    std::cout << "checkpoint_test: b killed; every slot rolled back to step " << rolled_back_to
              << " (b had reached step " << done.recoveries(0).failed_step() << " or "
              << done.recoveries(1).failed_step() << ")" << std::endl;
  }
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);
  if (kill) CHECK(cluster.ExitCode("spare") == 0);
  const PullResponse center = cluster.Pull(cluster.RegisterObserver());
  return center.center();
}

TEST_CASE("under GLOBAL_CHECKPOINT a killed trainer rolls every slot back to the last checkpoint, "
          "and the DETERMINISTIC run ends with the clean run's center, bit for bit") {
  const TensorBundle clean = RunJob(false);
  const TensorBundle rolled_back = RunJob(true);
  CHECK(SameBytes(rolled_back, clean));
}

// Exports while training (job config `export`, docs/operations.md#exports-while-training): the
// server writes the center every 100 steps, keeps the newest two, and writes the final center
// when it stops; each file is the center the server holds, bit for bit, with its checksum.
TEST_CASE("the server exports the center while the job trains and once more when it stops") {
  LocalClusterOptions options{"exports"};
  options.durable = true;
  LocalCluster cluster(
      "  job_id: \"ex\"\n"
      "  model { layers { width: 32 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 }\n"
      "  data { batch_size: 32 micro_batches: 2 train_limit: 1000 test_limit: 100 }\n"
      "  easgd { sync_period: 25 }\n"
      "  training { max_steps: 400 }\n"
      "  export { every_steps: 100 keep_last: 2 }\n",
      options);
  cluster.StartWorker("a", TRAINER);
  cluster.StartWorker("b", TRAINER);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  REQUIRE(done.centers_size() == 1);
  const int64_t final_version = done.centers(0).version();
  ExportCenterResponse expected;
  REQUIRE(cluster.Call(&ParameterServer::Stub::ExportCenter, ExportCenterRequest(), &expected)
              .ok());
  REQUIRE(expected.stages_size() == 1);
  REQUIRE(expected.stages(0).center_version() == final_version);
  CHECK(cluster.ExitCode("a") == 0);
  CHECK(cluster.ExitCode("b") == 0);
  cluster.StopServer();

  const std::filesystem::path dir = std::filesystem::path(cluster.data_dir()) / "exports";
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (absl::StartsWith(name, "model-v") && absl::EndsWith(name, ".safetensors")) {
      names.push_back(name);
    }
  }
  std::sort(names.begin(), names.end());
  INFO(cluster.Logs());
  // Periodic exports (the schedule is checked every 100 ms: a fast job may cross several
  // multiples between two checks, and export once for them) and the final one, unless the last
  // periodic one already held the final center: the newest two are kept.
  REQUIRE(names.size() == 2);
  const std::string final_name = absl::StrFormat("model-v%010d.safetensors", final_version);
  CHECK(names[1] == final_name);
  CHECK(std::filesystem::read_symlink(dir / "latest.safetensors") == final_name);
  absl::StatusOr<std::string> bytes = ReadFile((dir / final_name).string(), kNoFileSizeLimit);
  REQUIRE(bytes.ok());
  absl::StatusOr<DecodedSafetensors> decoded = DecodeSafetensors(*bytes);
  REQUIRE(decoded.ok());
  const TensorBundle& center = expected.stages(0).center();
  REQUIRE(decoded->tensors.size() == static_cast<size_t>(center.tensors_size()));
  for (int i = 0; i < center.tensors_size(); ++i) {
    CHECK(decoded->tensors[i].name() == center.tensors(i).name());
    CHECK(decoded->tensors[i].data() == center.tensors(i).data());  // bit for bit
  }
  CHECK(decoded->metadata.at("rebound.center_versions") == absl::StrCat(final_version));
  CHECK(decoded->metadata.at("rebound.job_step") == "400");
  absl::StatusOr<std::string> sum = ReadFile((dir / final_name).string() + ".xxh64", 1024);
  REQUIRE(sum.ok());
  CHECK(*sum == absl::StrFormat("%016x  %s\n", Checksum(bytes->data(), bytes->size()),
                                final_name));
  // The older one kept is a periodic export of an earlier center.
  absl::StatusOr<std::string> older = ReadFile((dir / names[0]).string(), kNoFileSizeLimit);
  REQUIRE(older.ok());
  absl::StatusOr<DecodedSafetensors> older_decoded = DecodeSafetensors(*older);
  REQUIRE(older_decoded.ok());
  const int64_t older_step = std::stoll(older_decoded->metadata.at("rebound.job_step"));
  CHECK(older_step >= 100);
  CHECK(older_step <= 400);
  CHECK(std::stoll(older_decoded->metadata.at("rebound.center_versions")) < final_version);
}

}  // namespace
}  // namespace rebound::testing
