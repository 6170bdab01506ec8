#include "common/security.h"

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
#include "common/config.h"
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

std::string MetadataValue(const grpc::ServerContext* context, absl::string_view key) {
  if (context == nullptr) return std::string();
  const auto& metadata = context->client_metadata();
  auto it = metadata.find(grpc::string_ref(key.data(), key.size()));
  if (it == metadata.end()) return std::string();
  return std::string(it->second.data(), it->second.size());
}

bool FromLoopback(const grpc::ServerContext* context) {
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
  if (!ServesTls(security)) return grpc::InsecureServerCredentials();
  const TlsConfig& tls = security.tls();
  grpc::SslServerCredentialsOptions options(
      tls.require_client_cert() ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  auto key = ReadPem(tls.key_file(), "security.tls.key_file");
  if (!key.ok()) return key.status();
  auto cert = ReadPem(tls.cert_file(), "security.tls.cert_file");
  if (!cert.ok()) return cert.status();
  pair.private_key = *key;
  pair.cert_chain = *cert;
  options.pem_key_cert_pairs.push_back(pair);
  if (!tls.ca_file().empty()) {
    auto ca = ReadPem(tls.ca_file(), "security.tls.ca_file");
    if (!ca.ok()) return ca.status();
    options.pem_root_certs = *ca;
  }
  return grpc::SslServerCredentials(options);
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
  if (security.token_file().empty() && worker == nullptr) {
    return grpc::CreateCustomChannel(address, credentials, args);
  }
  std::string token;
  if (!security.token_file().empty()) {
    auto read = ReadBearerToken(security.token_file());
    if (!read.ok()) return read.status();
    token = *std::move(read);
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<CallMetadataInterceptorFactory>(std::move(token), std::move(worker)));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

absl::StatusOr<TokenChecker> TokenChecker::FromConfig(const SecurityConfig& security) {
  if (security.token_file().empty()) return TokenChecker("");
  auto token = ReadBearerToken(security.token_file());
  if (!token.ok()) return token.status();
  return TokenChecker(*token);
}

absl::Status TokenChecker::Check(const grpc::ServerContext* context) const {
  if (token_.empty() || context == nullptr) return absl::OkStatus();
  const auto& metadata = context->client_metadata();
  const std::string expected = absl::StrCat("Bearer ", token_);
  for (auto it = metadata.find("authorization"); it != metadata.end() && it->first == "authorization";
       ++it) {
    if (ConstantTimeEquals(absl::string_view(it->second.data(), it->second.size()), expected)) {
      return absl::OkStatus();
    }
  }
  return absl::UnauthenticatedError(
      "this server requires a bearer token (authorization: Bearer <token>); the call has none "
      "or another one");
}

}  // namespace rebound
