#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/config.h"

namespace rebound {
namespace {

// A minimal valid job: four lines, so a snippet appended to it starts on line 5.
const char kBase[] =
    "job_id: \"t\"\n"
    "model {\n"
    "  layers { width: 10 activation: IDENTITY }\n"
    "}\n";

std::string JobError(const std::string& text) {
  auto job = ParseJobConfig(text, "job.pbtxt");
  REQUIRE_FALSE(job.ok());
  CHECK(job.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(job.status().message());
}

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

TEST_CASE("the shipped configs are valid") {
  auto job = LoadJobConfig("configs/job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->job_id() == "fashion-mnist-local");
  CHECK(job->model().layers_size() == 3);
  CHECK(job->topology().replicas() == 4);

  auto server = LoadServerConfig("configs/server.pbtxt");
  REQUIRE(server.ok());
  // The job file is loaded relative to the server config's directory and inlined.
  CHECK(server->has_job());
  CHECK_FALSE(server->has_job_file());
  CHECK(server->job().job_id() == "fashion-mnist-local");

  auto worker = LoadWorkerConfig("configs/worker.pbtxt");
  REQUIRE(worker.ok());
  CHECK(worker->server_address() == "127.0.0.1:7070");
}

// Every file of configs/ loads with the loader its name calls for (server*: ServerConfig,
// worker*: WorkerConfig, the others: JobConfig), from a copy of the folder beside the files the
// TLS examples name (PEM-shaped stand-ins and tokens: the loader checks their form, not keys).
TEST_CASE("every example in configs/ is valid") {
  namespace fs = std::filesystem;
  const fs::path copy = fs::path(TempDir()) / "configs-copy";
  fs::remove_all(copy);
  fs::create_directories(copy / "tls");
  int server = 0, worker = 0, job = 0;
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator("configs")) {
    if (entry.path().extension() != ".pbtxt") continue;
    fs::copy_file(entry.path(), copy / entry.path().filename());
    names.push_back(entry.path().filename().string());
  }
  const std::string pem_body = "TUlJQg==\n";  // base64
  for (const char* name : {"ca.crt", "server.crt", "worker.crt"}) {
    WriteFile((copy / "tls" / name).string(),
              "-----BEGIN CERTIFICATE-----\n" + pem_body + "-----END CERTIFICATE-----\n");
  }
  for (const char* name : {"server.key", "worker.key"}) {
    WriteFile((copy / "tls" / name).string(),
              "-----BEGIN PRIVATE KEY-----\n" + pem_body + "-----END PRIVATE KEY-----\n");
  }
  WriteFile((copy / "tls" / "token").string(), "worker-token\n");
  WriteFile((copy / "tls" / "operator_token").string(), "operator-token\n");
  for (const std::string& name : names) {
    INFO(name);
    const std::string path = (copy / name).string();
    if (name.rfind("server", 0) == 0) {
      const auto loaded = LoadServerConfig(path);
      INFO(loaded.status());
      CHECK(loaded.ok());
      if (loaded.ok()) CHECK(loaded->has_job());
      ++server;
    } else if (name.rfind("worker", 0) == 0) {
      const auto loaded = LoadWorkerConfig(path);
      INFO(loaded.status());
      CHECK(loaded.ok());
      ++worker;
    } else {
      const auto loaded = LoadJobConfig(path);
      INFO(loaded.status());
      CHECK(loaded.ok());
      ++job;
    }
  }
  // The examples of docs/operations.md: a group member, two shard groups, TLS; a multi-host
  // and a TLS worker; the jobs (local, pipeline, torch, sharded, rebound_train's).
  CHECK(server >= 5);
  CHECK(worker >= 3);
  CHECK(job >= 5);
  const auto g1 = LoadServerConfig((copy / "server_shard_g1.pbtxt").string());
  REQUIRE(g1.ok());
  CHECK(g1->shard().group() == 1);
  CHECK(g1->job().sharding().groups() == 2);
  const auto tls = LoadServerConfig((copy / "server_tls.pbtxt").string());
  REQUIRE(tls.ok());
  CHECK(tls->security().tls().cert_file() == (copy / "tls/server.crt").string());
}

TEST_CASE("defaults come from the schema") {
  auto job = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->adahessian().lr() == 0.15);
  CHECK(job->adahessian().epsilon() == 1e-4);
  CHECK(job->easgd().sync_period() == 8);
  CHECK(job->fault_tolerance().failure_timeout_ms() == 3000);
  CHECK(job->weighting().min_weight() == 0.05);
  CHECK(EffectiveMovingRate(*job) == 0.9);
}

TEST_CASE("REPLAY means RESTART_FROM_CENTER in mode ASYNC_ADAHESSIAN, nothing else changes") {
  auto job = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(job.ok());
  for (RecoveryPolicy policy : {REPLAY, RESTART_FROM_CENTER, GLOBAL_CHECKPOINT}) {
    job->mutable_fault_tolerance()->set_policy(policy);
    job->mutable_easgd()->set_mode(EASGD);
    CHECK(EffectiveRecoveryPolicy(*job) == policy);
    job->mutable_easgd()->set_mode(ASYNC_ADAHESSIAN);
    CHECK(EffectiveRecoveryPolicy(*job) == (policy == REPLAY ? RESTART_FROM_CENTER : policy));
  }
}

TEST_CASE("an out-of-range moving rate names file, line, field and value") {
  CHECK(JobError(std::string(kBase) + "easgd {\n  moving_rate: 1.5\n}\n") ==
        "job.pbtxt:6: easgd.moving_rate must be in (0, 1], got 1.5");
}

TEST_CASE("the center-integrity bounds default on, may be off (0), and are validated with "
          "file and line") {
  auto job = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->weighting().max_divergence_ratio() == 10000.0);
  CHECK(job->weighting().max_abs_value() == 1e6);
  CHECK(ParseJobConfig(std::string(kBase) +
                           "weighting { max_divergence_ratio: 0 max_abs_value: 0 }\n",
                       "job.pbtxt")
            .ok());
  CHECK(JobError(std::string(kBase) + "weighting {\n  max_divergence_ratio: 1.5\n}\n") ==
        "job.pbtxt:6: weighting.max_divergence_ratio must be 0 (off) or a finite value >= 2, "
        "got 1.5");
  CHECK(JobError(std::string(kBase) + "weighting {\n\n  max_abs_value: -1\n}\n") ==
        "job.pbtxt:7: weighting.max_abs_value must be 0 (finite only) or in (0, 3.4e38], got -1");
  CHECK(JobError(std::string(kBase) + "weighting { max_abs_value: inf }\n") ==
        "job.pbtxt:5: weighting.max_abs_value must be 0 (finite only) or in (0, 3.4e38], got inf");
}

TEST_CASE("the start barrier is off by default, waits up to 60 s, and min_trainers is at most "
          "every slot") {
  auto job = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->topology().min_trainers() == 0);
  CHECK(job->topology().start_barrier_ms() == 60000);
  CHECK(ParseJobConfig(std::string(kBase) + "topology { replicas: 3 min_trainers: 3 }\n",
                       "job.pbtxt")
            .ok());
  CHECK(JobError(std::string(kBase) + "topology {\n  replicas: 3\n  min_trainers: 4\n}\n") ==
        "job.pbtxt:7: topology.min_trainers must be in [0, 3], got 4");
  CHECK(JobError(std::string(kBase) + "topology { min_trainers: -1 }\n") ==
        "job.pbtxt:5: topology.min_trainers must be in [0, 1], got -1");
  CHECK(JobError(std::string(kBase) + "topology { start_barrier_ms: -5 }\n") ==
        "job.pbtxt:5: topology.start_barrier_ms must be in [0, 3600000], got -5");
  CHECK(JobError(std::string(kBase) + "topology { start_barrier_ms: 2147483647 }\n") ==
        "job.pbtxt:5: topology.start_barrier_ms must be in [0, 3600000], got 2147483647");
}

