// rebound_server: the Rebound parameter-server daemon.
//
//   rebound_server --config server.pbtxt [--listen HOST:PORT] [--port_file PATH]
//
// Serves ParameterServer, grpc.health.v1 and server reflection. Exits 0 after SIGTERM/SIGINT
// (graceful shutdown, in-flight calls get up to 5 s), 2 on a bad config, 1 if it cannot listen.

#include <gflags/gflags.h>
#include <glog/logging.h>

#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/process.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "server/membership.h"
#include "server/service.h"

DEFINE_string(config, "", "server config file (.pbtxt); required");
DEFINE_string(listen, "", "host:port to listen on; overrides listen_address (port 0 = any)");
DEFINE_string(port_file, "", "write the bound port to this file once serving");

namespace rebound::server {
namespace {

int Run() {
  if (FLAGS_config.empty()) {
    LOG(ERROR) << "--config is required";
    return 2;
  }
  auto loaded = LoadServerConfig(FLAGS_config);
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

  RealClock clock;
  Membership membership(config.job(), &clock);
  ParameterServerService service(config, &membership, &clock);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(config.listen_address(), grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(config.max_message_bytes());
  builder.SetMaxSendMessageSize(config.max_message_bytes());
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    LOG(ERROR) << "cannot listen on " << config.listen_address();
    return 1;
  }
  server->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << kServerVersion << " serving job '" << config.job().job_id() << "' on port " << port
            << " (" << config.job().topology().replicas() << " x "
            << config.job().topology().stages() << " slots)";
  if (!FLAGS_port_file.empty()) {
    absl::Status written = WriteFileAtomically(FLAGS_port_file, absl::StrCat(port, "\n"));
    if (!written.ok()) {
      LOG(ERROR) << written;
      server->Shutdown();
      return 1;
    }
  }

  // The failure detector checks several times per heartbeat interval, so a silent worker is
  // declared failed at most failure_timeout + one check period after its last heartbeat.
  const absl::Duration period = absl::Milliseconds(
      std::max(10, std::min(100, config.job().fault_tolerance().heartbeat_interval_ms() / 4)));
  absl::Notification stop;
  std::thread detector([&] {
    while (!stop.WaitForNotificationWithTimeout(period)) {
      for (const FailedWorker& failed : membership.DetectFailures()) {
        LOG(WARNING) << "declared '" << failed.name << "' (incarnation " << failed.incarnation
                     << ") failed after " << absl::ToInt64Milliseconds(failed.silent_for)
                     << " ms of silence"
                     << (failed.had_slot ? absl::StrCat("; slot (", failed.slot.replica(), ", ",
                                                        failed.slot.stage(), ") is LOST")
                                         : std::string());
      }
    }
  });

  const int signal_number = WaitForTerminationSignal();
  LOG(INFO) << "signal " << signal_number << ": shutting down";
  server->GetHealthCheckService()->SetServingStatus(false);
  stop.Notify();
  detector.join();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  LOG(INFO) << "stopped";
  return 0;
}

}  // namespace
}  // namespace rebound::server

int main(int argc, char** argv) {
  rebound::BlockTerminationSignals();
  gflags::SetUsageMessage("rebound_server --config FILE [--listen HOST:PORT] [--port_file PATH]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  rebound::InitLogging(argv[0]);
  return rebound::server::Run();
}
