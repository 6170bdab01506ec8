// rebound_launch: a whole Rebound job on this machine from one job file (docs/design.md §8).
//
//   rebound_launch --job FILE [--data_dir DIR] [--port N] [--workdir DIR]
//                  [--kill_trainer_at_step N] [--kill_slot R,S] [--progress_csv PATH]
//                  [--timeout_s N] [--server_binary PATH] [--worker_binary PATH]
//                  [--worker_command CMD]
//                  [--standbys N [--etcd_members M] [--kill_leader_at_step S]]
//                  [--shard_groups K]
//   rebound_launch --version
//
// Exit codes: 0 every slot FINISHED; 1 timeout, the server exited, or the cluster could not
// start; 2 bad flags or job; 128+N stopped by signal N (130 SIGINT, 143 SIGTERM).

#include <cstdio>
#include <string>
#include <vector>

#include "common/config.h"
#include "common/grpc_polling.h"
#include "common/process.h"
#include "common/version.h"
#include "tools/launch/launcher.h"
#include "tools/launch/options.h"

namespace rebound::launch {
namespace {

constexpr int kExitBadInput = 2;
constexpr int kExitCannotStart = 1;

int Main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  absl::StatusOr<LaunchOptions> options = ParseLaunchArgs(args);
  if (!options.ok()) {
    std::fprintf(stderr, "rebound_launch: %s\n\n%s", std::string(options.status().message()).c_str(),
                 kUsage);
    return kExitBadInput;
  }
  if (options->help) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  absl::StatusOr<JobConfig> job = LoadJobConfig(options->job_file);
  if (!job.ok()) {
    std::fprintf(stderr, "rebound_launch: invalid job:\n%s\n",
                 std::string(job.status().message()).c_str());
    return kExitBadInput;
  }
  if (absl::Status valid = CheckOptionsAgainstJob(*options, *job); !valid.ok()) {
    std::fprintf(stderr, "rebound_launch: %s\n", std::string(valid.message()).c_str());
    return kExitBadInput;
  }
  absl::StatusOr<Binaries> binaries = FindBinaries(argv[0], *options);
  if (!binaries.ok()) {
    std::fprintf(stderr, "rebound_launch: %s\n", std::string(binaries.status().message()).c_str());
    return absl::IsInvalidArgument(binaries.status()) ? kExitBadInput : kExitCannotStart;
  }
  Launcher launcher(*std::move(options), *std::move(job), *std::move(binaries));
  return launcher.Run();
}

}  // namespace
}  // namespace rebound::launch

int main(int argc, char** argv) {
  rebound::ExitIfVersionFlag(argc, argv);
  rebound::ShortenGrpcBackupPolling();
  // Before any thread starts (gRPC's included), so every thread inherits the mask and SIGTERM and
  // SIGINT stay pending until the launcher takes them.
  rebound::BlockTerminationSignals();
  return rebound::launch::Main(argc, argv);
}
