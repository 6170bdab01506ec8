#include "common/security.h"

#include <glog/logging.h>

#include <fstream>
#include <sstream>
#include <vector>

#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/config.h"
#include "common/server_addresses.h"
#include "grpc/grpc.h"
#include "grpc/grpc_security.h"
#include "grpc/slice.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/support/client_interceptor.h"

namespace rebound {
namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* what) {
  absl::StatusOr<std::string> bytes = ReadBoundedFile(path, what);
  if (!bytes.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read ", what, " ", path, ": ", bytes.status().message()));
  }
  return bytes;
}

// Adds the bearer token and the worker credential (each when there is one) to every call.
class CallMetadataInterceptor final : public grpc::experimental::Interceptor {
 public:
  CallMetadataInterceptor(const std::string* bearer, std::string credential)
      : bearer_(bearer), credential_(std::move(credential)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      auto* metadata = methods->GetSendInitialMetadata();
      if (!bearer_->empty()) metadata->insert({"authorization", *bearer_});
      if (!credential_.empty()) metadata->insert({kWorkerCredentialKey, credential_});
    }
    methods->Proceed();
  }

 private:
  const std::string* bearer_;
  const std::string credential_;  // the worker's, read when the call started
};

class CallMetadataInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  CallMetadataInterceptorFactory(std::string token, std::shared_ptr<const WorkerCredential> worker)
      : bearer_(token.empty() ? std::string() : absl::StrCat("Bearer ", token)),
        worker_(std::move(worker)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new CallMetadataInterceptor(&bearer_,
                                       worker_ == nullptr ? std::string() : worker_->Get());
  }

 private:
  const std::string bearer_;  // lives as long as the channel
  const std::shared_ptr<const WorkerCredential> worker_;
};

constexpr char kNoTokenMessage[] =
    "this server requires a bearer token (authorization: Bearer <token>); the call has none "
    "or another one";

absl::string_view View(const grpc_slice& slice) {
  return absl::string_view(reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)),
                           GRPC_SLICE_LENGTH(slice));
}

// gRPC core's auth metadata processor: it runs on a call's initial metadata, before the call is
// matched to a method and before its message is received, so a call refused here never has its
// body buffered or parsed. Health checks pass without the token (probes).
struct TokenProcessorState {
  std::string expected;  // "Bearer <token>"
};

void ProcessTokenMetadata(void* state, grpc_auth_context* /*context*/, const grpc_metadata* md,
                          size_t num_md, grpc_process_auth_metadata_done_cb done,
                          void* user_data) {
  const std::string& expected = static_cast<const TokenProcessorState*>(state)->expected;
  bool allowed = false;
  for (size_t i = 0; i < num_md && !allowed; ++i) {
    const absl::string_view key = View(md[i].key);
    if (key == "authorization") {
      allowed = ConstantTimeEquals(View(md[i].value), expected);
    } else if (key == ":path") {
      allowed = absl::StartsWith(View(md[i].value), "/grpc.health.v1.Health/");
    }
  }
  if (allowed) {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
  } else {
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, kNoTokenMessage);
  }
}

void DestroyTokenProcessor(void* state) { delete static_cast<TokenProcessorState*>(state); }

// C++ ServerCredentials over gRPC core's, because grpc::InsecureServerCredentials() cannot take
// a metadata processor (it asserts); core's insecure credentials can.
class CoreServerCredentials final : public grpc::ServerCredentials {
 public:
  // Takes ownership of `credentials`.
  explicit CoreServerCredentials(grpc_server_credentials* credentials)
      : credentials_(credentials) {}
  ~CoreServerCredentials() override { grpc_server_credentials_release(credentials_); }
  CoreServerCredentials(const CoreServerCredentials&) = delete;
  CoreServerCredentials& operator=(const CoreServerCredentials&) = delete;

  // The token check is installed by MakeServerCredentials as a core processor; a C++ processor
  // would replace it, so a call is a programming error, not a silent no-op.
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {
    LOG(FATAL) << "MakeServerCredentials' credentials check the bearer token themselves; extend "
                  "ProcessTokenMetadata (common/security.cc) instead of adding a processor";
  }

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), credentials_);
  }

  grpc_server_credentials* const credentials_;
};

}  // namespace

absl::StatusOr<std::string> NewWorkerCredential() {
  unsigned char bytes[32];
  size_t filled = 0;
  while (filled < sizeof(bytes)) {
    const ssize_t got = getrandom(bytes + filled, sizeof(bytes) - filled, 0);
    if (got < 0) {
      if (errno == EINTR) continue;
      return absl::InternalError(absl::StrCat("getrandom: ", std::strerror(errno)));
    }
    filled += static_cast<size_t>(got);
  }
  return absl::BytesToHexString(
      absl::string_view(reinterpret_cast<const char*>(bytes), sizeof(bytes)));
}

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

std::string MetadataValue(const grpc::ServerContextBase* context, absl::string_view key) {
  if (context == nullptr) return std::string();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return std::string();
  return std::string(it->second.data(), it->second.size());
}

bool FromLoopback(const grpc::ServerContextBase* context) {
  if (context == nullptr) return true;
  const std::string peer = context->peer();
  return absl::StartsWith(peer, "ipv4:127.") || absl::StartsWith(peer, "ipv6:[::1]") ||
         absl::StartsWith(peer, "ipv6:%5B::1%5D") || absl::StartsWith(peer, "unix:");
}

