#pragma once

// Serves a MetricsRegistry at GET /metrics (Prometheus text format 0.0.4) over plain HTTP
// (cpp-httplib), on a thread of its own. Any other path is 404. Bind it to 127.0.0.1 unless the
// operator says otherwise: metrics tell about the job, and nothing on this port is authenticated.

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace httplib {
class Server;
}

namespace rebound {

class MetricsHttpServer {
 public:
  // Listens on `address` ("HOST:PORT"; port 0 picks a free one) and serves `registry` (not owned;
  // outlives the server). Returns the port it listens on. UNAVAILABLE when it cannot bind;
  // INVALID_ARGUMENT for a malformed address.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& address,
                                                                  const MetricsRegistry* registry);
  ~MetricsHttpServer();

  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

  int port() const { return port_; }
  // host:port as bound (the host as given).
  const std::string& address() const { return address_; }

 private:
  MetricsHttpServer() = default;

  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
  std::string address_;
};

}  // namespace rebound
