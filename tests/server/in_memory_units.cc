#include "tests/server/in_memory_units.h"

#include <catch2/catch.hpp>

#include <utility>

#include "absl/strings/str_cat.h"
#include "tests/server/server_testing.h"

namespace rebound::server::testing {

InMemoryUnits::InMemoryUnits(const JobConfig& job_config) : job(job_config) {
  config.set_max_wait_ms(0);
  *config.mutable_job() = job;
  store = OpenInMemoryStore(job);
  auto created = CenterTable::Create(job);
  REQUIRE(created.ok());
  centers = *std::move(created);
  membership = std::make_unique<Membership>(job, &clock, StorePersist(store.get()));
  step_log = std::make_unique<StepLogService>(
      job, membership.get(), store.get(),
      [this](const SlotId& slot) { return books.StepLogFloor(slot); });
  retention = std::make_unique<LogRetention>(job, membership.get(), store.get(), &books);
  coordinator = std::make_unique<RecoveryCoordinator>(Recovery());
}

RecoveryUnits InMemoryUnits::Recovery() {
  RecoveryUnits units;
  units.config = &config;
  units.membership = membership.get();
  units.centers = centers.get();
  units.tracker = &tracker;
  units.store = store.get();
  units.step_log = step_log.get();
  units.books = &books;
  units.retention = retention.get();
  units.clock = &clock;
  return units;
}

RegisterResponse InMemoryUnits::Register(const std::string& name, WorkerRole role) {
  auto registered = membership->Register(Request(name, role, absl::StrCat(name, ":1")));
  REQUIRE(registered.ok());
  return *registered;
}

}  // namespace rebound::server::testing