absl::StatusOr<std::string> ReadBearerToken(const std::string& path) {
  absl::StatusOr<std::string> text = ReadBoundedFile(path, "token file");
  if (!text.ok()) {
    return absl::UnavailableError(
        absl::StrCat("cannot read the token file ", path, ": ", text.status().message()));
  }
  std::istringstream in(*text);
  std::string line;
  std::getline(in, line);
  const std::string token(absl::StripAsciiWhitespace(line));
  if (token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the token file ", path, " has no token on its first line"));
  }
  return token;
}

bool ServesTls(const SecurityConfig& security) {
  return security.has_tls() && !security.tls().cert_file().empty() &&
         !security.tls().key_file().empty();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(
    const SecurityConfig& security) {
  std::string token;
  if (!security.token_file().empty()) {
    auto read = ReadBearerToken(security.token_file());
    if (!read.ok()) return read.status();
    token = *std::move(read);
  }
  grpc_server_credentials* credentials = nullptr;
  if (!ServesTls(security)) {
    credentials = grpc_insecure_server_credentials_create();
  } else {
    const TlsConfig& tls = security.tls();
    auto key = ReadPem(tls.key_file(), "security.tls.key_file");
    if (!key.ok()) return key.status();
    auto cert = ReadPem(tls.cert_file(), "security.tls.cert_file");
    if (!cert.ok()) return cert.status();
    std::string ca;
    if (!tls.ca_file().empty()) {
      auto read = ReadPem(tls.ca_file(), "security.tls.ca_file");
      if (!read.ok()) return read.status();
      ca = *std::move(read);
    }
    grpc_ssl_pem_key_cert_pair pair = {key->c_str(), cert->c_str()};
    credentials = grpc_ssl_server_credentials_create_ex(
        ca.empty() ? nullptr : ca.c_str(), &pair, 1,
        tls.require_client_cert() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                  : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        nullptr);
    if (credentials == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(
          "security.tls: gRPC refused the certificate ", tls.cert_file(), " with the key ",
          tls.key_file()));
    }
  }
  if (!token.empty()) {
    grpc_auth_metadata_processor processor;
    processor.process = ProcessTokenMetadata;
    processor.destroy = DestroyTokenProcessor;
    processor.state = new TokenProcessorState{absl::StrCat("Bearer ", token)};
    grpc_server_credentials_set_auth_metadata_processor(credentials, processor);
  }
  return std::make_shared<CoreServerCredentials>(credentials);
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> MakeChannel(const std::string& address,
                                                           const SecurityConfig& security,
                                                           const grpc::ChannelArguments& args,
                                                           std::shared_ptr<const WorkerCredential> worker) {
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (security.has_tls()) {
    const TlsConfig& tls = security.tls();
    grpc::SslCredentialsOptions options;
    if (!tls.ca_file().empty()) {
      auto ca = ReadPem(tls.ca_file(), "security.tls.ca_file");
      if (!ca.ok()) return ca.status();
      options.pem_root_certs = *ca;
    }
    if (!tls.cert_file().empty()) {
      auto key = ReadPem(tls.key_file(), "security.tls.key_file");
      if (!key.ok()) return key.status();
      auto cert = ReadPem(tls.cert_file(), "security.tls.cert_file");
      if (!cert.ok()) return cert.status();
      options.pem_private_key = *key;
      options.pem_cert_chain = *cert;
    }
    credentials = grpc::SslCredentials(options);
  }
  std::string target = address;
  grpc::ChannelArguments channel_args = args;
  if (address.find(',') != std::string::npos) {
    absl::StatusOr<std::string> group = ChannelTarget(address);
    if (!group.ok()) return group.status();
    target = *std::move(group);
    AddFailoverChannelArgs(&channel_args);
    // The target lists addresses, not a host: the first member's host:port stands for the group
    // as the calls' authority and as the name the members' certificates are checked against.
    absl::StatusOr<std::vector<std::string>> members = ParseServerAddresses(address, "");
    if (!members.ok()) return members.status();
    channel_args.SetString(GRPC_ARG_DEFAULT_AUTHORITY, members->front());
  }
  if (security.token_file().empty() && worker == nullptr) {
    return grpc::CreateCustomChannel(target, credentials, channel_args);
  }
  std::string token;
  if (!security.token_file().empty()) {
    auto read = ReadBearerToken(security.token_file());
    if (!read.ok()) return read.status();
    token = *std::move(read);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<CallMetadataInterceptorFactory>(std::move(token), std::move(worker)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(
      target, credentials, channel_args, std::move(factories));
}

absl::StatusOr<TokenChecker> TokenChecker::FromConfig(const SecurityConfig& security) {
  if (security.token_file().empty()) return TokenChecker("");
  auto token = ReadBearerToken(security.token_file());
  if (!token.ok()) return token.status();
  return TokenChecker(*token);
}

absl::Status TokenChecker::Check(const grpc::ServerContextBase* context) const {
  if (token_.empty() || context == nullptr) return absl::OkStatus();
  const auto& metadata = context->client_metadata();
  const std::string expected = absl::StrCat("Bearer ", token_);
  for (auto it = metadata.find("authorization"); it != metadata.end() && it->first == "authorization";
       ++it) {
    if (ConstantTimeEquals(absl::string_view(it->second.data(), it->second.size()), expected)) {
      return absl::OkStatus();
    }
  }
  return absl::UnauthenticatedError(kNoTokenMessage);
}

}  // namespace rebound