TEST_CASE("the weight inputs' smoothing half-life defaults to 3 syncs, may be 0 (off), and is "
          "validated with file and line") {
  auto job = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->weighting().input_smoothing_half_life_syncs() == 3.0);
  CHECK(ParseJobConfig(std::string(kBase) + "weighting { input_smoothing_half_life_syncs: 0 }\n",
                       "job.pbtxt")
            .ok());
  CHECK(JobError(std::string(kBase) + "weighting {\n  input_smoothing_half_life_syncs: -1\n}\n") ==
        "job.pbtxt:6: weighting.input_smoothing_half_life_syncs must be in [0, 1000], got -1");
  CHECK(JobError(std::string(kBase) + "weighting { input_smoothing_half_life_syncs: nan }\n") ==
        "job.pbtxt:5: weighting.input_smoothing_half_life_syncs must be in [0, 1000], got nan");
  CHECK(JobError(std::string(kBase) + "weighting { input_smoothing_half_life_syncs: 1e9 }\n") ==
        "job.pbtxt:5: weighting.input_smoothing_half_life_syncs must be in [0, 1000], got 1e+09");
}

TEST_CASE("a cosine schedule needs decay_steps beyond the warm-up, named with file and line") {
  CHECK(JobError(std::string(kBase) +
                 "adahessian {\n  warmup_steps: 100\n  lr_decay: LR_COSINE\n"
                 "  decay_steps: 50\n}\n") ==
        "job.pbtxt:8: adahessian.decay_steps must be >= 101, got 50");
  CHECK(ParseJobConfig(std::string(kBase) +
                           "adahessian { warmup_steps: 100 lr_decay: LR_COSINE decay_steps: 4000 "
                           "final_lr_fraction: 0.05 }\n",
                       "job.pbtxt")
            .ok());
  CHECK(JobError(std::string(kBase) + "adahessian { lr_decay: LR_STEP }\n") ==
        "job.pbtxt:5: adahessian.step_every must be >= 1, got 0");
  // decay_steps 0 = training.max_steps, which must outlast the warm-up.
  CHECK(JobError(std::string(kBase) +
                 "training { max_steps: 100 }\n"
                 "adahessian { warmup_steps: 100 lr_decay: LR_COSINE }\n") ==
        "job.pbtxt:6: adahessian.decay_steps is 0 (= training.max_steps = 100), which must be > "
        "adahessian.warmup_steps = 100");
}

