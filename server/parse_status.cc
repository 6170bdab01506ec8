#include "server/parse_status.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_handoff.h"
#include "grpcpp/support/status.h"

namespace rebound::server {
namespace {

class ParseStatusInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ParseStatusInterceptor(const char* method) : method_(method == nullptr ? "" : method) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      if (status.error_code() == grpc::StatusCode::INTERNAL && status.error_message().empty()) {
        methods->ModifySendStatus(grpc::Status(
            grpc::StatusCode::INVALID_ARGUMENT,
            absl::StrCat(method_, ": the request is not a valid protobuf message of this method "
                                  "(it does not parse)")));
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;
};

class ParseStatusFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    MarkTakenFromGrpc();  // on a callback API thread for WorkerSession.Attach
    return new ParseStatusInterceptor(info->method());
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewParseStatusFactory() {
  return std::make_unique<ParseStatusFactory>();
}

}  // namespace rebound::server
