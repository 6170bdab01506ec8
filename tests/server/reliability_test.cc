#include <catch2/catch.hpp>

#include "server/reliability.h"

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
  tracker.OnFault(Slot(0), At(0));
  CHECK(tracker.Current(Slot(0), At(0)).fault_score() == Approx(0.5));
  CHECK(tracker.Current(Slot(0), At(0)).weight() == Approx(0.5));
  CHECK(tracker.Current(Slot(0), At(60)).fault_score() == Approx(0.25));
  CHECK(tracker.Current(Slot(0), At(60)).weight() == Approx(0.75));
  tracker.OnFault(Slot(0), At(60));  // 0.25 + 0.5
  CHECK(tracker.Current(Slot(0), At(60)).fault_score() == Approx(0.75));
  tracker.OnFault(Slot(0), At(60));  // capped
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
  tracker.OnFault(Slot(2), At(0));
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
  tracker.OnFault(Slot(1), At(10));
  auto records = tracker.Export(At(10));
  REQUIRE(records.size() == 2);

  ReliabilityTracker restored(Dynamic(), 2);
  for (const WeightRecord& r : records) restored.Import(r);
  CHECK(restored.Current(Slot(1), At(70)).fault_score() == Approx(0.25));
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

}  // namespace
}  // namespace rebound::server
