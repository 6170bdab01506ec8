#include "tests/server/server_testing.h"

#include <catch2/catch.hpp>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace rebound::server::testing {

JobConfig ParseJob(const std::string& text) {
  auto job = ParseJobConfig(text, "job.pbtxt");
  INFO(job.status().ToString());
  REQUIRE(job.ok());
  return *job;
}

JobConfig TwoByOneJob() {
  return ParseJob(
      "job_id: \"j\"\n"
      "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
      "topology { replicas: 2 stages: 1 }\n"
      "fault_tolerance { heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n");
}

JobConfig JobWithPolicy(const char* policy, int recovery_parallelism) {
  return ParseJob(
      absl::StrCat("job_id: \"j\"\n"
                   "model { layers { width: 8 } layers { width: 4 activation: IDENTITY } }\n"
                   "topology { replicas: 2 stages: 1 }\n"
                   "fault_tolerance { policy: ",
                   policy, " heartbeat_interval_ms: 100 failure_timeout_ms: 1000 ",
                   "recovery_parallelism: ", recovery_parallelism, " }\n"));
}

JobConfig PipelineJob(int replicas) {
  return ParseJob(absl::StrCat("job_id: \"j\"\n"
                               "model { layers { width: 8 } layers { width: 6 } "
                               "layers { width: 4 activation: IDENTITY } }\n"
                               "topology { replicas: ",
                               replicas,
                               " stages: 3 }\n"
                               "fault_tolerance { policy: REPLAY heartbeat_interval_ms: 100 "
                               "failure_timeout_ms: 1000 }\n"));
}

JobConfig TinyModelJob(int replicas, int stages, const std::string& more) {
  return ParseJob(absl::StrCat("job_id: \"j\"\n"
                               "model { input_dim: 4 layers { width: 3 } layers { width: 2 "
                               "activation: IDENTITY } }\n"
                               "topology { replicas: ",
                               replicas, " stages: ", stages,
                               " }\n"
                               "data { batch_size: 4 micro_batches: 2 }\n",
                               more));
}

RegisterRequest Request(const std::string& name, WorkerRole role,
                        const std::string& peer_address) {
  RegisterRequest request;
  request.set_job_id("j");
  request.set_worker_name(name);
  request.set_requested_role(role);
  request.set_peer_address(peer_address);
  return request;
}

HeartbeatRequest Beat(uint64_t incarnation, int64_t step) {
  HeartbeatRequest request;
  request.set_incarnation(incarnation);
  request.set_step(step);
  return request;
}

HeartbeatRequest Flushed(uint64_t incarnation, int64_t flushes_done) {
  HeartbeatRequest request = Beat(incarnation);
  request.set_flushes_done(flushes_done);
  return request;
}

HeartbeatRequest Blocked(uint64_t incarnation, const std::string& reason) {
  HeartbeatRequest request = Beat(incarnation);
  request.set_blocked_reason(reason);
  return request;
}

SlotId Slot(int replica, int stage) {
  SlotId slot;
  slot.set_replica(replica);
  slot.set_stage(stage);
  return slot;
}

bool HasCommand(const HeartbeatResponse& response, Command command) {
  for (int c : response.commands()) {
    if (c == command) return true;
  }
  return false;
}

HeartbeatResponse BeatOk(Membership& membership, const HeartbeatRequest& request) {
  auto response = membership.Heartbeat(request);
  INFO(response.status().ToString());
  REQUIRE(response.ok());
  return *response;
}

std::vector<uint64_t> RegisterTrainers(Membership& membership, int slots) {
  std::vector<uint64_t> trainers;
  for (int i = 0; i < slots; ++i) {
    auto trainer = membership.Register(Request(absl::StrCat("t", i), TRAINER));
    REQUIRE(trainer.ok());
    REQUIRE(trainer->slot().replica() * 3 + trainer->slot().stage() == i);
    trainers.push_back(trainer->incarnation());
  }
  return trainers;
}

int64_t FlushWhenAsked(Membership& membership, uint64_t incarnation) {
  const HeartbeatResponse beat = BeatOk(membership, Beat(incarnation));
  REQUIRE(HasCommand(beat, FLUSH_LOG));
  REQUIRE(beat.flush_sequence() > 0);
  BeatOk(membership, Flushed(incarnation, beat.flush_sequence()));
  return beat.flush_sequence();
}

void FailOne(FakeClock& clock, Membership& membership, const std::vector<uint64_t>& trainers,
             uint64_t silent, std::vector<uint64_t> others_alive) {
  clock.Advance(absl::Milliseconds(900));
  for (uint64_t t : trainers) {
    if (t != silent) BeatOk(membership, Beat(t));
  }
  for (uint64_t t : others_alive) BeatOk(membership, Beat(t));
  clock.Advance(absl::Milliseconds(200));
  const std::vector<FailedWorker> failed = membership.DetectFailures();
  REQUIRE(failed.size() == 1);
  REQUIRE(failed[0].incarnation == silent);
}

std::unique_ptr<storage::DurableStore> OpenInMemoryStore(const JobConfig& job) {
  auto opened = storage::DurableStore::Open(
      storage::DurableStoreOptions::FromConfig(DurabilityConfig(), job.step_log()));
  REQUIRE(opened.ok());
  return *std::move(opened);
}

Membership::PersistFn StorePersist(storage::DurableStore* store) {
  return [store](const ServerRecord& server, const std::vector<SlotRecord>& slots) {
    storage::WriteBatch batch;
    batch.PutServer(server);
    for (const SlotRecord& slot : slots) batch.PutSlot(slot);
    return store->Commit(batch);
  };
}

}  // namespace rebound::server::testing
