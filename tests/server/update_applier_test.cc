// UpdateApplier (server/apply/update_applier.h) against the real units in memory (a Membership
// on a fake clock, an in-memory DurableStore, a CenterTable, the step log, SlotBooks,
// LogRetention and the RecoveryCoordinator), without gRPC: what a sync, push or sharded commit
// changes in the center, the store and the books, and what a retry, a stale or skipping update,
// a fenced sender and a malformed update change (nothing).

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/config.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/apply/update_applier.h"
#include "server/center_table.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/recovery_coordinator.h"
#include "server/reliability.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"
#include "tests/server/in_memory_units.h"
#include "tests/server/server_testing.h"

namespace rebound::server::apply {
namespace {

// 2 replicas x 1 stage, tau = 2, max_steps = 16; `easgd` adds to its easgd section, `more` to
// the job.
JobConfig Job(const std::string& more = "", const std::string& easgd = "") {
  return testing::TinyModelJob(2, 1,
                               absl::StrCat("easgd { sync_period: 2 ", easgd, " }\n"
                                            "training { max_steps: 16 }\n"
                                            "fault_tolerance { policy: REPLAY "
                                            "heartbeat_interval_ms: 100 failure_timeout_ms: 1000 }\n",
                                            more));
}

// The units the service gives its applier, in memory (tests/server/in_memory_units.h).
struct Units : testing::InMemoryUnits {
  explicit Units(const JobConfig& job_config)
      : InMemoryUnits(job_config),
        applier(std::make_unique<UpdateApplier>(ApplierUnits{Recovery(), coordinator.get()})) {}

  RegisterResponse Register(const std::string& name) {
    return InMemoryUnits::Register(name, TRAINER);
  }

  std::vector<float> Center() const {
    auto read = centers->Read(0);
    REQUIRE(read.ok());
    return read->first;
  }

  // Parameters of the stage's layout, every value `value`.
  TensorBundle Params(float value) const {
    return centers->Bundle(0, std::vector<float>(centers->StageParameters(0), value));
  }

  SyncRequest MakeSync(const RegisterResponse& from, int64_t step, float value) const {
    SyncRequest request;
    request.set_incarnation(from.incarnation());
    *request.mutable_slot() = from.slot();
    request.set_step(step);
    *request.mutable_params() = Params(value);
    return request;
  }

