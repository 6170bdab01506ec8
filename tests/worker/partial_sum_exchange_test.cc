// PartialSumExchange (worker/partial_sum_exchange.h) between k = 3 spares in one process, each
// with its own WorkerPeer service (real gRPC on 127.0.0.1) and mailbox, every step's sends on
// the spare's one JobThread as the replay engine does: after N steps each spare holds, per step,
// exactly the sums every other spare published (the same result as computing them all in one
// place), inline and through shared memory, and each spare's sends ran on one thread.

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/clock.h"
#include "compute/backend_factory.h"
#include "grpcpp/grpcpp.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "testing/cluster/time_scale.h"
#include "worker/job_thread.h"
#include "worker/partial_sum_exchange.h"
#include "worker/peer_service.h"
#include "worker/replay_mailbox.h"

namespace rebound::worker {
namespace {

constexpr int kSpares = 3;
constexpr int kSteps = 12;
constexpr int64_t kFloats = 257;

// What spare `rank` computes for step `t`: its block's sums.
std::vector<float> SumsOf(int rank, int64_t t) {
  std::vector<float> sums(kFloats);
  for (int64_t j = 0; j < kFloats; ++j) sums[j] = 1000.0f * rank + t + 0.25f * j;
  return sums;
}

struct Peer {
  std::unique_ptr<ReplayMailbox> mailbox = std::make_unique<ReplayMailbox>(int64_t{64} << 20);
  std::unique_ptr<WorkerPeerService> service;
  std::unique_ptr<grpc::Server> server;
  std::string address;
};

void RunExchange(bool shared_memory) {
  const uint64_t task_id = shared_memory ? 41 : 40;
  std::vector<Peer> peers(kSpares);
  for (Peer& peer : peers) {
    peer.service = std::make_unique<WorkerPeerService>(peer.mailbox.get());
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.SetMaxReceiveMessageSize(kMaxPeerMessageBytes);
    builder.RegisterService(peer.service.get());
    peer.server = builder.BuildAndStart();
    REQUIRE(peer.server != nullptr);
    peer.address = absl::StrCat("127.0.0.1:", port);
    peer.mailbox->Open(task_id);
  }
  WorkerConfig config;
  // Every send and gather is bounded by it: under TSan (5-15x slower, beside other tests) 5 s
  // was once too short for a gather (a failed run of the default tier); scaled like the
  // integration tests' waits (testing/cluster/time_scale.h).
  config.set_rpc_deadline_ms(static_cast<int32_t>(testing::ScaledMs(5000)));
  config.set_replay_shared_memory(shared_memory);
  absl::Notification stop;

  // received[rank][t - 1][r]: the sums spare `rank` took from spare r for step t.
  std::vector<std::vector<std::vector<std::vector<float>>>> received(
      kSpares, std::vector<std::vector<std::vector<float>>>(
                   kSteps, std::vector<std::vector<float>>(kSpares)));
  std::vector<std::set<std::thread::id>> sent_on(kSpares);
  std::vector<absl::Status> results(kSpares);
  std::vector<std::thread> spares;
  for (int rank = 0; rank < kSpares; ++rank) {
    spares.emplace_back([&, rank] {
      results[rank] = [&]() -> absl::Status {
        RecoveryTask task;
        task.set_task_id(task_id);
        task.set_rank(rank);
        for (int r = 0; r < kSpares; ++r) {
          Neighbour* spare = task.add_spares();
          spare->set_incarnation(100 + r);
          spare->set_peer_address(peers[r].address);
        }
        absl::StatusOr<std::unique_ptr<compute::Backend>> backend =
            compute::CreateBackend(ComputeConfig());
        if (!backend.ok()) return backend.status();
        PartialSumExchange exchange(config, task, peers[rank].mailbox.get(), stop,
                                    DefaultClock(), kFloats);
        JobThread sender;
        const std::vector<int64_t> active = {kFloats};
        for (int64_t t = 1; t <= kSteps; ++t) {
          const bool first = t == 1;
          const std::vector<float> mine = SumsOf(rank, t);
          const std::vector<compute::ConstDSpan> sums = {
              compute::ConstDSpan(mine.data(), kFloats)};
          PartialSum message;
          message.set_task_id(task_id);
          message.set_step(t);
          message.set_rank(rank);
          absl::Status published =
              exchange.Publish(backend->get(), sums, active, first, &message);
          if (!published.ok()) return published;
          sender.Start([&] {
            sent_on[rank].insert(std::this_thread::get_id());
            return exchange.SendToOthers(message, first);
          });
          absl::StatusOr<std::vector<PartialSum>> gathered = exchange.GatherOthers(t, first);
          absl::Status sent = sender.Wait();
          if (!sent.ok()) return sent;
          if (!gathered.ok()) return gathered.status();
          for (const PartialSum& partial : *gathered) {
            std::vector<float>& out = received[rank][t - 1][partial.rank()];
            if (partial.has_sums()) {
              absl::Status checked = CheckSums(partial.sums(), active, "sums");
              if (!checked.ok()) return checked;
              const std::string& bytes = partial.sums().tensors(0).data();
              out.resize(bytes.size() / sizeof(float));
              std::memcpy(out.data(), bytes.data(), bytes.size());
            } else {
              absl::StatusOr<std::vector<absl::Span<const float>>> shared =
                  exchange.RegionSums(partial, active);
              if (!shared.ok()) return shared.status();
              out.assign((*shared)[0].begin(), (*shared)[0].end());
            }
          }
        }
        return absl::OkStatus();
      }();
    });
  }
  for (std::thread& spare : spares) spare.join();
  for (int rank = 0; rank < kSpares; ++rank) {
    INFO("spare " << rank << ": " << results[rank]);
    REQUIRE(results[rank].ok());
    CHECK(sent_on[rank].size() == 1);  // one sender thread for every step
    for (int64_t t = 1; t <= kSteps; ++t) {
      for (int r = 0; r < kSpares; ++r) {
        if (r == rank) continue;
        INFO("step " << t << " from spare " << r);
        CHECK(received[rank][t - 1][r] == SumsOf(r, t));
      }
    }
  }
  for (Peer& peer : peers) {
    peer.mailbox->Close();
    peer.server->Shutdown();
  }
}

TEST_CASE("three spares exchange every step's sums inline, each sending on one thread") {
  RunExchange(/*shared_memory=*/false);
}

TEST_CASE("three spares exchange every step's sums through shared memory after the first") {
  RunExchange(/*shared_memory=*/true);
}

}  // namespace
}  // namespace rebound::worker