TEST_CASE("decay_steps 0 is the job's length in the optimizer's own steps") {
  auto job = ParseJobConfig(std::string(kBase) +
                                "topology { replicas: 3 }\n"
                                "training { max_steps: 500 }\n"
                                "adahessian { warmup_steps: 10 lr_decay: LR_LINEAR }\n",
                            "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(EffectiveAdaHessianConfig(*job).decay_steps() == 500);  // a trainer's steps
  job->mutable_easgd()->set_mode(ASYNC_ADAHESSIAN);
  CHECK(EffectiveAdaHessianConfig(*job).decay_steps() == 1500);  // the center's: R x max_steps
  job->mutable_adahessian()->set_decay_steps(200);  // explicit: kept
  CHECK(EffectiveAdaHessianConfig(*job).decay_steps() == 200);
  job->mutable_adahessian()->set_decay_steps(0);
  job->mutable_adahessian()->set_lr_decay(LR_CONSTANT);  // no decay: nothing to resolve
  CHECK(EffectiveAdaHessianConfig(*job).decay_steps() == 0);
}

TEST_CASE("micro-batches must divide the batch") {
  CHECK(JobError(std::string(kBase) + "data {\n  batch_size: 64\n  micro_batches: 5\n}\n") ==
        "job.pbtxt:7: data.micro_batches must divide data.batch_size = 64, got 5");
}

TEST_CASE("the Hessian power must lie in [0, 1]") {
  CHECK(JobError(std::string(kBase) + "adahessian { hessian_power: 1.5 }\n") ==
        "job.pbtxt:5: adahessian.hessian_power must be in [0, 1], got 1.5");
}

TEST_CASE("beta1 must be below one") {
  CHECK(JobError(std::string(kBase) + "adahessian { beta1: 1 }\n") ==
        "job.pbtxt:5: adahessian.beta1 must be in [0, 1), got 1");
}

TEST_CASE("the failure timeout must exceed the heartbeat interval") {
  CHECK(JobError(std::string(kBase) +
                 "fault_tolerance {\n  heartbeat_interval_ms: 500\n  failure_timeout_ms: 400\n}\n") ==
        "job.pbtxt:7: fault_tolerance.failure_timeout_ms must be greater than "
        "fault_tolerance.heartbeat_interval_ms = 500, got 400");
}

TEST_CASE("the crash confirmation window lies in [0, 60000] ms, 0 turning crash detection off") {
  CHECK(JobError(std::string(kBase) + "fault_tolerance {\n  crash_confirm_ms: -1\n}\n") ==
        "job.pbtxt:6: fault_tolerance.crash_confirm_ms must be in [0, 60000], got -1");
  CHECK(JobError(std::string(kBase) + "fault_tolerance {\n  crash_confirm_ms: 60001\n}\n") ==
        "job.pbtxt:6: fault_tolerance.crash_confirm_ms must be in [0, 60000], got 60001");
  absl::StatusOr<JobConfig> off =
      ParseJobConfig(std::string(kBase) + "fault_tolerance { crash_confirm_ms: 0 }\n", "job.pbtxt");
  REQUIRE(off.ok());
  CHECK(off->fault_tolerance().crash_confirm_ms() == 0);
  absl::StatusOr<JobConfig> shipped_default = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(shipped_default.ok());
  CHECK(shipped_default->fault_tolerance().crash_confirm_ms() == 200);
}

TEST_CASE("audits: fraction in [0, 1], max_concurrent in [1, 64], and what they need") {
  CHECK(JobError(std::string(kBase) + "audit {\n  fraction: 1.5\n}\n") ==
        "job.pbtxt:6: audit.fraction must be in [0, 1], got 1.5");
  CHECK(JobError(std::string(kBase) + "audit {\n  fraction: 0.1\n  max_concurrent: 0\n}\n") ==
        "job.pbtxt:7: audit.max_concurrent must be in [1, 64], got 0");
  CHECK(JobError(std::string(kBase) + "audit {\n  fraction: 0.1\n  steps_per_hour: -1\n}\n") ==
        "job.pbtxt:7: audit.steps_per_hour must be >= 0, got -1");
  CHECK(absl::StrContains(
      JobError(std::string(kBase) + "step_log { enabled: false }\naudit {\n  fraction: 0.1\n}\n"),
      "audit.fraction > 0 needs step_log.enabled"));
  CHECK(absl::StrContains(
      JobError(std::string(kBase) +
               "fault_tolerance { policy: GLOBAL_CHECKPOINT }\naudit {\n  fraction: 0.1\n}\n"),
      "audit.fraction > 0 needs fault_tolerance.policy REPLAY and easgd.mode EASGD"));
  CHECK(absl::StrContains(
      JobError(std::string(kBase) +
               "fault_tolerance { policy: RESTART_FROM_CENTER }\naudit {\n  fraction: 0.1\n}\n"),
      "audit.fraction > 0 needs fault_tolerance.policy REPLAY and easgd.mode EASGD"));
  // A sharded center is audited too (group 0 reads a window's start from every range).
  const absl::StatusOr<JobConfig> sharded = ParseJobConfig(
      std::string(kBase) + "sharding { groups: 2 }\naudit {\n  fraction: 0.1\n}\n", "job.pbtxt");
  CHECK(sharded.ok());
  CHECK(absl::StrContains(
      JobError("job_id: \"t\"\n"
               "model { layers { width: 8 } layers { width: 10 activation: IDENTITY } }\n"
               "topology { stages: 2 }\n"
               "audit {\n  fraction: 0.1\n  on_mismatch: AUDIT_QUARANTINE\n}\n"),
      "AUDIT_QUARANTINE needs topology.stages 1"));
  absl::StatusOr<JobConfig> on = ParseJobConfig(
      std::string(kBase) + "audit { fraction: 0.05 on_mismatch: AUDIT_QUARANTINE }\n", "job.pbtxt");
  REQUIRE(on.ok());
  CHECK(on->audit().fraction() == 0.05);
  CHECK(on->audit().max_concurrent() == 1);
  absl::StatusOr<JobConfig> off = ParseJobConfig(kBase, "job.pbtxt");
  REQUIRE(off.ok());
  CHECK(off->audit().fraction() == 0);
  CHECK(off->audit().on_mismatch() == AUDIT_REPORT);
}

TEST_CASE("a job needs at least one replica") {
  CHECK(JobError(std::string(kBase) + "topology { replicas: 0 }\n") ==
        "job.pbtxt:5: topology.replicas must be in [1, 4096], got 0");
}

TEST_CASE("hidden layers need a nonlinearity") {
  CHECK(JobError("model {\n"
                 "  layers { width: 32 activation: IDENTITY }\n"
                 "  layers { width: 10 activation: IDENTITY }\n"
                 "}\n") ==
        "job.pbtxt:2: model.layers[0].activation must be RELU, TANH or GELU for a hidden layer, "
        "got IDENTITY");
}

TEST_CASE("the output layer must be IDENTITY") {
  CHECK(JobError("model {\n  layers { width: 10 activation: RELU }\n}\n") ==
        "job.pbtxt:2: model.layers[0].activation must be IDENTITY for the output layer "
        "(softmax cross-entropy follows), got RELU");
}

TEST_CASE("a model without layers is rejected without a line") {
  CHECK(JobError("job_id: \"t\"\n") ==
        "job.pbtxt: model.layers must list at least one layer, got none");
}

TEST_CASE("a layer's width must be set") {
  CHECK(JobError("model {\n  layers { activation: IDENTITY }\n}\n") ==
        "job.pbtxt:2: model.layers[0].width must be set");
}

TEST_CASE("an unknown field is a syntax error with line and column") {
  CHECK(JobError(std::string(kBase) + "easgd {\n  moving_rat: 0.5\n}\n") ==
        "job.pbtxt:6:13: Message type \"rebound.EasgdConfig\" has no field named \"moving_rat\".");
}

TEST_CASE("an unknown enum value is a syntax error with line and column") {
  CHECK(JobError(std::string(kBase) + "scheduling: SOMETIMES\n") ==
        "job.pbtxt:5:13: Unknown enumeration value of \"SOMETIMES\" for field \"scheduling\".");
}

TEST_CASE("job ids are restricted to a safe alphabet") {
  CHECK(JobError("job_id: \"has space\"\nmodel { layers { width: 10 activation: IDENTITY } }\n") ==
        "job.pbtxt:1: job_id must match [A-Za-z0-9._-]{1,64}, got \"has space\"");
}

TEST_CASE("logged boundaries must exist in the topology") {
  CHECK(JobError(std::string(kBase) + "step_log { logged_boundaries: 1 }\n") ==
        "job.pbtxt:5: step_log.logged_boundaries[0] must be increasing boundary indices in "
        "[1, stages - 1 = 0], got 1");
}

TEST_CASE("recovery parallelism cannot exceed the micro-batches") {
  CHECK(JobError(std::string(kBase) +
                 "data { micro_batches: 4 }\nfault_tolerance { recovery_parallelism: 8 }\n") ==
        "job.pbtxt:6: fault_tolerance.recovery_parallelism must be in [1, 4], got 8");
}

TEST_CASE("GLOBAL_CHECKPOINT checkpoints at syncs: its interval is a multiple of the sync period") {
  CHECK(JobError(std::string(kBase) +
                 "easgd { sync_period: 8 }\n"
                 "fault_tolerance { policy: GLOBAL_CHECKPOINT checkpoint_every_steps: 20 }\n") ==
        "job.pbtxt:6: fault_tolerance.checkpoint_every_steps must be a multiple of "
        "easgd.sync_period = 8 under GLOBAL_CHECKPOINT (trainers sync at every checkpoint), got "
        "20");
  CHECK(JobError(std::string(kBase) +
                 "easgd { mode: ASYNC_ADAHESSIAN }\n"
                 "fault_tolerance { policy: GLOBAL_CHECKPOINT }\n") ==
        "job.pbtxt:6: fault_tolerance.policy GLOBAL_CHECKPOINT needs easgd.mode EASGD (its "
        "barrier is the trainers' sync)");
}

TEST_CASE("pipeline stages train in mode EASGD and recover by REPLAY from the step log") {
  const std::string pipeline =
      "model {\n  layers { width: 32 }\n  layers { width: 10 activation: IDENTITY }\n}\n"
      "topology { stages: 2 }\n";
  CHECK(JobError(pipeline + "easgd { mode: ASYNC_ADAHESSIAN }\n") ==
        "job.pbtxt:6: easgd.mode stages > 1 trains in mode EASGD only (ASYNC_ADAHESSIAN keeps "
        "whole models on the trainers)");
  CHECK(JobError(pipeline + "fault_tolerance { policy: RESTART_FROM_CENTER }\n") ==
        "job.pbtxt:6: fault_tolerance.policy stages > 1 needs policy REPLAY (a stage rebuilt any "
        "other way would not match the step its live neighbours are at), got "
        "RESTART_FROM_CENTER");
  CHECK(JobError(pipeline + "step_log { enabled: false }\n") ==
        "job.pbtxt:6: step_log.enabled stages > 1 under REPLAY needs the step log");
}

TEST_CASE("stage boundaries must match the number of stages") {
  CHECK(JobError("model {\n"
                 "  layers { width: 32 }\n"
                 "  layers { width: 32 }\n"
                 "  layers { width: 10 activation: IDENTITY }\n"
                 "}\n"
                 "topology {\n  stages: 3\n  stage_boundaries: 2\n}\n") ==
        "job.pbtxt:8: topology.stage_boundaries must list stages - 1 = 2 layer indices, got 1");
}

TEST_CASE("every problem of a file is reported at once, in order") {
  CHECK(JobError(std::string(kBase) + "adahessian {\n  lr: -1\n  epsilon: 0\n}\n") ==
        "job.pbtxt:6: adahessian.lr must be > 0, got -1\n"
        "job.pbtxt:7: adahessian.epsilon must be > 0, got 0");
}

TEST_CASE("a missing config file is NOT_FOUND and named") {
  auto job = LoadJobConfig("/nonexistent/job.pbtxt");
  CHECK(job.status().code() == absl::StatusCode::kNotFound);
  CHECK(job.status().message() == "/nonexistent/job.pbtxt: cannot open config file");
}

TEST_CASE("server configs: address, exclusive job sources, inline job errors") {
  auto bad_address = ParseServerConfig(
      "listen_address: \"localhost\"\njob { model { layers { width: 10 activation: IDENTITY } } }\n",
      "server.pbtxt", ".");
  CHECK(bad_address.status().message() ==
        "server.pbtxt:1: listen_address must be host:port with a port in [0, 65535], got "
        "\"localhost\"");

  auto no_job = ParseServerConfig("listen_address: \"127.0.0.1:0\"\n", "server.pbtxt", ".");
  CHECK(no_job.status().message() ==
        "server.pbtxt: job must be set inline, or job_file must name the job config");

  auto both = ParseServerConfig(
      "job { model { layers { width: 10 activation: IDENTITY } } }\njob_file: \"j.pbtxt\"\n",
      "server.pbtxt", ".");
  CHECK(both.status().message() ==
        "server.pbtxt:2: job_file and job { ... } are mutually exclusive; set exactly one");

  auto inline_error = ParseServerConfig(
      "job {\n  model { layers { width: 10 activation: IDENTITY } }\n  easgd { moving_rate: 2 }\n}\n",
      "server.pbtxt", ".");
  CHECK(inline_error.status().message() ==
        "server.pbtxt:3: job.easgd.moving_rate must be in (0, 1], got 2");
}

TEST_CASE("a server's job file is resolved against its directory and its errors name it") {
  const std::string dir = TempDir();
  WriteFile(dir + "/bad_job.pbtxt", std::string(kBase) + "easgd { sync_period: 0 }\n");
  WriteFile(dir + "/server.pbtxt", "job_file: \"bad_job.pbtxt\"\n");
  auto server = LoadServerConfig(dir + "/server.pbtxt");
  CHECK(server.status().message() ==
        dir + "/bad_job.pbtxt:5: easgd.sync_period must be >= 1, got 0");
}

TEST_CASE("a token file that does not exist is rejected before start") {
  auto server = ParseServerConfig(
      "job { model { layers { width: 10 activation: IDENTITY } } }\n"
      "security { token_file: \"missing.token\" }\n",
      "server.pbtxt", "/nonexistent");
  CHECK(server.status().message() ==
        "server.pbtxt:2: security.token_file cannot be read: /nonexistent/missing.token");
}

TEST_CASE("worker configs: backoff cap and deadline") {
  auto backoff = ParseWorkerConfig("backoff_initial_ms: 500\nbackoff_max_ms: 100\n",
                                   "worker.pbtxt", ".");
  CHECK(backoff.status().message() ==
        "worker.pbtxt:2: backoff_max_ms must be >= backoff_initial_ms = 500, got 100");
  auto deadline = ParseWorkerConfig("rpc_deadline_ms: 0\n", "worker.pbtxt", ".");
  CHECK(deadline.status().message() == "worker.pbtxt:1: rpc_deadline_ms must be >= 10, got 0");
  // The progress line's interval: 0 (off) up to a day; the default 10 s.
  auto negative = ParseWorkerConfig("\nprogress_interval_s: -1\n", "worker.pbtxt", ".");
  CHECK_THAT(std::string(negative.status().message()),
             Catch::Matchers::StartsWith("worker.pbtxt:2: progress_interval_s must be in [0, 86400]"));
  CHECK(ParseWorkerConfig("progress_interval_s: 0\n", "worker.pbtxt", ".").ok());
  auto defaults = ParseWorkerConfig("", "worker.pbtxt", ".");
  REQUIRE(defaults.ok());
  CHECK(defaults->progress_interval_s() == 10);
}

TEST_CASE("a received job is validated without locations") {
  JobConfig job;
  job.mutable_model()->add_layers()->set_width(10);
  job.mutable_model()->mutable_layers(0)->set_activation(IDENTITY);
  CHECK(ValidateJobConfig(job).ok());
  job.mutable_easgd()->set_sync_period(-3);
  CHECK(ValidateJobConfig(job).message() == "easgd.sync_period must be >= 1, got -3");
}

// The malformed-file matrix of docs/bad_input.md: every kind of mistake, in each of the three
// config kinds, is INVALID_ARGUMENT (NOT_FOUND for a missing file) naming file and line (and the
// column for syntax errors) and the field where one is involved.

TEST_CASE("a syntax error in a job names file, line and column") {
  CHECK(JobError(std::string(kBase) + "easgd {\n  sync_period: 4\n") ==
        "job.pbtxt:7:1: Expected identifier, got: ");  // at the end of the file
  CHECK(JobError(std::string(kBase) + "easgd }\n") ==
        "job.pbtxt:5:7: Expected \"{\", found \"}\".");
}

TEST_CASE("a value of the wrong type in a job names file, line, column and field") {
  CHECK(JobError(std::string(kBase) + "topology { replicas: \"two\" }\n") ==
        "job.pbtxt:5:22: Expected integer, got: \"two\"");
  CHECK(JobError(std::string(kBase) + "topology { replicas: 1.5 }\n") ==
        "job.pbtxt:5:22: Expected integer, got: 1.5");
  CHECK(JobError(std::string(kBase) + "easgd { moving_rate: \"fast\" }\n") ==
        "job.pbtxt:5:22: Expected double, got: \"fast\"");
  CHECK(JobError(std::string(kBase) + "topology: 3\n") ==
        "job.pbtxt:5:11: Expected \"{\", found \"3\".");
}

TEST_CASE("an integer beyond its field's type in a job is a syntax error naming the field") {
  CHECK(JobError(std::string(kBase) + "topology { replicas: 99999999999 }\n") ==
        "job.pbtxt:5:22: Integer out of range (99999999999)");
}

TEST_CASE("a field given twice in a job is a syntax error naming it") {
  CHECK(JobError(std::string(kBase) + "job_id: \"again\"\n") ==
        "job.pbtxt:5:7: Non-repeated field \"job_id\" is specified multiple times.");
}

TEST_CASE("an empty job file is rejected for its missing model") {
  CHECK(JobError("") == "job.pbtxt: model.layers must list at least one layer, got none");
}

TEST_CASE("server configs: syntax error, unknown field, wrong type, out of range, empty") {
  const std::string job = "job { model { layers { width: 10 activation: IDENTITY } } }\n";
  auto error = [](const std::string& text) {
    auto config = ParseServerConfig(text, "server.pbtxt", ".");
    REQUIRE_FALSE(config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(config.status().message());
  };
  CHECK(error(job + "listen_address \"127.0.0.1:0\"\n") ==
        "server.pbtxt:2:16: Expected \":\", found \"\"127.0.0.1:0\"\".");
  CHECK(error(job + "listen_adress: \"127.0.0.1:0\"\n") ==
        "server.pbtxt:2:14: Message type \"rebound.ServerConfig\" has no field named "
        "\"listen_adress\".");
  CHECK(error(job + "max_wait_ms: \"soon\"\n") ==
        "server.pbtxt:2:14: Expected integer, got: \"soon\"");
  CHECK(error(job + "max_message_bytes: 1000\n") ==
        "server.pbtxt:2: max_message_bytes must be in [1048576, 2147483647), got 1000");
  CHECK(error(job + "max_wait_ms: 5\n") == "server.pbtxt:2: max_wait_ms must be >= 100, got 5");
  CHECK(error("") == "server.pbtxt: job must be set inline, or job_file must name the job config");
}

TEST_CASE("server admission bounds: 0 means sized from the job, others are range-checked") {
  const std::string job = "job { model { layers { width: 10 activation: IDENTITY } } }\n";
  auto error = [](const std::string& text) {
    auto config = ParseServerConfig(text, "server.pbtxt", ".");
    REQUIRE_FALSE(config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(config.status().message());
  };
  CHECK(ParseServerConfig(job + "max_parked_calls: 0\nmax_inflight_bytes: 0\nmax_threads: 0\n",
                          "server.pbtxt", ".")
            .ok());
  CHECK(ParseServerConfig(job + "max_parked_calls: 8\nmax_threads: 24\n", "server.pbtxt", ".")
            .ok());
  CHECK(error(job + "max_parked_calls: -1\n") ==
        "server.pbtxt:2: max_parked_calls must be in [0, 100000], got -1");
  CHECK(error(job + "max_inflight_bytes: 1000\n") ==
        "server.pbtxt:2: max_inflight_bytes must be 0 (sized from the job) or >= 1048576, got "
        "1000");
  CHECK(error(job + "max_threads: 8\n") ==
        "server.pbtxt:2: max_threads must be 0 (sized from the job) or >= 16, got 8");
  CHECK(error(job + "max_parked_calls: 20\nmax_threads: 30\n") ==
        "server.pbtxt:3: max_threads must leave at least 16 threads beyond max_parked_calls = 20 "
        "for other calls, got 30");
}

TEST_CASE("a replicated group's block: every field checked, with the fields it needs elsewhere") {
  const std::string job = "job { model { layers { width: 10 activation: IDENTITY } } }\n";
  const std::string member = "listen_address: \"0.0.0.0:7070\"\ndurability { data_dir: \"/d\" }\n";
  auto parsed = ParseServerConfig(
      job + member + "replication {\n  etcd_endpoints: \"e1:2379\"\n  etcd_endpoints: \"e2:2379\"\n}\n",
      "server.pbtxt", ".");
  REQUIRE(parsed.ok());
  const ReplicationConfig& r = parsed->replication();
  CHECK(r.standbys() == 1);
  CHECK(r.leader_lease_ms() == 2000);
  CHECK(r.group() == "0");
  CHECK(r.peer_listen_address() == "0.0.0.0:7071");
  CHECK(r.sync());
  CHECK(r.max_buffered_bytes() == 268435456);
  CHECK(!ParseServerConfig(job + member, "server.pbtxt", ".")->has_replication());

  auto error = [&](const std::string& text) {
    auto config = ParseServerConfig(job + text, "server.pbtxt", ".");
    REQUIRE_FALSE(config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(config.status().message());
  };
  CHECK(error(member + "replication {\n  standbys: 1\n}\n") ==
        "server.pbtxt:4: replication.etcd_endpoints must name at least one etcd member "
        "(host:port)");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e1\"\n}\n") ==
        "server.pbtxt:5: replication.etcd_endpoints must be host:port with a port in [0, "
        "65535], got \"e1\"");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e1:0\"\n}\n") ==
        "server.pbtxt:5: replication.etcd_endpoints needs a port other than 0, got \"e1:0\"");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e:1\"\n  leader_lease_ms: 1500\n}\n") ==
        "server.pbtxt:6: replication.leader_lease_ms must be a multiple of 1000 (etcd leases are "
        "whole seconds) in [1000, 60000], got 1500");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e:1\"\n  standbys: 17\n}\n") ==
        "server.pbtxt:6: replication.standbys must be in [0, 16], got 17");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e:1\"\n  group: \"a/b\"\n}\n") ==
        "server.pbtxt:6: replication.group must be [A-Za-z0-9_.-]{1,64}, got \"a/b\"");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e:1\"\n  name: \"s 1\"\n}\n") ==
        "server.pbtxt:6: replication.name must be [A-Za-z0-9_.-]{1,64}, got \"s 1\"");
  CHECK(error(member + "replication {\n  etcd_endpoints: \"e:1\"\n  max_buffered_bytes: 10\n}\n") ==
        "server.pbtxt:6: replication.max_buffered_bytes must be in [1048576, 17179869184], got 10");
  // What the rest of the config must give a member: a fixed workers' port, a data directory.
  CHECK(error("listen_address: \"127.0.0.1:0\"\ndurability { data_dir: \"/d\" }\n"
              "replication { etcd_endpoints: \"e:1\" }\n") ==
        "server.pbtxt:2: listen_address needs a fixed port in a replicated group (workers reach "
        "the leader there), got port 0");
  CHECK(error("listen_address: \"127.0.0.1:7070\"\nreplication { etcd_endpoints: \"e:1\" }\n") ==
        "server.pbtxt:3: replication needs durability.data_dir (a standby keeps its copy there)");
  auto checkpointed = ParseServerConfig(
      "job { model { layers { width: 10 activation: IDENTITY } }\n"
      "      fault_tolerance { policy: GLOBAL_CHECKPOINT } }\n"
      "listen_address: \"127.0.0.1:7070\"\ndurability { data_dir: \"/d\" }\n"
      "replication { etcd_endpoints: \"e:1\" }\n",
      "server.pbtxt", ".");
  REQUIRE_FALSE(checkpointed.ok());
  CHECK(checkpointed.status().message() ==
        "server.pbtxt:5: replication cannot be set under fault_tolerance.policy GLOBAL_CHECKPOINT: "
        "its checkpoints are files in the data directory that standbys do not receive, so a new "
        "leader would have none to roll back to; use REPLAY or RESTART_FROM_CENTER, or one server "
        "per group");
}

