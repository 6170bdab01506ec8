// What the launcher prints for successive GetStatus replies: detection, recovery and takeover
// must be visible as events, and progress as one compact line and CSV rows per poll.

#include "tools/launch/progress.h"

#include <catch2/catch.hpp>

#include <string>
#include <vector>

namespace rebound::launch {
namespace {

constexpr uint64_t kTrainer0 = 11;
constexpr uint64_t kTrainer1 = 12;
constexpr uint64_t kSpare = 13;
constexpr uint64_t kSpareAsTrainer = 14;

SlotStatus* AddSlot(GetStatusResponse* status, int r, int s, SlotState state, uint64_t owner,
                    int64_t step) {
  SlotStatus* slot = status->add_slots();
  slot->mutable_slot()->set_replica(r);
  slot->mutable_slot()->set_stage(s);
  slot->set_state(state);
  slot->set_owner_incarnation(owner);
  slot->set_step(step);
  return slot;
}

WorkerStatus* AddWorker(GetStatusResponse* status, uint64_t incarnation, const std::string& name,
                        WorkerRole role, WorkerState state, int64_t step, double loss) {
  WorkerStatus* w = status->add_workers();
  w->set_incarnation(incarnation);
  w->set_name(name);
  w->set_role(role);
  w->set_state(state);
  w->set_step(step);
  w->set_loss(loss);
  return w;
}

void SetSlot(WorkerStatus* w, int r, int s) {
  w->mutable_slot()->set_replica(r);
  w->mutable_slot()->set_stage(s);
}

std::vector<std::string> Texts(const std::vector<ProgressEvent>& events) {
  std::vector<std::string> texts;
  for (const ProgressEvent& e : events) texts.push_back(e.text);
  return texts;
}

// Two trainers on slots (0,0) and (1,0) and one spare, all alive, at `step`.
GetStatusResponse Running(int64_t step) {
  GetStatusResponse status;
  AddSlot(&status, 0, 0, ACTIVE, kTrainer0, step);
  AddSlot(&status, 1, 0, ACTIVE, kTrainer1, step);
  SetSlot(AddWorker(&status, kTrainer0, "trainer-r0s0", TRAINER, ALIVE, step, 0.5), 0, 0);
  SetSlot(AddWorker(&status, kTrainer1, "trainer-r1s0", TRAINER, ALIVE, step, 0.75), 1, 0);
  AddWorker(&status, kSpare, "spare-0", SPARE, ALIVE, 0, 0.0);
  return status;
}

TEST_CASE("the first reply announces every worker and every slot it finds owned") {
  ProgressTracker tracker;
  const std::vector<ProgressEvent> events = tracker.Update(Running(0));
  CHECK(Texts(events) == std::vector<std::string>{
                             "worker trainer-r0s0 registered: TRAINER of slot (0,0), incarnation 11",
                             "worker trainer-r1s0 registered: TRAINER of slot (1,0), incarnation 12",
                             "worker spare-0 registered: SPARE, incarnation 13",
                             "slot (0,0): UNASSIGNED -> ACTIVE (incarnation 11, trainer-r0s0)",
                             "slot (1,0): UNASSIGNED -> ACTIVE (incarnation 12, trainer-r1s0)",
                         });
  REQUIRE(events[0].slot.has_value());
  CHECK(*events[0].slot == SlotCoord{0, 0});
  CHECK_FALSE(events[2].slot.has_value());
  // The same reply again changes nothing.
  CHECK(tracker.Update(Running(0)).empty());
  CHECK(tracker.Update(Running(5)).empty());
}

TEST_CASE("detection, replay and takeover of a lost slot each print one line") {
  ProgressTracker tracker;
  tracker.Update(Running(40));

  // Detection: the trainer of (1,0) is declared FAILED, the slot LOST.
  GetStatusResponse lost;
  AddSlot(&lost, 0, 0, ACTIVE, kTrainer0, 41);
  AddSlot(&lost, 1, 0, LOST, 0, 40)->set_detail("owner incarnation 12 FAILED: no heartbeat");
  SetSlot(AddWorker(&lost, kTrainer0, "trainer-r0s0", TRAINER, ALIVE, 41, 0.5), 0, 0);
  WorkerStatus* dead = AddWorker(&lost, kTrainer1, "trainer-r1s0", TRAINER, FAILED, 40, 0.75);
  SetSlot(dead, 1, 0);
  dead->set_state_reason("no heartbeat for 1047 ms (failure_timeout 1000 ms)");
  AddWorker(&lost, kSpare, "spare-0", SPARE, ALIVE, 0, 0.0);
  CHECK(Texts(tracker.Update(lost)) ==
        std::vector<std::string>{
            "worker trainer-r1s0 (incarnation 12): ALIVE -> FAILED: no heartbeat for 1047 ms "
            "(failure_timeout 1000 ms)",
            "slot (1,0): ACTIVE -> LOST: owner incarnation 12 FAILED: no heartbeat",
        });
  // The lost slot keeps its last loss.
  CHECK(tracker.ProgressLine() == "0,0:41/0.5000/w=- 1,0:40/0.7500/w=-(LOST) acc=- recoveries=0");

  // Replay: a recovery task runs on the spare.
  GetStatusResponse recovering = lost;
  recovering.mutable_slots(1)->set_state(RECOVERING);
  recovering.mutable_slots(1)->clear_detail();
  RecoveryStatus* task = recovering.add_recoveries();
  task->set_task_id(1);
  task->mutable_slot()->set_replica(1);
  task->mutable_slot()->set_stage(0);
  task->set_policy(REPLAY);
  task->set_failed_step(40);
  task->add_spares(kSpare);
  CHECK(Texts(tracker.Update(recovering)) ==
        std::vector<std::string>{
            "slot (1,0): LOST -> RECOVERING",
            "recovery 1 of slot (1,0): RUNNING, policy REPLAY, failed at step 40, 0 steps "
            "replayed by [spare-0], verified no",
        });
  CHECK(tracker.recoveries() == 1);

  // Takeover: the spare's new incarnation owns the slot; the task reports its phases.
  GetStatusResponse taken = recovering;
  taken.mutable_slots(1)->set_state(ACTIVE);
  taken.mutable_slots(1)->set_owner_incarnation(kSpareAsTrainer);
  SetSlot(AddWorker(&taken, kSpareAsTrainer, "spare-0", TRAINER, ALIVE, 40, 0.625), 1, 0);
  RecoveryStatus* done = taken.mutable_recoveries(0);
  done->set_outcome(RECOVERED);
  done->set_steps_replayed(8);
  done->set_verified(true);
  done->mutable_phases()->set_detection_ms(1012);
  done->mutable_phases()->set_snapshot_transfer_ms(15);
  done->mutable_phases()->set_replay_ms(830);
  done->mutable_phases()->set_takeover_ms(20);
  taken.mutable_slots(1)->mutable_weight()->set_weight(0.25);
  CHECK(Texts(tracker.Update(taken)) ==
        std::vector<std::string>{
            "worker spare-0 registered: TRAINER of slot (1,0), incarnation 14",
            "slot (1,0): RECOVERING -> ACTIVE (incarnation 14, spare-0)",
            "recovery 1 of slot (1,0): RECOVERED, policy REPLAY, failed at step 40, 8 steps "
            "replayed by [spare-0], phases: detection 1012 ms, snapshot transfer 15 ms, replay "
            "830 ms, takeover 20 ms, verified yes",
        });
  CHECK(tracker.OwnerName({1, 0}) == "spare-0");
  CHECK(tracker.OwnerName({0, 0}) == "trainer-r0s0");
  CHECK(tracker.ProgressLine() ==
        "0,0:41/0.5000/w=- 1,0:40/0.6250/w=0.250 acc=- recoveries=1");
  CHECK(tracker.Update(taken).empty());
}

TEST_CASE("a worker's role or slot change is reported") {
  ProgressTracker tracker;
  tracker.Update(Running(3));
  GetStatusResponse promoted = Running(3);
  promoted.mutable_workers(2)->set_role(TRAINER);
  SetSlot(promoted.mutable_workers(2), 1, 0);
  CHECK(Texts(tracker.Update(promoted)) ==
        std::vector<std::string>{"worker spare-0 (incarnation 13): now TRAINER of slot (1,0)"});
}

TEST_CASE("the progress line shows step, loss, weight, accuracy and recoveries") {
  ProgressTracker tracker;
  GetStatusResponse status = Running(0);
  tracker.Update(status);
  // Before a first step a worker's loss means nothing.
  CHECK(tracker.ProgressLine() == "0,0:0/-/w=- 1,0:0/-/w=- acc=- recoveries=0");
  CHECK_FALSE(tracker.test_accuracy().has_value());

  status = Running(152);
  status.mutable_slots(0)->mutable_weight()->set_weight(0.91);
  status.mutable_slots(1)->mutable_weight()->set_weight(1.0);
  status.mutable_last_eval()->set_test_accuracy(0.8123);
  status.mutable_last_eval()->set_test_loss(0.52);
  tracker.Update(status);
  CHECK(tracker.ProgressLine() ==
        "0,0:152/0.5000/w=0.910 1,0:152/0.7500/w=1.000 acc=0.8123 recoveries=0");
  CHECK(tracker.test_accuracy() == 0.8123);
  CHECK(tracker.test_loss() == 0.52);
  CHECK(tracker.CsvRows(12.34) == std::vector<std::string>{"12.3,r0s0,152,0.5,0.91,0.8123,",
                                                           "12.3,r1s0,152,0.75,1,0.8123,"});
}

TEST_CASE("the job is finished only when every slot is FINISHED") {
  ProgressTracker tracker;
  CHECK_FALSE(tracker.AllFinished());  // no reply yet
  tracker.Update(Running(999));
  CHECK_FALSE(tracker.AllFinished());

  GetStatusResponse half = Running(1000);
  half.mutable_slots(0)->set_state(FINISHED);
  CHECK(Texts(tracker.Update(half)) ==
        std::vector<std::string>{
            "slot (0,0): ACTIVE -> FINISHED (incarnation 11, trainer-r0s0) at step 1000"});
  CHECK_FALSE(tracker.AllFinished());

  GetStatusResponse all = half;
  all.mutable_slots(1)->set_state(FINISHED);
  tracker.Update(all);
  CHECK(tracker.AllFinished());
  CHECK(tracker.ProgressLine() ==
        "0,0:1000/0.5000/w=-(FINISHED) 1,0:1000/0.7500/w=-(FINISHED) acc=- recoveries=0");
}

TEST_CASE("CSV event rows carry the slot's columns and a quoted event") {
  ProgressTracker tracker;
  tracker.Update(Running(7));
  CHECK(tracker.CsvEventRow(3.0, {SlotCoord{1, 0}, "killed trainer-r1s0 (pid 42) at step 7"}) ==
        "3.0,r1s0,7,0.75,,,killed trainer-r1s0 (pid 42) at step 7");
  CHECK(tracker.CsvEventRow(3.0, {std::nullopt, "worker spare-0 registered: SPARE, incarnation 13"}) ==
        "3.0,,,,,,\"worker spare-0 registered: SPARE, incarnation 13\"");
  CHECK(std::string(kCsvHeader) == "elapsed_s,slot,step,loss,weight,test_accuracy,event");
  CHECK(CsvField("plain") == "plain");
  CHECK(CsvField("say \"hi\", twice") == "\"say \"\"hi\"\", twice\"");
  CHECK(FormatSlot({2, 1}) == "(2,1)");
  CHECK(CsvSlot({2, 1}) == "r2s1");
}

}  // namespace
}  // namespace rebound::launch
