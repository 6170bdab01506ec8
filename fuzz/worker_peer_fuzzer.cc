// Fuzz target: a worker's WorkerPeer service (worker/replay_mailbox.h): SendPartialSum with
// arbitrary messages, interleaved with the replay loop's Open, Close and TakePartial, against a
// fresh ReplayMailbox per input.
//
// Input: a fuzz.PeerSession (fuzz/sessions.proto) in protobuf binary, up to kMaxCalls calls.
// The same-host transport needs a region another spare made: the fuzzer makes one at start-up
// (task 1, rank 1, kRegionFloats floats per slot, every float 0; step 1's slot header written)
// and a shm_name of "@region" is replaced by its name, so messages can offer and reference it.
//
// Properties, beyond "no crash, no sanitizer report, no leak":
//   * every status has a canonical code;
//   * the mailbox never holds more than its bound, and nothing once closed;
//   * TakePartial hands out the (step, rank) it was asked for;
//   * shm_mapped is acknowledged only to a message that offered a region holding, at its
//     offset, exactly the message's inline sums.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "fuzz/fuzz_check.h"
#include "fuzz/sessions.pb.h"
#include "grpcpp/server_context.h"
#include "proto/rebound.pb.h"
#include "worker/peer_service.h"
#include "worker/replay_mailbox.h"
#include "worker/shared_sums.h"

namespace rebound::fuzz {
namespace {

using worker::ReplayMailbox;
using worker::SharedSumsWriter;
using worker::WorkerPeerService;

constexpr int kMaxCalls = 64;
constexpr int64_t kMailboxBytes = 1 << 20;
// 64 header bytes + 496 floats = 2048 bytes a slot: the region is exactly one 4 KiB page, so
// step 1's slot (the second) ends where the mapping ends.
constexpr int64_t kRegionFloats = 496;
constexpr char kRegionPlaceholder[] = "@region";

// The region of "another spare" on this host, or null without shared memory. Unlinked at exit;
// what a crashed run leaves is swept by the next.
SharedSumsWriter* Region() {
  static const std::unique_ptr<SharedSumsWriter> region = []() -> std::unique_ptr<SharedSumsWriter> {
    worker::SweepStaleRegions();
    auto created = SharedSumsWriter::Create(/*task_id=*/1, /*rank=*/1, kRegionFloats);
    if (!created.ok()) {
      std::fprintf(stderr, "no shared memory here (%s): messages naming @region are declined\n",
                   created.status().ToString().c_str());
      return nullptr;
    }
    (*created)->Begin(/*step=*/1, kRegionFloats);  // zeros: the region starts zero-filled
    return *std::move(created);
  }();
  return region.get();
}

// True iff `message` names the fuzzer's region and carries inline exactly what its slot holds:
// the only message a receiver may acknowledge shm_mapped.
bool HoldsRegionSlot(const PartialSum& message) {
  if (Region() == nullptr || message.shm_name() != Region()->name()) return false;
  std::string sums;
  for (const Tensor& tensor : message.sums().tensors()) sums += tensor.data();
  return message.task_id() == 1 && message.step() == 1 && message.rank() == 1 &&
         message.shm_offset() == Region()->SlotOffset(1) &&
         sums == std::string(kRegionFloats * sizeof(float), '\0');
}

void Run(const PeerCall& call, ReplayMailbox* mailbox, WorkerPeerService* service) {
  switch (call.call_case()) {
    case PeerCall::kSendPartialSum: {
      PartialSum request = call.send_partial_sum();
      if (request.shm_name() == kRegionPlaceholder && Region() != nullptr) {
        request.set_shm_name(Region()->name());
      }
      // The service takes the request's contents (it swaps them out): keep what was sent.
      const PartialSum sent = request;
      const bool offered = sent.has_shm_name() && sent.has_sums();
      grpc::ServerContext context;
      PartialSumAck response;
      const grpc::Status status = service->SendPartialSum(&context, &request, &response);
      FUZZ_CHECK(status.error_code() >= grpc::StatusCode::OK &&
                 status.error_code() <= grpc::StatusCode::UNAUTHENTICATED);
      if (response.shm_mapped()) {
        FUZZ_CHECK(status.ok() && offered);
        FUZZ_CHECK(HoldsRegionSlot(sent));
      }
      if (Verbose()) {
        std::fprintf(stderr, "send_partial_sum: %d %s%s\n", status.error_code(),
                     status.error_message().c_str(), response.shm_mapped() ? " (shm_mapped)" : "");
      }
      break;
    }
    case PeerCall::kOpenTask:
      mailbox->Open(call.open_task());
      break;
    case PeerCall::kClose:
      mailbox->Close();
      FUZZ_CHECK(mailbox->held_bytes() == 0);
      break;
    case PeerCall::kTakePartial: {
      const TakePartial& take = call.take_partial();
      absl::StatusOr<PartialSum> taken =
          mailbox->TakePartial(take.step(), take.rank(), absl::ZeroDuration());
      if (taken.ok()) FUZZ_CHECK(taken->step() == take.step() && taken->rank() == take.rank());
      if (Verbose()) std::fprintf(stderr, "take_partial: %s\n", taken.status().ToString().c_str());
      break;
    }
    case PeerCall::CALL_NOT_SET:
      break;
  }
  FUZZ_CHECK(mailbox->held_bytes() >= 0 && mailbox->held_bytes() <= kMailboxBytes);
}

}  // namespace
}  // namespace rebound::fuzz

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  rebound::fuzz::QuietLogging();
  rebound::fuzz::Region();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  rebound::fuzz::PeerSession session;
  if (!session.ParseFromArray(data, static_cast<int>(size))) return 0;
  rebound::worker::ReplayMailbox mailbox(rebound::fuzz::kMailboxBytes);
  rebound::worker::WorkerPeerService service(&mailbox);
  const int calls = std::min(session.calls_size(), rebound::fuzz::kMaxCalls);
  for (int i = 0; i < calls; ++i) rebound::fuzz::Run(session.calls(i), &mailbox, &service);
  return 0;
}