TEST_CASE("export: a schedule is needed, bounds are checked, a sharded center is refused; the "
          "directory is relative to the server config") {
  auto job = ParseJobConfig(std::string(kBase) + "export { every_steps: 500 }\n", "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->export_().keep_last() == 3);
  CHECK(job->export_().format() == SAFETENSORS);
  CHECK(job->export_().dir().empty());
  CHECK(JobError(std::string(kBase) + "export {\n  keep_last: 2\n}\n") ==
        "job.pbtxt:5: export needs every_steps or every_seconds (or both) > 0");
  CHECK(JobError(std::string(kBase) + "export {\n  every_seconds: -1\n  every_steps: 10\n}\n") ==
        "job.pbtxt:6: export.every_seconds must be >= 0, got -1");
  CHECK(JobError(std::string(kBase) + "export {\n  every_steps: 10\n  keep_last: -1\n}\n") ==
        "job.pbtxt:7: export.keep_last must be >= 0, got -1");
  CHECK(JobError(std::string(kBase) + "sharding { groups: 2 }\nexport {\n  every_steps: 10\n}\n") ==
        "job.pbtxt:6: export is not supported yet for a sharded center (sharding.groups 2): no "
        "server holds the whole center");
  auto server = ParseServerConfig(
      "job {\n  model { layers { width: 10 activation: IDENTITY } }\n  export { every_steps: 5 "
      "dir: \"out/exports\" }\n}\n",
      "server.pbtxt", "/etc/rebound");
  INFO(server.status());
  REQUIRE(server.ok());
  CHECK(server->job().export_().dir() == "/etc/rebound/out/exports");
}

TEST_CASE("a sharded job: sharding.groups and each server's shard block, checked together") {
  const std::string job =
      "job {\n  model { layers { width: 10 activation: IDENTITY } }\n  sharding { groups: 2 }\n}\n";
  const std::string shard =
      "shard {\n  group: 1\n  group_addresses: \"a:1\"\n  group_addresses: \"b:1,c:1\"\n}\n";
  auto parsed = ParseServerConfig(job + shard, "server.pbtxt", ".");
  INFO(parsed.status());
  REQUIRE(parsed.ok());
  CHECK(parsed->job().sharding().groups() == 2);
  CHECK(parsed->shard().group() == 1);
  CHECK(parsed->shard().group_addresses(1) == "b:1,c:1");
  // One group needs no shard block and refuses one.
  const std::string plain = "job {\n  model { layers { width: 10 activation: IDENTITY } }\n}\n";
  CHECK(ParseServerConfig(plain, "server.pbtxt", ".").ok());

  auto error = [&](const std::string& text) {
    auto config = ParseServerConfig(text, "server.pbtxt", ".");
    REQUIRE_FALSE(config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(config.status().message());
  };
  CHECK(error(plain + shard) ==
        "server.pbtxt:4: shard is set but the job's sharding.groups is 1: one group holds the "
        "center");
  CHECK(error(job) ==
        "server.pbtxt: shard must say this server's group and the 2 groups' addresses (the job's "
        "sharding.groups is 2)");
  CHECK(error(job + "shard {\n  group: 2\n  group_addresses: \"a:1\"\n  group_addresses: "
                    "\"b:1\"\n}\n") ==
        "server.pbtxt:6: shard.group must be in [0, 1], got 2");
  CHECK(error(job + "shard {\n  group_addresses: \"a:1\"\n}\n") ==
        "server.pbtxt:6: shard.group_addresses must have one entry per group (sharding.groups = "
        "2), got 1");
  CHECK(error(job + "shard {\n  group_addresses: \"a:1\"\n  group_addresses: \"b\"\n}\n") ==
        "server.pbtxt:6: shard.group_addresses must be host:port with a port in [0, 65535], got "
        "\"b\"");
  // GLOBAL_CHECKPOINT across hosts: group 0's calls to the range groups need the operator token.
  const std::string checkpointed =
      "job {\n  model { layers { width: 10 activation: IDENTITY } }\n  sharding { groups: 2 }\n"
      "  fault_tolerance { policy: GLOBAL_CHECKPOINT }\n}\n";
  CHECK(error(checkpointed + shard) ==
        "server.pbtxt: security.operator_token_file must be set, the same on every group, in a "
        "sharded GLOBAL_CHECKPOINT job across hosts: group 0 asks the range groups to keep and "
        "roll back their ranges with it (docs/sharding.md#global-checkpoint); "
        "shard.group_addresses names a:1");
  CHECK(ParseServerConfig(checkpointed + "shard {\n  group_addresses: \"127.0.0.1:1\"\n  "
                                         "group_addresses: \"localhost:2\"\n}\n",
                          "server.pbtxt", ".")
            .ok());
  // So do audits: group 0 reads each audited window's start from every range.
  const std::string audited =
      "job {\n  model { layers { width: 10 activation: IDENTITY } }\n  sharding { groups: 2 }\n"
      "  audit { fraction: 0.05 }\n}\n";
  CHECK(error(audited + shard) ==
        "server.pbtxt: security.operator_token_file must be set, the same on every group, in a "
        "sharded job with audits across hosts: group 0 reads each audited window's start from "
        "the range groups with it (docs/sharding.md#audits); shard.group_addresses names a:1");
  CHECK(ParseServerConfig(audited + "shard {\n  group_addresses: \"127.0.0.1:1\"\n  "
                                    "group_addresses: \"localhost:2\"\n}\n",
                          "server.pbtxt", ".")
            .ok());
  auto job_error = [&](const std::string& text) {
    auto config = ParseJobConfig(text, "job.pbtxt");
    REQUIRE_FALSE(config.ok());
    return std::string(config.status().message());
  };
  const std::string model = "model { layers { width: 10 activation: IDENTITY } }\n";
  CHECK(job_error(model + "sharding { groups: 65 }\n") ==
        "job.pbtxt:2: sharding.groups must be in [1, 64], got 65");
  CHECK(ParseJobConfig(model + "sharding { groups: 2 }\neasgd { mode: ASYNC_ADAHESSIAN }\n",
                       "job.pbtxt")
            .ok());
  CHECK(ParseJobConfig(model + "sharding { groups: 2 }\nfault_tolerance { policy: GLOBAL_CHECKPOINT }\n",
                       "job.pbtxt")
            .ok());
  // A declared model (the Python client) shards under REPLAY and RESTART_FROM_CENTER.
  CHECK(ParseJobConfig("model { declared_by_worker: true }\nsharding { groups: 2 }\n", "job.pbtxt")
            .ok());
  CHECK(job_error("model { declared_by_worker: true }\nsharding { groups: 2 }\n"
                  "fault_tolerance { policy: GLOBAL_CHECKPOINT }\n") ==
        "job.pbtxt:2: sharding.groups > 1 with a model declared by its workers needs "
        "fault_tolerance.policy REPLAY or RESTART_FROM_CENTER (GLOBAL_CHECKPOINT shards a model "
        "spec with layers only)");
}

TEST_CASE("worker configs: syntax error, unknown field, wrong type, out of range") {
  auto error = [](const std::string& text) {
    auto config = ParseWorkerConfig(text, "worker.pbtxt", ".");
    REQUIRE_FALSE(config.ok());
    CHECK(config.status().code() == absl::StatusCode::kInvalidArgument);
    return std::string(config.status().message());
  };
  CHECK(error("backoff_initial_ms: 20\nsecurity {\n") ==
        "worker.pbtxt:3:1: Expected identifier, got: ");
  CHECK(error("server_adress: \"127.0.0.1:7070\"\n") ==
        "worker.pbtxt:1:14: Message type \"rebound.WorkerConfig\" has no field named "
        "\"server_adress\".");
  CHECK(error("give_up_after_ms: 1e3\n") == "worker.pbtxt:1:19: Expected integer, got: 1e3");
  CHECK(error("role: CAPTAIN\n") ==
        "worker.pbtxt:1:7: Unknown enumeration value of \"CAPTAIN\" for field \"role\".");
  CHECK(error("give_up_after_ms: -1\n") ==
        "worker.pbtxt:1: give_up_after_ms must be >= 0, got -1");
  CHECK(error("server_address: \"no-port\"\n") ==
        "worker.pbtxt:1: server_address must be host:port with a port in [0, 65535], got "
        "\"no-port\"");
}

TEST_CASE("a worker's server_address may list a replicated group's members; a bad list names "
          "file, line, field and entry") {
  auto group = ParseWorkerConfig(
      "rpc_deadline_ms: 500\nserver_address: \"10.0.0.1:7070, 10.0.0.2:7070,server-c:7070\"\n",
      "worker.pbtxt", ".");
  REQUIRE(group.ok());
  CHECK(group->server_address() == "10.0.0.1:7070, 10.0.0.2:7070,server-c:7070");
  auto repeated =
      ParseWorkerConfig("server_address: \"10.0.0.1:7070,10.0.0.1:7070\"\n", "worker.pbtxt", ".");
  REQUIRE_FALSE(repeated.ok());
  CHECK(repeated.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(repeated.status().message() ==
        "worker.pbtxt:1: server_address entry 2 of \"10.0.0.1:7070,10.0.0.1:7070\" repeats entry "
        "1, \"10.0.0.1:7070\"");
  auto port_zero = ParseWorkerConfig("\nserver_address: \"10.0.0.1:7070,10.0.0.2:0\"\n",
                                     "worker.pbtxt", ".");
  CHECK(port_zero.status().message() ==
        "worker.pbtxt:2: server_address entry 2 of \"10.0.0.1:7070,10.0.0.2:0\" must be host:port "
        "with a port in [1, 65535] (a member of the group), got \"10.0.0.2:0\"");
}

TEST_CASE("an empty worker config is valid: every field has its documented default") {
  auto config = ParseWorkerConfig("", "worker.pbtxt", ".");
  REQUIRE(config.ok());
  CHECK(config->server_address() == "127.0.0.1:7070");
  CHECK(config->rpc_deadline_ms() == 10000);
}

TEST_CASE("missing server and worker config files are NOT_FOUND and named") {
  auto server = LoadServerConfig("/nonexistent/server.pbtxt");
  CHECK(server.status().code() == absl::StatusCode::kNotFound);
  CHECK(server.status().message() == "/nonexistent/server.pbtxt: cannot open config file");
  auto worker = LoadWorkerConfig("/nonexistent/worker.pbtxt");
  CHECK(worker.status().code() == absl::StatusCode::kNotFound);
  CHECK(worker.status().message() == "/nonexistent/worker.pbtxt: cannot open config file");
  // A server whose job_file does not exist names the job file it looked for.
  const std::string dir = TempDir();
  WriteFile(dir + "/server_without_job.pbtxt", "job_file: \"no_such_job.pbtxt\"\n");
  auto missing_job = LoadServerConfig(dir + "/server_without_job.pbtxt");
  CHECK(missing_job.status().code() == absl::StatusCode::kNotFound);
  CHECK(missing_job.status().message() == dir + "/no_such_job.pbtxt: cannot open config file");
}

TEST_CASE("stage layer ranges follow explicit boundaries or an even split") {
  auto job = ParseJobConfig(
      "model {\n  layers { width: 8 }\n  layers { width: 8 }\n  layers { width: 8 }\n"
      "  layers { width: 10 activation: IDENTITY }\n}\ntopology { stages: 2 }\n",
      "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(StageLayerStarts(*job) == std::vector<int>{0, 2, 4});
  job->mutable_topology()->add_stage_boundaries(3);
  CHECK(StageLayerStarts(*job) == std::vector<int>{0, 3, 4});
}

}  // namespace
}  // namespace rebound

namespace rebound {
namespace {

TEST_CASE("a model declared by its workers: no layers, one stage, replay by one spare") {
  const std::string declared = "job_id: \"t\"\nmodel { declared_by_worker: true }\n";
  auto job = ParseJobConfig(declared + "topology { replicas: 4 spares: 1 }\n", "job.pbtxt");
  REQUIRE(job.ok());
  CHECK(job->model().declared_by_worker());

  CHECK_THAT(JobError(declared + "topology {\n  stages: 2\n}\n"),
             Catch::Contains("job.pbtxt:4: topology.stages must be 1 for a model declared by its "
                             "workers (pipeline stages are C++-only"));
  CHECK_THAT(JobError(declared + "fault_tolerance {\n  recovery_parallelism: 2\n}\n"),
             Catch::Contains("fault_tolerance.recovery_parallelism must be 1 for a model "
                             "declared by its workers (parallel replay is C++-only"));
  CHECK_THAT(JobError("job_id: \"t\"\nmodel {\n  declared_by_worker: true\n  layers { width: 3 "
                      "activation: IDENTITY }\n}\n"),
             Catch::Contains("model.layers must be empty when model.declared_by_worker is true"));
}

}  // namespace
}  // namespace rebound
