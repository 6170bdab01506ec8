// rebound_server: the Rebound parameter-server daemon.
//
//   rebound_server --config server.pbtxt [--listen HOST:PORT] [--port_file PATH]
//
// Serves ParameterServer, grpc.health.v1 and server reflection. With durability.data_dir set it
// keeps its state in RocksDB and reloads it at start (health NOT_SERVING meanwhile). Exits 0
// after SIGTERM/SIGINT (graceful shutdown, in-flight calls get up to 5 s), 2 on a bad config,
// 1 if it cannot listen or its data directory cannot be opened or read.

#include <gflags/gflags.h>
#include <glog/logging.h>

#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/grpc_polling.h"
#include "common/process.h"
#include "common/usage.h"
#include "common/version.h"
#include "server/server_life.h"

DEFINE_string(config, "", "server config file (.pbtxt); or --job");
DEFINE_string(job, "",
              "job config file (.pbtxt): serve it with the default server settings, no server "
              "config (instead of --config)");
DEFINE_string(listen, "", "host:port to listen on; overrides listen_address (port 0 = any)");
DEFINE_string(port_file, "", "write the bound port to this file once serving");
DEFINE_string(data_dir, "", "durable state directory; overrides durability.data_dir");
DEFINE_string(restore_from, "",
              "a backup directory (reboundctl backup): checked against its manifest and copied "
              "into the data directory, which must not exist or be empty, before the server "
              "starts from it (docs/operations.md#backup-and-restore)");
DEFINE_string(name, "", "this server's name in its replicated group; overrides replication.name");
DEFINE_string(peer_listen, "",
              "host:port for the group's peers (ServerPeer); overrides "
              "replication.peer_listen_address (port 0 = any)");
DEFINE_string(peer_port_file, "", "write the bound peer port to this file (replicated groups)");
DEFINE_bool(accept_wal_loss, false,
            "start even if RocksDB's write-ahead log is damaged, dropping every write after the "
            "damage (acknowledged ones included) and logging what was dropped; for the operator, "
            "once, after reading docs/troubleshooting.md");

namespace rebound::server {
namespace {

// The config from --config or --job, with --listen and --data_dir applied; then one life.
int Run() {
  if (FLAGS_config.empty() == FLAGS_job.empty()) {
    LOG(ERROR) << "give --config FILE (a server config) or --job FILE (a job with the default "
                  "server settings), not both";
    return 2;
  }
  // --job: a server config of defaults naming the job, e.g. on each host of a cluster
  //   rebound_server --job job.pbtxt --listen 0.0.0.0:7070 --data_dir /var/lib/rebound
  auto loaded = !FLAGS_config.empty()
                    ? LoadServerConfig(FLAGS_config)
                    : ParseServerConfig(absl::StrCat("job_file: \"", FLAGS_job, "\"\n"),
                                        "--job " + FLAGS_job, ".");
  if (!loaded.ok()) {
    LOG(ERROR) << "invalid config:\n" << loaded.status().message();
    return 2;
  }
  ServerConfig config = *std::move(loaded);
  if (!FLAGS_listen.empty()) {
    absl::Status valid = ValidateHostPort(FLAGS_listen, "--listen");
    if (!valid.ok()) {
      LOG(ERROR) << valid.message();
      return 2;
    }
    config.set_listen_address(FLAGS_listen);
  }
  if (!FLAGS_data_dir.empty()) config.mutable_durability()->set_data_dir(FLAGS_data_dir);
  if (config.job().has_export_() && config.job().export_().dir().empty() &&
      config.durability().data_dir().empty()) {
    LOG(ERROR) << "invalid config: " << FLAGS_config
               << ": job.export.dir must be set for a server without a data directory "
                  "(durability.data_dir or --data_dir; exports go to <data_dir>/exports)";
    return 2;
  }
  LifeOptions options;
  options.port_file = FLAGS_port_file;
  options.restore_from = FLAGS_restore_from;
  options.name = FLAGS_name;
  options.peer_listen = FLAGS_peer_listen;
  options.peer_port_file = FLAGS_peer_port_file;
  options.accept_wal_loss = FLAGS_accept_wal_loss;
  return RunServerLife(config, options);
}

}  // namespace
}  // namespace rebound::server

constexpr char kUsageHeader[] =
    "usage: rebound_server --config FILE | --job FILE [--listen HOST:PORT] [--port_file PATH]\n"
    "                      [--data_dir DIR] [--restore_from DIR]\n"
    "                      [--name NAME --peer_listen HOST:PORT] (a replicated group's member)\n"
    "\n"
    "The Rebound parameter server: serves ParameterServer, grpc.health.v1 and reflection. With a\n"
    "data directory it keeps its state in RocksDB and reloads it at start. The config is a\n"
    "ServerConfig (docs/config.md); --job serves a JobConfig with the default server settings\n"
    "(listen_address 127.0.0.1:7070: --listen 0.0.0.0:7070 for other hosts).\n";

constexpr char kUsageFooter[] =
    "Exit codes: 0 after SIGTERM/SIGINT (graceful shutdown); 1 it cannot listen, or its data\n"
    "directory cannot be opened or read; 2 bad config or flags.\n";

int main(int argc, char** argv) {
  rebound::ExitIfVersionFlag(argc, argv);
  rebound::ExitIfHelpFlag(argc, argv,
                          rebound::UsageText(kUsageHeader, __FILE__, kUsageFooter));
  if (const absl::Status flags = rebound::CheckCommandLineFlags(argc, argv); !flags.ok()) {
    std::fprintf(stderr, "%s: %s (--help: the flags)\n", "rebound_server",
                 std::string(flags.message()).c_str());
    return 2;  // bad flags, as documented (gflags would exit 1)
  }
  rebound::ShortenGrpcBackupPolling();
  rebound::InstallTerminationHandlers();
  // Every sync allocates and frees buffers of the center's size.
  rebound::TuneAllocatorForLargeBuffers();
  gflags::SetUsageMessage("rebound_server --config FILE | --job FILE (--help: the flags)");
  // Kept for running again (a deposed leader): gflags removes the flags it parses from argv.
  std::vector<std::string> arguments(argv, argv + argc);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  rebound::InitLogging(argv[0]);
  const int code = rebound::server::Run();
  if (code != rebound::server::kRunAgain) return code;
  std::vector<char*> again;
  for (std::string& argument : arguments) again.push_back(argument.data());
  again.push_back(nullptr);
  LOG(INFO) << "running again as a standby";
  execv("/proc/self/exe", again.data());
  PLOG(ERROR) << "execv /proc/self/exe";
  return 1;
}
