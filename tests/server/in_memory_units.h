#pragma once

// The units the server's life and its service make (server/server_life.cc, server/service.cc),
// in memory, for the tests of the units that work on all of them (the RecoveryCoordinator, the
// UpdateApplier): a Membership on a FakeClock persisting into an in-memory DurableStore, a
// CenterTable, a ReliabilityTracker, SlotBooks, the step log, LogRetention and a
// RecoveryCoordinator over them. ServerConfig.max_wait_ms is 0 (no barrier or turn waits).
//
// Thread-safety: as the units are; the constructor and Register use Catch2's REQUIRE, so they
// run on the test case's thread. Ownership: owns every unit; Recovery() borrows them.

#include <memory>
#include <string>

#include "common/clock.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/center_table.h"
#include "server/log_retention.h"
#include "server/membership.h"
#include "server/recovery_coordinator.h"
#include "server/reliability.h"
#include "server/slot_books.h"
#include "server/step_log.h"
#include "storage/durable_store.h"

namespace rebound::server::testing {

struct InMemoryUnits {
  // REQUIREs that the store and the center table open.
  explicit InMemoryUnits(const JobConfig& job_config);

  // The units, as the coordinator and the applier take them.
  RecoveryUnits Recovery();

  // Registers `name` (peer address name:1) in `role`; REQUIREs that it is granted.
  RegisterResponse Register(const std::string& name, WorkerRole role);

  JobConfig job;
  ServerConfig config;
  FakeClock clock;
  std::unique_ptr<storage::DurableStore> store;
  std::unique_ptr<CenterTable> centers;
  ReliabilityTracker tracker{job.weighting(), job.topology().replicas()};
  std::unique_ptr<Membership> membership;
  SlotBooks books{job};
  std::unique_ptr<StepLogService> step_log;
  std::unique_ptr<LogRetention> retention;
  std::unique_ptr<RecoveryCoordinator> coordinator;
};

}  // namespace rebound::server::testing
