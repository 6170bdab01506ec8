#include "bench/local_cluster.h"

#include <stdlib.h>

#include <cstdio>
#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "google/protobuf/text_format.h"
#include "testing/cluster/processes.h"

namespace rebound::bench {

void ClusterFlags::AddTo(CommandLine* command_line) {
  command_line->AddText("job", &job);
  command_line->AddText("server_binary", &server_binary);
  command_line->AddText("worker_binary", &worker_binary);
  command_line->AddSwitch("keep_logs", &keep_logs);
}

absl::StatusOr<JobConfig> ResolveClusterFlags(ClusterFlags* flags) {
  using testing::FindRunfile;
  using testing::IsExecutableFile;
  using testing::IsReadableFile;
  if (flags->server_binary.empty()) {
    flags->server_binary = FindRunfile("server/rebound_server", IsExecutableFile);
  }
  if (flags->worker_binary.empty()) {
    flags->worker_binary = FindRunfile("worker/rebound_worker", IsExecutableFile);
  }
  if (flags->job.empty()) flags->job = FindRunfile("configs/job.pbtxt", IsReadableFile);
  if (!IsExecutableFile(flags->server_binary) || !IsExecutableFile(flags->worker_binary)) {
    return absl::InvalidArgumentError(
        "cannot find rebound_server / rebound_worker; pass --server_binary and --worker_binary");
  }
  absl::StatusOr<JobConfig> job = LoadJobConfig(flags->job);
  if (!job.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--job: ", job.status().message()));
  }
  return job;
}

// ---------------------------------------------------------------------------------------------
// RunDirectories

absl::StatusOr<RunDirectories> RunDirectories::Create(const std::string& name, bool keep_logs) {
  std::string dir_template = absl::StrCat("/tmp/rebound-", name, "-XXXXXX");
  if (mkdtemp(dir_template.data()) == nullptr) {
    return absl::InternalError("cannot create a directory under /tmp");
  }
  return RunDirectories(std::move(dir_template), keep_logs);
}

std::string RunDirectories::StartRun(const std::string& run) const {
  const std::string dir = absl::StrCat(path_, "/", run);
  std::filesystem::create_directories(dir);
  return dir;
}

void RunDirectories::FinishRun(const std::string& dir, bool ok) {
  if (!ok) {
    all_ok_ = false;
  } else if (!keep_logs_) {
    std::filesystem::remove_all(dir);
  }
}

void RunDirectories::Finish() const {
  if (!all_ok_) std::printf("some runs FAILED; their logs are kept in %s\n", path_.c_str());
  if (all_ok_ && !keep_logs_) std::filesystem::remove_all(path_);
}

// ---------------------------------------------------------------------------------------------
// LocalCluster

namespace {

testing::ClusterOptions OptionsFor(const ClusterFlags& flags, std::string dir, int standbys,
                                   int leader_lease_ms) {
  testing::ClusterOptions options;
  options.standbys = standbys;
  options.leader_lease_ms = leader_lease_ms;
  options.server_binary = flags.server_binary;
  options.worker_binary = flags.worker_binary;
  options.dir = std::move(dir);
  return options;
}

}  // namespace

LocalCluster::LocalCluster(const ClusterFlags& flags, std::string dir, int standbys,
                           int leader_lease_ms)
    : testing::Cluster(OptionsFor(flags, std::move(dir), standbys, leader_lease_ms)) {}

absl::Status LocalCluster::StartServer(const JobConfig& job, const std::string& data_dir,
                                       const std::string& worker_timing) {
  ServerConfig config;
  config.set_listen_address("127.0.0.1:0");
  *config.mutable_job() = job;
  if (!data_dir.empty()) config.mutable_durability()->set_data_dir(data_dir);
  std::string text;
  google::protobuf::TextFormat::PrintToString(config, &text);
  const std::string timing = !worker_timing.empty() ? worker_timing
                                                     : "backoff_initial_ms: 50\n"
                                                       "backoff_max_ms: 1000\n"
                                                       "give_up_after_ms: 30000\n";
  return testing::Cluster::StartServer(text,
                                       absl::StrCat("job_id: \"", job.job_id(), "\"\n", timing));
}

}  // namespace rebound::bench
