// UpdateRules (server/apply/update_rules.h): the rules every update of a slot passes, checked
// without a server: step bounds, the next sync point, duplicates and stale syncs, push
// sequences, optimizer state, the divergence bound and the books after an update.

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "server/apply/update_rules.h"
#include "tests/server/server_testing.h"

namespace rebound::server::apply {
namespace {

using testing::Slot;

// tau = 8, max_steps = 84 (not a multiple of tau: the last sync point is max_steps itself).
JobConfig Job(double max_divergence_ratio = 0.0) {
  return testing::TinyModelJob(
      2, 1,
      absl::StrCat("easgd { sync_period: 8 }\ntraining { max_steps: 84 }\n",
                   max_divergence_ratio > 0
                       ? absl::StrCat("weighting { max_divergence_ratio: ",
                                      max_divergence_ratio, " }\n")
                       : std::string()));
}

TensorBundle Bundle(int tensors) {
  TensorBundle bundle;
  for (int i = 0; i < tensors; ++i) bundle.add_tensors();
  return bundle;
}

TEST_CASE("a step outside [1, max_steps] is INVALID_ARGUMENT for syncs and pushes") {
  const UpdateRules rules(Job());
  CHECK(rules.CheckSyncStep(1).ok());
  CHECK(rules.CheckSyncStep(84).ok());
  for (int64_t step : {int64_t{0}, int64_t{-8}, std::numeric_limits<int64_t>::min()}) {
    const absl::Status status = rules.CheckSyncStep(step);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(status.message()) == absl::StrCat("step must be >= 1, got ", step));
  }
  for (int64_t step : {int64_t{85}, std::numeric_limits<int64_t>::max()}) {
    const absl::Status status = rules.CheckSyncStep(step);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(status.message()) ==
          absl::StrCat("step must be <= training.max_steps = 84, got ", step));
  }
  CHECK(rules.CheckPushStep(1, 1).ok());
  CHECK(rules.CheckPushStep(0, 1).message() == "sequence and step must be >= 1");
  CHECK(rules.CheckPushStep(1, 0).message() == "sequence and step must be >= 1");
  CHECK(rules.CheckPushStep(1, 85).code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a sync is applied only at the slot's next sync point; its last step again is a "
          "duplicate and an older one stale") {
  const UpdateRules rules(Job());
  const SlotId slot = Slot(1);
  CHECK(*rules.DecideSync(slot, 0, 8) == Verdict::kApply);
  CHECK(*rules.DecideSync(slot, 72, 80) == Verdict::kApply);
  // max_steps is a sync point of its own, even off the period.
  CHECK(*rules.DecideSync(slot, 80, 84) == Verdict::kApply);
  CHECK(*rules.DecideSync(slot, 16, 16) == Verdict::kDuplicate);
  CHECK(*rules.DecideSync(slot, 16, 8) == Verdict::kStale);
  CHECK(*rules.DecideSync(slot, 16, 1) == Verdict::kStale);
  // A jump past the next sync point, or a step off the period.
  for (int64_t step : {int64_t{32}, int64_t{84}, int64_t{20}, int64_t{17}}) {
    const absl::StatusOr<Verdict> verdict = rules.DecideSync(slot, 16, step, " in range 2");
    REQUIRE_FALSE(verdict.ok());
    CHECK(verdict.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(verdict.status().message()) ==
          absl::StrCat("step must be the slot's next sync point: a multiple of "
                       "easgd.sync_period = 8 (or training.max_steps = 84) at most 24 (slot (1, "
                       "0) last synced step 16 in range 2), got ",
                       step));
  }
  const absl::Status stale = UpdateRules::StaleSync(slot, 16, 8);
  CHECK(stale.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(stale.message() == "stale sync: slot (1, 0) already synced step 16, got step 8");
}

TEST_CASE("a push is applied at the next sequence, answered again at or below the applied one, "
          "and refused when it skips ahead") {
  const SlotId slot = Slot(0);
  CHECK(*UpdateRules::DecidePush(slot, 0, 1) == Verdict::kApply);
  CHECK(*UpdateRules::DecidePush(slot, 5, 6) == Verdict::kApply);
  CHECK(*UpdateRules::DecidePush(slot, 5, 5) == Verdict::kDuplicate);
  CHECK(*UpdateRules::DecidePush(slot, 5, 1) == Verdict::kDuplicate);
  const absl::StatusOr<Verdict> ahead = UpdateRules::DecidePush(slot, 1, 3);
  REQUIRE_FALSE(ahead.ok());
  CHECK(ahead.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(ahead.status().message() == "push sequence 3 of slot (0, 0) skips ahead: the next one is 2");
}

TEST_CASE("optimizer state: any subset for an unsharded sync, all three parts or none for a "
          "range") {
  // The check stands in for CenterTable::ValidateBundle: a bundle matches the layout when it
  // holds 2 tensors.
  std::vector<std::string> checked;
  const BundleCheck check = [&](const TensorBundle& bundle, const char* name) {
    checked.push_back(name);
    if (bundle.tensors_size() == 2) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(name, " has ", bundle.tensors_size()));
  };
  OptimizerState none;
  CHECK(UpdateRules::CarriesNoState(none));
  CHECK(UpdateRules::CheckOptimizerState(none, StateParts::kAllOrNone, check).ok());
  CHECK(UpdateRules::CheckOptimizerState(none, StateParts::kAnySubset, check).ok());
  CHECK(checked.empty());

  OptimizerState adam;  // m and v, no last_hdiag
  *adam.mutable_m() = Bundle(2);
  *adam.mutable_v() = Bundle(2);
  CHECK_FALSE(UpdateRules::CarriesNoState(adam));
  CHECK(UpdateRules::CheckOptimizerState(adam, StateParts::kAnySubset, check).ok());
  CHECK(checked == std::vector<std::string>{"optimizer.m", "optimizer.v"});
  checked.clear();
  const absl::Status partial = UpdateRules::CheckOptimizerState(adam, StateParts::kAllOrNone, check);
  CHECK(partial.code() == absl::StatusCode::kInvalidArgument);
  CHECK(partial.message() == "optimizer.last_hdiag has 0");

  OptimizerState bad = adam;
  *bad.mutable_v() = Bundle(3);
  const absl::Status malformed = UpdateRules::CheckOptimizerState(bad, StateParts::kAnySubset, check);
  CHECK(malformed.message() == "optimizer.v has 3");
}

TEST_CASE("an update beyond max_divergence_ratio times its peers' median is INVALID_ARGUMENT") {
  const SlotId slot = Slot(1);
  const UpdateRules bounded(Job(4.0));
  // No peer measured yet: nothing to compare with.
  CHECK(*bounded.DivergenceRatio(slot, 1e30, std::nullopt, "||x - c||") == 0.0);
  CHECK(*bounded.DivergenceRatio(slot, 6.0, 2.0, "||x - c||") == 3.0);
  CHECK(*bounded.DivergenceRatio(slot, 8.0, 2.0, "||x - c||") == 4.0);  // at the bound
  const absl::StatusOr<double> beyond = bounded.DivergenceRatio(slot, 10.0, 2.0, "||g||");
  REQUIRE_FALSE(beyond.ok());
  CHECK(beyond.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(beyond.status().message()) ==
        "refused: slot (1, 0) sent ||g|| = 10, 5 times the median of the stage's other live "
        "trainers (2); the bound is weighting.max_divergence_ratio = 4; nothing was changed");
  // A ratio that is not a number (0 / 0) never passes a bound.
  CHECK_FALSE(bounded.DivergenceRatio(slot, 0.0, 0.0, "||x - c||").ok());
  // Without a bound every ratio passes and is reported.
  const UpdateRules unbounded(Job());
  CHECK(*unbounded.DivergenceRatio(slot, 10.0, 2.0, "||g||") == 5.0);
}

TEST_CASE("the books after an update: the step, one more update, the push's sequence") {
  SlotBook book;
  book.last_update_step = 8;
  book.update_count = 3;
  book.applied_sequence = 7;
  book.log_floor = 8;
  book.next_weight = 0.5;
  const SlotBook synced = UpdateRules::AfterSync(book, 16);
  CHECK(synced.last_update_step == 16);
  CHECK(synced.update_count == 4);
  CHECK(synced.applied_sequence == 7);
  CHECK(synced.log_floor == 8);  // the floor is the commit's (LogRetention), not the rules'
  CHECK(synced.next_weight == 0.5);
  const SlotBook pushed = UpdateRules::AfterPush(book, 8, 9);
  CHECK(pushed.applied_sequence == 8);
  CHECK(pushed.last_update_step == 9);
  CHECK(pushed.update_count == 4);
}

}  // namespace
}  // namespace rebound::server::apply
