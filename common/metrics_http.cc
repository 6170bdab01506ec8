#include "common/metrics_http.h"

#include <httplib.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace rebound {

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& address, const MetricsRegistry* registry) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address must be HOST:PORT, got \"", address, "\""));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->server_ = std::make_unique<httplib::Server>();
  server->server_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  // SO_REUSEADDR only: httplib's default also sets SO_REUSEPORT, which would let a second
  // process bind the same port and take half of the scrapes.
  server->server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<void*>(&yes), sizeof(yes));
  });
  server->server_->set_read_timeout(5, 0);
  server->server_->set_write_timeout(5, 0);
  if (port == 0) {
    server->port_ = server->server_->bind_to_any_port(host);
  } else {
    server->port_ = server->server_->bind_to_port(host, port) ? port : -1;
  }
  if (server->port_ <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for metrics on ", address));
  }
  server->address_ = absl::StrCat(address.substr(0, colon), ":", server->port_);
  httplib::Server* raw = server->server_.get();
  server->thread_ = std::thread([raw] { raw->listen_after_bind(); });
  // Stopping a server that has not started listening yet could leave its thread waiting.
  const Clock* clock = DefaultClock();
  const absl::Time limit = clock->Now() + absl::Seconds(5);
  while (!raw->is_running() && clock->Now() < limit) clock->WaitFor(absl::Milliseconds(1), nullptr);
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace rebound
