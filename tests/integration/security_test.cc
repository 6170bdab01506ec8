// Security (docs/operations.md#security) against the real binaries: a server with mutual TLS and
// a bearer token, workers with a certificate and the token (which also secure their WorkerPeer
// service: a parallel replay runs over it), and reboundctl refused without each of them. The
// certificates are made with openssl at test time: a CA, the server's (127.0.0.1) and one for
// the workers, which serves as their client certificate and as their WorkerPeer server's.

#include <catch2/catch.hpp>
#include <signal.h>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/rebound.grpc.pb.h"
#include "tests/integration/local_cluster.h"
#include "tests/integration/status_util.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

// Makes ca.pem, server.{pem,key}, worker.{pem,key} and token in `dir`.
void MakeCredentials(const std::string& dir) {
  const std::string script = absl::StrCat(
      "set -e; cd '", dir, "'; ",
      "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 1 "
      "  -subj /CN=rebound-test-ca 2>/dev/null; ",
      "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\n' > san.ext; ",
      "for who in server worker; do ",
      "  openssl req -newkey rsa:2048 -nodes -keyout $who.key -out $who.csr -subj /CN=$who "
      "    2>/dev/null; ",
      "  openssl x509 -req -in $who.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $who.pem "
      "    -days 1 -extfile san.ext 2>/dev/null; ",
      "done; ",
      "printf 's3cr3t-token\\n' > token; printf 'wrong-token\\n' > wrong");
  std::string output;
  INFO(output);
  REQUIRE(RunCommand({"/bin/bash", "-c", script}, &output, absl::Seconds(60)) == 0);
}

std::string Security(const std::string& dir, const std::string& who, bool require_client_cert) {
  return absl::StrCat("security {\n  token_file: \"", dir, "/token\"\n  tls {\n    cert_file: \"",
                      dir, "/", who, ".pem\"\n    key_file: \"", dir, "/", who,
                      ".key\"\n    ca_file: \"", dir, "/ca.pem\"\n    require_client_cert: ",
                      require_client_cert ? "true" : "false", "\n  }\n}\n");
}

int Ctl(const std::string& address, const std::vector<std::string>& flags, const char* command,
        std::string* output) {
  std::vector<std::string> argv = {Runfile("tools/reboundctl"), "--server", address};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(command);
  return RunCommand(argv, output, absl::Seconds(30));
}

TEST_CASE("with mutual TLS and a token the job trains and replays; calls without either are "
          "refused") {
  const std::string dir = MakeTempDir("security-certs");
  MakeCredentials(dir);
  LocalClusterOptions options{"security"};
  options.server_config_extra = Security(dir, "server", /*require_client_cert=*/true);
  options.worker_config_extra = Security(dir, "worker", /*require_client_cert=*/true);
  options.client_security.set_token_file(dir + "/token");
  options.client_security.mutable_tls()->set_ca_file(dir + "/ca.pem");
  options.client_security.mutable_tls()->set_cert_file(dir + "/worker.pem");
  options.client_security.mutable_tls()->set_key_file(dir + "/worker.key");
  LocalCluster cluster(
      "  job_id: \"sec\"\n"
      "  model { layers { width: 64 } layers { width: 10 activation: IDENTITY } }\n"
      "  topology { replicas: 2 }\n"
      "  weighting { policy: UNIFORM }\n"
      "  fault_tolerance { heartbeat_interval_ms: 200 failure_timeout_ms: 1500 "
      "recovery_parallelism: 2 }\n"
      "  data { batch_size: 64 micro_batches: 4 train_limit: 2000 test_limit: 100 }\n"
      "  easgd { sync_period: 300 }\n"
      "  step_log { linger_ms: 10 }\n"
      "  training { max_steps: 900 }\n",
      options);
  // Both spares wait first. b dies once the server holds the log of step 340, 40 steps past
  // its snapshot (its sync of step 300), and the two spares replay them over their TLS
  // WorkerPeer services, with the token. (A kill from outside once a status showed 30 logged
  // steps raced b's next sync: on a fast run b had synced step 600 when the kill landed, and
  // nothing was left to replay.)
  cluster.StartWorker("s1", SPARE);
  cluster.StartWorker("s2", SPARE);
  cluster.WaitFor("both spares wait for a task", [](const GetStatusResponse& s) {
    int waiting = 0;
    for (const WorkerStatus& w : s.workers()) waiting += w.waiting_for_task();
    return waiting == 2;
  });
  cluster.StartWorker("a", TRAINER);
  cluster.ExpectExit("b");
  cluster.StartWorker("b", TRAINER, "", {"--fault_die_after_logged_step=340"});
  CHECK(cluster.ExitCode("b", absl::Seconds(60)) == 128 + SIGKILL);
  const GetStatusResponse done = cluster.WaitFor("job finished", AllFinished);
  INFO(done.DebugString());
  REQUIRE(done.recoveries_size() == 1);
  CHECK(done.recoveries(0).outcome() == RECOVERED);
  CHECK(done.recoveries(0).spares_size() == 2);
  CHECK(done.recoveries(0).steps_replayed() == 40);
  CHECK(done.recoveries(0).detail() == "rebuilt to step 340 from the snapshot at step 300");
  CHECK(done.recoveries(0).verified());
  INFO(cluster.Logs());
  CHECK(cluster.ExitCode("a") == 0);

  const std::string address = cluster.address();
  const std::vector<std::string> tls = {"--ca_file", dir + "/ca.pem", "--cert_file",
                                        dir + "/worker.pem", "--key_file", dir + "/worker.key"};
  std::string out;
  // Everything right: served.
  std::vector<std::string> all = tls;
  all.insert(all.end(), {"--token_file", dir + "/token"});
  CHECK(Ctl(address, all, "status", &out) == 0);
  CHECK(absl::StrContains(out, "job sec"));
  // No token, or another one: UNAUTHENTICATED (exit 1, saying why).
  CHECK(Ctl(address, tls, "status", &out) == 1);
  CHECK(absl::StrContains(out, "requires a bearer token"));
  std::vector<std::string> wrong = tls;
  wrong.insert(wrong.end(), {"--token_file", dir + "/wrong"});
  CHECK(Ctl(address, wrong, "recoveries", &out) == 1);
  CHECK(absl::StrContains(out, "requires a bearer token"));
  // The health service needs no token, so probes work.
  CHECK(Ctl(address, tls, "health", &out) == 0);
  CHECK(out == "SERVING\n");
  // Plaintext, or TLS without a client certificate: no connection at all (exit 2).
  {
    const int plaintext = Ctl(address, {"--token_file", dir + "/token", "--timeout_ms", "2000"},
                              "status", &out);
    INFO("reboundctl said: " << out);
    CHECK(plaintext == 2);
  }
  {
    const int no_client_cert = Ctl(address,
                                   {"--ca_file", dir + "/ca.pem", "--token_file", dir + "/token",
                                    "--timeout_ms", "2000"},
                                   "status", &out);
    INFO("reboundctl said: " << out);
    CHECK(no_client_cert == 2);
  }
}

}  // namespace
}  // namespace rebound::testing
