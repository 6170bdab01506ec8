#include <catch2/catch.hpp>

#include "server/reliability.h"

#include <cmath>
#include <string>
#include <vector>

namespace rebound::server {
namespace {

WeightingConfig Dynamic() {
  WeightingConfig config;
  config.set_policy(DYNAMIC);  // lambda 1, min_weight 0.05, half-life 60 s, increment 0.5
  return config;
}

SlotId Slot(int replica) {
  SlotId slot;
  slot.set_replica(replica);
  slot.set_stage(0);
  return slot;
}

absl::Time At(double seconds) { return absl::UnixEpoch() + absl::Seconds(seconds); }

TEST_CASE("a first sync is neutral: all inputs 1 and weight 1") {
  ReliabilityTracker tracker(Dynamic(), 3);
  WeightInputs w = tracker.OnSync(Slot(0), At(0), 0, 2.0);
  CHECK(w.staleness() == 1.0);
  CHECK(w.lateness() == 1.0);
  CHECK(w.divergence() == 1.0);
  CHECK(w.fault_score() == 0.0);
  CHECK(w.weight() == 1.0);
}

TEST_CASE("trainers at the same pace keep weight 1") {
  ReliabilityTracker tracker(Dynamic(), 3);
  int64_t version = 0;
  WeightInputs w;
  for (int round = 0; round < 5; ++round) {
    for (int r = 0; r < 3; ++r) {
      w = tracker.OnSync(Slot(r), At(round * 1.0 + r * 0.01), version++, 1.0);
      if (round >= 1) {
        CHECK(w.staleness() == Approx(1.0));  // two updates by the two others, / (R - 1)
        CHECK(w.lateness() == Approx(1.0));
        CHECK(w.divergence() == Approx(1.0));
        CHECK(w.weight() == Approx(1.0));
      }
    }
  }
}

TEST_CASE("a straggler is down-weighted by its staleness and lateness") {
  ReliabilityTracker tracker(Dynamic(), 3);
  // Round 0 at t = 0: versions 0, 1, 2. Slot 2's next version baseline is 3.
  tracker.OnSync(Slot(0), At(0), 0, 1.0);
  tracker.OnSync(Slot(1), At(0), 1, 1.0);
  tracker.OnSync(Slot(2), At(0), 2, 1.0);
  // Slots 0 and 1 sync every second for four rounds: versions 3..10.
  int64_t version = 3;
  for (int t = 1; t <= 4; ++t) {
    tracker.OnSync(Slot(0), At(t), version++, 1.0);
    tracker.OnSync(Slot(1), At(t), version++, 1.0);
  }
  // Slot 2 comes back at t = 4 with version 11: 8 updates by others / (R - 1) = 4.
  // Its interval is 4 s; live intervals are {1, 1, 4} s, median 1 s: lateness 4.
  WeightInputs w = tracker.OnSync(Slot(2), At(4), 11, 1.0);
  CHECK(w.staleness() == Approx(4.0));
  CHECK(w.lateness() == Approx(4.0));
  CHECK(w.divergence() == Approx(1.0));
  // w = 1 / (1 + 1 * (4 - 1)) = 0.25
  CHECK(w.weight() == Approx(0.25));
}

TEST_CASE("a divergent trainer is down-weighted by its distance to the center") {
  ReliabilityTracker tracker(Dynamic(), 3);
  tracker.OnSync(Slot(0), At(0), 0, 1.0);
  tracker.OnSync(Slot(1), At(0), 1, 1.0);
  // ||x - c|| = 3 against latest norms {1, 1, 3}: median 1, divergence 3, w = 1 / 3.
  WeightInputs w = tracker.OnSync(Slot(2), At(0), 2, 3.0);
  CHECK(w.divergence() == Approx(3.0));
  CHECK(w.weight() == Approx(1.0 / 3.0));
}

TEST_CASE("the fault score rises per fault, caps at 1 and halves every half-life") {
  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.SetOwner(Slot(0), "w0");
  tracker.OnFault("w0", At(0));
  CHECK(tracker.Current(Slot(0), At(0)).fault_score() == Approx(0.5));
  CHECK(tracker.Current(Slot(0), At(0)).weight() == Approx(0.5));
  CHECK(tracker.Current(Slot(0), At(60)).fault_score() == Approx(0.25));
  CHECK(tracker.Current(Slot(0), At(60)).weight() == Approx(0.75));
  tracker.OnFault("w0", At(60));  // 0.25 + 0.5
  CHECK(tracker.Current(Slot(0), At(60)).fault_score() == Approx(0.75));
  tracker.OnFault("w0", At(60));  // capped
  CHECK(tracker.Current(Slot(0), At(60)).fault_score() == Approx(1.0));
  // (1 - 1) / 1 = 0, clamped to min_weight.
  CHECK(tracker.Current(Slot(0), At(60)).weight() == Approx(0.05));
  // The sync's own weight uses the decayed score.
  WeightInputs w = tracker.OnSync(Slot(0), At(120), 0, 1.0);
  CHECK(w.fault_score() == Approx(0.5));
  CHECK(w.weight() == Approx(0.5));
}

TEST_CASE("UNIFORM measures the inputs but always weighs 1") {
  WeightingConfig config;
  config.set_policy(UNIFORM);
  ReliabilityTracker tracker(config, 3);
  tracker.OnSync(Slot(0), At(0), 0, 1.0);
  tracker.OnSync(Slot(1), At(0), 1, 1.0);
  tracker.SetOwner(Slot(2), "w2");
  tracker.OnFault("w2", At(0));
  WeightInputs w = tracker.OnSync(Slot(2), At(0), 2, 10.0);
  CHECK(w.divergence() == Approx(10.0));
  CHECK(w.fault_score() == Approx(0.5));
  CHECK(w.weight() == 1.0);
}

TEST_CASE("dead slots leave the medians") {
  ReliabilityTracker tracker(Dynamic(), 3);
  tracker.OnSync(Slot(0), At(0), 0, 10.0);
  tracker.OnSync(Slot(1), At(0), 1, 1.0);
  tracker.SetLive(Slot(0), false);
  // Latest norms of live slots {1, 2}: median 1.5, divergence 2 / 1.5.
  WeightInputs w = tracker.OnSync(Slot(2), At(0), 2, 2.0);
  CHECK(w.divergence() == Approx(2.0 / 1.5));
}

TEST_CASE("a pipeline's stages are judged against the same stage of the other replicas") {
  // Two replicas x two stages at one pace; stage 1's parameters are 100 times farther from its
  // center than stage 0's (another shape, another scale). Medians over every slot would make
  // stage 1 look divergent (100 / 50.5) and stage 0 close; per stage both are at 1.
  ReliabilityTracker tracker(Dynamic(), 2);
  auto slot = [](int r, int s) {
    SlotId id;
    id.set_replica(r);
    id.set_stage(s);
    return id;
  };
  int64_t version[2] = {0, 0};
  WeightInputs w[2][2];
  for (int round = 0; round < 4; ++round) {
    for (int r = 0; r < 2; ++r) {
      for (int s = 0; s < 2; ++s) {
        w[r][s] = tracker.OnSync(slot(r, s), At(round * 1.0 + r * 0.01 + s * 0.001),
                                 version[s]++, s == 0 ? 1.0 : 100.0);
      }
    }
  }
  for (int r = 0; r < 2; ++r) {
    for (int s = 0; s < 2; ++s) {
      INFO("slot (" << r << ", " << s << ")");
      CHECK(w[r][s].divergence() == Approx(1.0));
      CHECK(w[r][s].lateness() == Approx(1.0).epsilon(0.05));
      CHECK(w[r][s].weight() == Approx(1.0).epsilon(0.05));
    }
  }
  // A divergent stage-1 slot is judged against stage 1 only: 300 / median(100, 300) = 1.5.
  const WeightInputs divergent = tracker.OnSync(slot(0, 1), At(4.0), version[1]++, 300.0);
  CHECK(divergent.divergence() == Approx(300.0 / 200.0));
}

TEST_CASE("weights and fault scores survive export and import") {
  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.OnSync(Slot(0), At(0), 0, 1.0);
  tracker.SetOwner(Slot(1), "w1");
  tracker.OnFault("w1", At(10));
  auto records = tracker.Export(At(10));
  REQUIRE(records.size() == 2);

  ReliabilityTracker restored(Dynamic(), 2);
  for (const WeightRecord& r : records) restored.Import(r);
  CHECK(restored.Current(Slot(1), At(70)).fault_score() == Approx(0.25));  // its owner's
  CHECK(restored.FaultScore("w1", At(70)) == Approx(0.25));
  // Slot 0's baseline version survived: 3 updates by the other since version 1.
  WeightInputs w = restored.OnSync(Slot(0), At(1), 4, 1.0);
  CHECK(w.staleness() == Approx(3.0));
}

TEST_CASE("Measure changes nothing, and Measure then Record is exactly OnSync") {
  ReliabilityTracker split(Dynamic(), 3);
  ReliabilityTracker whole(Dynamic(), 3);
  // The same history in both; in `split` every sync goes through Measure + Record, and a third
  // measurement is taken and dropped (a refused sync) before each.
  int64_t version = 0;
  for (int round = 0; round < 4; ++round) {
    for (int r = 0; r < 3; ++r) {
      const absl::Time now = At(round * 1.0 + r * 0.3);
      const double norm = 1.0 + 0.5 * r + 0.1 * round;
      split.Measure(Slot(r), now, version, 1e30);  // dropped: leaves no trace
      const WeightInputs measured = split.Measure(Slot(r), now, version, norm);
      split.Record(Slot(r), now, version, norm, measured);
      const WeightInputs expected = whole.OnSync(Slot(r), now, version, norm);
      CHECK(measured.SerializeAsString() == expected.SerializeAsString());
      ++version;
    }
  }
  for (int r = 0; r < 3; ++r) {
    CHECK(split.ExportSlot(Slot(r), At(9)).SerializeAsString() ==
          whole.ExportSlot(Slot(r), At(9)).SerializeAsString());
  }
}

TEST_CASE("the peer divergence median leaves the sender and dead trainers out") {
  ReliabilityTracker tracker(Dynamic(), 4);
  CHECK_FALSE(tracker.PeerDivergenceMedian(Slot(0)).has_value());  // nobody measured yet
  tracker.OnSync(Slot(0), At(0), 0, 1000.0);
  CHECK_FALSE(tracker.PeerDivergenceMedian(Slot(0)).has_value());  // only itself
  CHECK(*tracker.PeerDivergenceMedian(Slot(1)) == 1000.0);
  tracker.OnSync(Slot(1), At(0), 1, 2.0);
  tracker.OnSync(Slot(2), At(0), 2, 4.0);
  // Slot 0's own huge measurement does not raise its reference: the median of 2 and 4.
  CHECK(*tracker.PeerDivergenceMedian(Slot(0)) == 3.0);
  CHECK(*tracker.PeerDivergenceMedian(Slot(3)) == 4.0);  // of 1000, 2 and 4
  tracker.SetLive(Slot(0), false);
  CHECK(*tracker.PeerDivergenceMedian(Slot(3)) == 3.0);
  // Another stage's trainers never count.
  SlotId other;
  other.set_replica(0);
  other.set_stage(1);
  CHECK_FALSE(tracker.PeerDivergenceMedian(other).has_value());
}


// Fault scores follow workers (docs/design.md §4.5, issue R11).

TEST_CASE("a fault score follows the worker's name across slots, and a slot uses its owner's") {
  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.SetOwner(Slot(0), "alice");
  tracker.SetOwner(Slot(1), "bob");
  tracker.OnFault("alice", At(0));
  CHECK(tracker.Current(Slot(0), At(0)).fault_score() == Approx(0.5));
  CHECK(tracker.Current(Slot(1), At(0)).fault_score() == 0.0);
  // alice fails, a spare "carol" takes her slot over: the slot weighs carol's score (none);
  // alice registers again and gets slot 1: her score comes with her.
  tracker.SetOwner(Slot(0), "carol");
  tracker.SetOwner(Slot(1), "alice");
  CHECK(tracker.Current(Slot(0), At(0)).fault_score() == 0.0);
  CHECK(tracker.Current(Slot(0), At(0)).weight() == 1.0);
  CHECK(tracker.Current(Slot(1), At(60)).fault_score() == Approx(0.25));  // decayed per name
  CHECK(tracker.Current(Slot(1), At(60)).weight() == Approx(0.75));
  CHECK(tracker.FaultScore("alice", At(120)) == Approx(0.125));
  CHECK(tracker.FaultScore("bob", At(0)) == 0.0);
  CHECK(tracker.FaultScore("nobody", At(0)) == 0.0);
  tracker.OnFault("", At(0));  // no name: nobody is charged
  CHECK(tracker.FaultScores(At(0)).size() == 1);
}

TEST_CASE("a new owner's first sync is neutral: the slot's sync history starts afresh") {
  ReliabilityTracker tracker(Dynamic(), 3);
  tracker.OnSync(Slot(0), At(0), 0, 1.0);
  tracker.OnSync(Slot(1), At(0), 1, 1.0);
  tracker.OnSync(Slot(2), At(0), 2, 1.0);
  tracker.OnSync(Slot(1), At(1), 3, 1.0);
  tracker.OnSync(Slot(2), At(1), 4, 1.0);
  // Slot 0's trainer is lost; a spare takes it over 20 s and 40 versions later. Under the old
  // owner this sync would have had staleness 20 and lateness 20.
  tracker.SetOwner(Slot(0), "spare");
  const WeightInputs w = tracker.OnSync(Slot(0), At(20), 44, 1.0);
  CHECK(w.staleness() == 1.0);
  CHECK(w.lateness() == 1.0);
  CHECK(w.weight() == 1.0);
}

TEST_CASE("staleness is smoothed with the configured half-life; h = 0 uses it raw") {
  // Slot 0 syncs alone at t = 0..4 (lateness and divergence stay 1); the versions it reports
  // make its raw staleness 3, 1, 0, 5 at t = 1..4 ((version - previous version - 1) / (R - 1)).
  const int64_t versions[] = {0, 7, 10, 11, 22};
  auto run = [&](double half_life) {
    WeightingConfig config = Dynamic();
    config.set_input_smoothing_half_life_syncs(half_life);
    ReliabilityTracker tracker(config, 3);
    std::vector<WeightInputs> out;
    for (int t = 0; t < 5; ++t) out.push_back(tracker.OnSync(Slot(0), At(t), versions[t], 1.0));
    return out;
  };
  // h = 1: alpha = 1/2. The first measurement initializes: 3; then 3 + (1 - 3)/2 = 2,
  // 2 + (0 - 2)/2 = 1, 1 + (5 - 1)/2 = 3.
  const std::vector<WeightInputs> smoothed = run(1.0);
  const double expected[] = {1.0, 3.0, 2.0, 1.0, 3.0};
  for (int t = 0; t < 5; ++t) {
    INFO("t = " << t);
    CHECK(smoothed[t].staleness() == Approx(expected[t]));
    CHECK(smoothed[t].lateness() == Approx(1.0));
    CHECK(smoothed[t].weight() == Approx(1.0 / expected[t]));  // 1 / (1 + (s - 1))
  }
  // h = 3 (the default): alpha = 1 - 2^(-1/3) = 0.2063; 3, then 3 - 2 alpha = 2.5874.
  const std::vector<WeightInputs> by_default = run(3.0);
  CHECK(by_default[1].staleness() == Approx(3.0));
  CHECK(by_default[2].staleness() == Approx(3.0 - 2.0 * (1.0 - std::exp2(-1.0 / 3.0))));
  // h = 0: raw.
  const std::vector<WeightInputs> raw = run(0.0);
  const double raw_expected[] = {1.0, 3.0, 1.0, 0.0, 5.0};
  for (int t = 0; t < 5; ++t) CHECK(raw[t].staleness() == Approx(raw_expected[t]));
  CHECK(raw[4].weight() == Approx(0.2));
}

TEST_CASE("lateness is smoothed; divergence is used as measured") {
  WeightingConfig config = Dynamic();
  config.set_input_smoothing_half_life_syncs(1.0);  // alpha = 1/2
  ReliabilityTracker tracker(config, 3);
  // Slots 1 and 2 sync every second (interval 1 s); slot 0 at t = 0, 2, 3, 7: intervals 2, 1,
  // 4 s against a median of 1 s. The versions make every raw staleness 1.
  int64_t version = 0;
  int64_t slot0_next = 0;
  WeightInputs w;
  std::vector<WeightInputs> slot0;
  for (int t = 0; t <= 7; ++t) {
    for (int r : {1, 2}) tracker.OnSync(Slot(r), At(t), version++, 1.0);
    if (t == 0 || t == 2 || t == 3 || t == 7) {
      slot0.push_back(tracker.OnSync(Slot(0), At(t), slot0_next, t == 3 ? 5.0 : 1.0));
      slot0_next += 3;  // two updates by the others since: staleness (3 - 1) / 2 = 1
    }
  }
  REQUIRE(slot0.size() == 4);
  // Lateness: 2 (first: initializes), 2 + (1 - 2)/2 = 1.5, 1.5 + (4 - 1.5)/2 = 2.75.
  CHECK(slot0[1].lateness() == Approx(2.0));
  CHECK(slot0[2].lateness() == Approx(1.5));
  CHECK(slot0[3].lateness() == Approx(2.75));
  CHECK(slot0[1].staleness() == Approx(1.0));
  // The divergent sync at t = 3 (norm 5 against {1, 1, 5}) counts in full, and the next one
  // (norm 1) is back at 1 at once.
  CHECK(slot0[2].divergence() == Approx(5.0));
  CHECK(slot0[2].weight() == Approx(1.0 / 5.0));
  CHECK(slot0[3].divergence() == Approx(1.0));
  CHECK(slot0[3].weight() == Approx(1.0 / 2.75));
}

TEST_CASE("worker scores travel in every weight record; a restart keeps the newest per name") {
  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.SetOwner(Slot(0), "a");
  tracker.SetOwner(Slot(1), "b");
  tracker.OnFault("spare", At(0));  // a worker that owns no slot
  const WeightRecord older = tracker.ExportSlot(Slot(1), At(0));
  tracker.OnFault("a", At(10));
  const WeightRecord newer = tracker.ExportSlot(Slot(0), At(10));
  CHECK(newer.faults_by_worker());
  CHECK(newer.owner_name() == "a");
  CHECK(newer.fault_score() == Approx(0.5));
  CHECK(newer.worker_faults_size() == 2);

  ReliabilityTracker restored(Dynamic(), 2);
  CHECK(restored.Import(newer).empty());
  CHECK(restored.Import(older).empty());  // older entries do not overwrite newer ones
  CHECK(restored.FaultScore("a", At(10)) == Approx(0.5));
  CHECK(restored.FaultScore("spare", At(60)) == Approx(0.25));
  CHECK(restored.Current(Slot(0), At(10)).fault_score() == Approx(0.5));
  CHECK(restored.Current(Slot(1), At(10)).fault_score() == 0.0);
}

TEST_CASE("an old-form weight record gives its slot's fault score to the slot's stored owner") {
  WeightRecord old_form;  // written before scores followed workers: no faults_by_worker
  old_form.mutable_slot()->set_replica(1);
  old_form.mutable_slot()->set_stage(0);
  old_form.set_fault_score(0.5);
  old_form.set_fault_updated_unix_ms(0);
  old_form.set_last_sync_unix_ms(0);
  old_form.set_center_version_at_last_sync(5);

  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.SetOwner(Slot(1), "owner-1");  // from the stored membership (server/main.cc)
  const std::string note = tracker.Import(old_form);
  CHECK(note.find("now belongs to its owner 'owner-1'") != std::string::npos);
  CHECK(tracker.FaultScore("owner-1", At(60)) == Approx(0.25));
  CHECK(tracker.Current(Slot(1), At(60)).fault_score() == Approx(0.25));

  ReliabilityTracker no_owner(Dynamic(), 2);
  const std::string dropped = no_owner.Import(old_form);
  CHECK(dropped.find("is dropped") != std::string::npos);
  CHECK(no_owner.FaultScores(At(0)).empty());
  CHECK(no_owner.Current(Slot(1), At(0)).fault_score() == 0.0);
}

TEST_CASE("the table of worker scores is bounded and forgets decayed names") {
  ReliabilityTracker tracker(Dynamic(), 2);
  tracker.SetOwner(Slot(0), "owner");
  tracker.OnFault("owner", At(0));
  for (size_t i = 0; i < ReliabilityTracker::kMaxWorkers + 50; ++i) {
    tracker.OnFault("w" + std::to_string(i), At(0));
  }
  CHECK(tracker.FaultScores(At(0)).size() == ReliabilityTracker::kMaxWorkers);
  CHECK(tracker.FaultScore("owner", At(0)) == Approx(0.5));  // an owner is never dropped
  // Fifteen half-lives later every score is below kForgetBelow: the next fault prunes the names
  // that own no slot.
  tracker.OnFault("late", At(15 * 60));
  const auto left = tracker.FaultScores(At(15 * 60));
  REQUIRE(left.size() == 2);
  CHECK(left[0].first == "late");
  CHECK(left[1].first == "owner");
}

}  // namespace
}  // namespace rebound::server