  std::unique_ptr<UpdateApplier> applier;
};

TEST_CASE("a sync moves the center, is stored as the slot's snapshot and books the step") {
  Units u(Job());
  const RegisterResponse a = u.Register("a");
  const std::vector<float> before = u.Center();
  SyncResponse reply;
  REQUIRE(u.applier->Sync(a.slot(), u.MakeSync(a, 2, 1.0f), &reply).ok());
  CHECK(reply.center_version() == 1);
  CHECK(reply.has_center_before());
  CHECK(reply.weight() > 0.0);
  const double alpha = reply.moving_rate();
  REQUIRE(alpha > 0.0);
  // c <- c + alpha * w * (x - c), elementwise: every value moved towards 1.
  const std::vector<float> after = u.Center();
  REQUIRE(after.size() == before.size());
  for (size_t i = 0; i < after.size(); ++i) {
    CHECK(after[i] == Approx(before[i] + alpha * reply.weight() * (1.0f - before[i])));
  }
  const SlotBook book = u.books.Get(a.slot());
  CHECK(book.last_update_step == 2);
  CHECK(book.update_count == 1);
  auto snapshot = u.store->ReadSnapshot(a.slot());
  REQUIRE(snapshot.ok());
  CHECK(snapshot->step() == 2);
  auto stored = u.store->LoadAll();
  REQUIRE(stored.ok());
  CHECK(stored->centers.at(0).version() == 1);
  CHECK(stored->weights.at({0, 0}).last_update_step() == 2);
}

TEST_CASE("a retried sync is answered from the stored state; a stale, a jump or a fenced "
          "sender's sync changes nothing") {
  Units u(Job());
  const RegisterResponse a = u.Register("a");
  const RegisterResponse b = u.Register("b");
  SyncResponse first;
  REQUIRE(u.applier->Sync(a.slot(), u.MakeSync(a, 2, 1.0f), &first).ok());
  REQUIRE(u.applier->Sync(a.slot(), u.MakeSync(a, 4, 2.0f), &first).ok());
  const std::vector<float> center = u.Center();

  // The retry, even with other parameters: the stored post-sync state, no center_before.
  SyncResponse again;
  REQUIRE(u.applier->Sync(a.slot(), u.MakeSync(a, 4, 7.0f), &again).ok());
  CHECK_FALSE(again.has_center_before());
  CHECK(again.center_version() == 2);
  auto snapshot = u.store->ReadSnapshot(a.slot());
  REQUIRE(snapshot.ok());
  CHECK(again.worker_params_after().SerializeAsString() ==
        snapshot->params().SerializeAsString());
  CHECK(u.Center() == center);

  const absl::Status stale = u.applier->Sync(a.slot(), u.MakeSync(a, 2, 1.0f), &again);
  CHECK(stale.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(stale.message() == "stale sync: slot (0, 0) already synced step 4, got step 2");
  const absl::Status jump = u.applier->Sync(a.slot(), u.MakeSync(a, 8, 1.0f), &again);
  CHECK(jump.code() == absl::StatusCode::kInvalidArgument);
  CHECK(u.books.Refused(a.slot()) == 0);  // a step rule is not a fault of the worker

  REQUIRE(u.membership->Deregister(b.incarnation()).ok());
  SyncResponse fenced;
  CHECK(u.applier->Sync(b.slot(), u.MakeSync(b, 2, 1.0f), &fenced).code() ==
        absl::StatusCode::kFailedPrecondition);
  CHECK(u.Center() == center);
  CHECK(u.books.Get(a.slot()).update_count == 2);
  CHECK(u.books.Get(b.slot()).update_count == 0);
}

TEST_CASE("a sync with non-finite parameters or a malformed optimizer state is refused and "
          "charged to its worker") {
  Units u(Job());
  const RegisterResponse a = u.Register("a");
  const std::vector<float> center = u.Center();
  SyncRequest nan = u.MakeSync(a, 2, std::numeric_limits<float>::quiet_NaN());
  SyncResponse reply;
  CHECK(u.applier->Sync(a.slot(), nan, &reply).code() == absl::StatusCode::kInvalidArgument);
  CHECK(u.books.Refused(a.slot()) == 1);
  SyncRequest bad_state = u.MakeSync(a, 2, 1.0f);
  bad_state.mutable_optimizer()->mutable_m()->add_tensors();  // not the layout
  CHECK(u.applier->Sync(a.slot(), bad_state, &reply).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(u.books.Refused(a.slot()) == 2);
  CHECK(u.Center() == center);
  CHECK(u.books.Get(a.slot()).update_count == 0);
  CHECK(u.store->ReadSnapshot(a.slot()).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("a push is applied at the next sequence, answered again at or below it, refused "
          "when it skips ahead") {
  Units u(Job("", "mode: ASYNC_ADAHESSIAN"));
  const RegisterResponse a = u.Register("a");
  auto push = [&](uint64_t sequence) {
    PushRequest request;
    request.set_incarnation(a.incarnation());
    *request.mutable_slot() = a.slot();
    request.set_sequence(sequence);
    request.set_step(static_cast<int64_t>(sequence));
    *request.mutable_gradient() = u.Params(0.5f);
    *request.mutable_hessian_diag() = u.Params(1.0f);
    return request;
  };
  const std::vector<float> before = u.Center();
  PushResponse reply;
  REQUIRE(u.applier->Push(a.slot(), push(1), &reply).ok());
  CHECK(reply.applied());
  CHECK(reply.applied_sequence() == 1);
  CHECK(reply.center_version() == 1);
  const std::vector<float> after = u.Center();
  CHECK(after != before);
  REQUIRE(u.applier->Push(a.slot(), push(1), &reply).ok());
  CHECK_FALSE(reply.applied());
  CHECK(reply.applied_sequence() == 1);
  const absl::Status ahead = u.applier->Push(a.slot(), push(3), &reply);
  CHECK(ahead.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(ahead.message() == "push sequence 3 of slot (0, 0) skips ahead: the next one is 2");
  CHECK(u.Center() == after);
  const SlotBook book = u.books.Get(a.slot());
  CHECK(book.applied_sequence == 1);
  CHECK(book.update_count == 1);
  auto stored = u.store->LoadAll();
  REQUIRE(stored.ok());
  CHECK(stored->weights.at({0, 0}).applied_sequence() == 1);
}

TEST_CASE("group 0 commits a sharded sync only when every range holds it, once") {
  Units u(Job("sharding { groups: 2 }\n"));
  const RegisterResponse a = u.Register("a");
  auto commit = [&](int64_t step, double partial) {
    CommitSyncRequest request;
    request.set_incarnation(a.incarnation());
    *request.mutable_slot() = a.slot();
    request.set_step(step);
    for (int k = 0; k < 2; ++k) {
      RangeSyncResult* range = request.add_ranges();
      range->set_range(k);
      range->set_center_version(step / 2);
      range->set_partial_sq_norm(partial);
    }
    return request;
  };
  std::vector<int64_t> asked;
  absl::Status ranges_hold = absl::UnavailableError("range 1 has not applied it");
  const RangeSyncCheck check = [&](const SlotId&, int64_t step) {
    asked.push_back(step);
    return ranges_hold;
  };
  CommitSyncResponse reply;
  CHECK(u.applier->CommitSync(a.slot(), commit(2, 1.0), check, &reply).code() ==
        absl::StatusCode::kUnavailable);
  CHECK(asked == std::vector<int64_t>{2});
  CHECK(u.books.Get(a.slot()).last_update_step == 0);

  ranges_hold = absl::OkStatus();
  REQUIRE(u.applier->CommitSync(a.slot(), commit(2, 1.0), check, &reply).ok());
  CHECK_FALSE(reply.duplicate());
  CHECK(reply.weight() == 1.0);  // the first sync's weight
  const double next_weight = reply.next_weight();
  CHECK(next_weight > 0.0);
  CHECK(u.books.Get(a.slot()).last_update_step == 2);
  CHECK(u.books.Get(a.slot()).next_weight == next_weight);
  auto snapshot = u.store->ReadSnapshot(a.slot());
  REQUIRE(snapshot.ok());
  CHECK(snapshot->step() == 2);

  CommitSyncResponse again;
  REQUIRE(u.applier->CommitSync(a.slot(), commit(2, 1.0), check, &again).ok());
  CHECK(again.duplicate());
  CHECK(again.next_weight() == next_weight);
  CHECK(u.books.Get(a.slot()).update_count == 1);

  // The range results are checked before anything is asked or recorded.
  CommitSyncRequest bad = commit(4, std::nan(""));
  CHECK(u.applier->CommitSync(a.slot(), bad, check, &reply).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(asked.size() == 3);
  // A range group's authorization: the next sync point, with the weight group 0 decided.
  auto weight = u.applier->AuthorizeRangeSync(a.slot(), a.incarnation(), 4);
  REQUIRE(weight.ok());
  CHECK(*weight == next_weight);
  CHECK(u.applier->AuthorizeRangeSync(a.slot(), a.incarnation(), 6).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound::server::apply
