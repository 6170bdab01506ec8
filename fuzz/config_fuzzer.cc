// Fuzz target: the config loaders and validators (common/config.h). Every input is parsed as a
// job, a server and a worker config (protobuf text format).
//
// The server and worker configs name files (job_file, security.token_file, the TLS files) that
// the loaders open and read. Relative names resolve against a directory this fuzzer makes, with a
// valid job.pbtxt and a token file in it; an input naming any file elsewhere (a '/' in the name,
// so also "../x") is not given to those two loaders, so that the fuzzer never reads devices or
// big files outside its directory. The job loader reads no files and gets every input.
//
// Properties, beyond "no crash, no sanitizer report, no leak":
//   * a rejected config is INVALID_ARGUMENT (NOT_FOUND for a server's missing job_file) with a
//     message;
//   * an accepted job passes ValidateJobConfig too, its stage split (StageLayerStarts) runs from
//     0 to the layer count in increasing steps, its moving rate is in (0, 1], and printed as text
//     it is accepted again;
//   * an accepted server config holds its job inline (job_file cleared), itself a valid job.

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/config.h"
#include "fuzz/fuzz_check.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "proto/config.pb.h"

namespace rebound::fuzz {
namespace {

constexpr char kJob[] = R"(job_id: "fuzz"
model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }
topology { replicas: 2 stages: 2 }
data { batch_size: 4 micro_batches: 2 }
)";

// The directory relative file names resolve against: job.pbtxt and token.
const std::string& BaseDir() {
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/rebound-config-fuzz-XXXXXX";
    FUZZ_CHECK(mkdtemp(pattern.data()) != nullptr);
    std::ofstream(pattern + "/job.pbtxt") << kJob;
    std::ofstream(pattern + "/token") << "fuzz-token\n";
    return new std::string(pattern);
  }();
  return *dir;
}

void RemoveBaseDir() {
  unlink((BaseDir() + "/job.pbtxt").c_str());
  unlink((BaseDir() + "/token").c_str());
  rmdir(BaseDir().c_str());
}

class SilentErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int, google::protobuf::io::ColumnNumber, const std::string&) override {}
};

// True iff every file `security` names stays in the base directory.
bool LocalFiles(const SecurityConfig& security) {
  for (const std::string* name : {&security.token_file(), &security.tls().cert_file(),
                                  &security.tls().key_file(), &security.tls().ca_file()}) {
    if (name->find('/') != std::string::npos) return false;
  }
  return true;
}

// Parses `text` as the loaders will (without their checks) to see which files it names. A text
// that does not parse here does not parse in the loader either, which then reads no file.
template <typename Config>
bool ParsesWithForeignFiles(const std::string& text,
                            bool (*local)(const Config& config)) {
  Config config;
  SilentErrors errors;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text, &config)) return false;
  return !local(config);
}

bool ServerFilesLocal(const ServerConfig& config) {
  return config.job_file().find('/') == std::string::npos && LocalFiles(config.security());
}

bool WorkerFilesLocal(const WorkerConfig& config) { return LocalFiles(config.security()); }

void CheckRejected(const absl::Status& status, bool may_be_not_found) {
  FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument ||
             (may_be_not_found && status.code() == absl::StatusCode::kNotFound));
  FUZZ_CHECK(!status.message().empty());
}

void CheckJob(const JobConfig& job) {
  FUZZ_CHECK(ValidateJobConfig(job).ok());
  const std::vector<int> starts = StageLayerStarts(job);
  FUZZ_CHECK(static_cast<int>(starts.size()) == job.topology().stages() + 1);
  FUZZ_CHECK(starts.front() == 0 && starts.back() == job.model().layers_size());
  for (size_t i = 1; i < starts.size(); ++i) FUZZ_CHECK(starts[i] > starts[i - 1]);
  const double alpha = EffectiveMovingRate(job);
  FUZZ_CHECK(alpha > 0.0 && alpha <= 1.0);
  std::string printed;
  FUZZ_CHECK(google::protobuf::TextFormat::PrintToString(job, &printed));
  absl::StatusOr<JobConfig> again = ParseJobConfig(printed, "printed.pbtxt");
  if (!again.ok()) std::fprintf(stderr, "%s\n", again.status().ToString().c_str());
  FUZZ_CHECK(again.ok());
}

}  // namespace
}  // namespace rebound::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rebound::fuzz::QuietLogging();
  rebound::fuzz::BaseDir();
  std::atexit(rebound::fuzz::RemoveBaseDir);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace rebound;
  using namespace rebound::fuzz;
  const std::string text(reinterpret_cast<const char*>(data), size);

  absl::StatusOr<JobConfig> job = ParseJobConfig(text, "job.pbtxt");
  if (job.ok()) {
    CheckJob(*job);
  } else {
    CheckRejected(job.status(), /*may_be_not_found=*/false);
  }

  if (!ParsesWithForeignFiles<ServerConfig>(text, ServerFilesLocal)) {
    absl::StatusOr<ServerConfig> server = ParseServerConfig(text, "server.pbtxt", BaseDir());
    if (server.ok()) {
      FUZZ_CHECK(server->has_job() && !server->has_job_file());
      CheckJob(server->job());
    } else {
      CheckRejected(server.status(), /*may_be_not_found=*/true);
    }
  }

  if (!ParsesWithForeignFiles<WorkerConfig>(text, WorkerFilesLocal)) {
    absl::StatusOr<WorkerConfig> worker = ParseWorkerConfig(text, "worker.pbtxt", BaseDir());
    if (!worker.ok()) CheckRejected(worker.status(), /*may_be_not_found=*/false);
  }
  return 0;
}
