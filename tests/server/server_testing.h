#pragma once

// Test helpers shared by the tests of server/ (testonly): the small jobs they run, the requests
// and heartbeats of their workers, registering trainers, carrying out FLUSH_LOG, letting one
// trainer fall silent until the failure detector declares it failed, and the in-memory units
// (an in-memory DurableStore, a Membership persist function that writes to it).
//
// Thread-safety: the functions hold no state. Those that check what they get with Catch2's
// REQUIRE (ParseJob and every job, BeatOk, RegisterTrainers, FlushWhenAsked, FailOne,
// OpenInMemoryStore) fail the calling test case, so they must run on the test case's own thread
// (Catch2's assertions are not thread-safe); the message builders (Request, Beat, Flushed,
// Blocked, Slot), HasCommand and StorePersist's function may run on any thread.
//
// Lifetimes: a function handed a Membership, FakeClock or DurableStore borrows it for the call
// only, except StorePersist, whose function borrows `store`: the store must outlive every
// Membership the function is given to.
//
// Status codes: none of these functions returns a status (a failure fails the test case);
// StorePersist's function returns DurableStore::Commit's status unchanged.
//
// Every job below has job_id "j", heartbeat_interval_ms 100 and failure_timeout_ms 1000 where
// it says so; Request names that job.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/config.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/membership.h"
#include "storage/durable_store.h"

namespace rebound::server::testing {

// Parses `text` as a JobConfig; REQUIREs that it is valid (the parse error is shown otherwise).
JobConfig ParseJob(const std::string& text);

// 2 replicas x 1 stage of an 8 -> 4 MLP; heartbeat 100 ms, failure_timeout 1000 ms.
JobConfig TwoByOneJob();

// TwoByOneJob under `policy` (a FaultTolerance policy name, which may be followed by more
// fault_tolerance fields) with `recovery_parallelism`.
JobConfig JobWithPolicy(const char* policy, int recovery_parallelism = 1);

// `replicas` x 3 stages of an 8 -> 6 -> 4 MLP under REPLAY; heartbeat 100 ms, failure_timeout
// 1000 ms.
JobConfig PipelineJob(int replicas);

// `replicas` x `stages` of a 4 -> 3 -> 2 MLP, batches of 4 in 2 micro-batches, followed by
// `more` (further top-level fields of the job, e.g. "easgd { sync_period: 2 }\n").
JobConfig TinyModelJob(int replicas, int stages, const std::string& more = "");

// A RegisterRequest of job "j" from `name` asking for `role`, reachable at `peer_address`.
RegisterRequest Request(const std::string& name, WorkerRole role = ROLE_UNSPECIFIED,
                        const std::string& peer_address = "127.0.0.1:1");

// A heartbeat of `incarnation` at `step`.
HeartbeatRequest Beat(uint64_t incarnation, int64_t step = 0);

// Beat(incarnation) reporting `flushes_done`.
HeartbeatRequest Flushed(uint64_t incarnation, int64_t flushes_done);

// Beat(incarnation) reporting that the trainer waits on a neighbour for `reason`.
HeartbeatRequest Blocked(uint64_t incarnation, const std::string& reason);

// The slot (replica, stage).
SlotId Slot(int replica, int stage = 0);

// Whether `response` carries `command`.
bool HasCommand(const HeartbeatResponse& response, Command command);

// Sends `request` to `membership`; REQUIREs OK and returns the response.
HeartbeatResponse BeatOk(Membership& membership, const HeartbeatRequest& request);

// Registers a trainer ("t0", "t1", ...) on every one of the `slots` slots of a 3-stage job, in
// slot order (index replica * 3 + stage); REQUIREs each to get that slot. Returns their
// incarnations in slot order.
std::vector<uint64_t> RegisterTrainers(Membership& membership, int slots);

// Heartbeats as a trainer that carries out the FLUSH_LOG its heartbeat asks for (the sequence
// numbers are the server's: above any of an earlier server life, so not 1, 2, ...). REQUIREs
// that the heartbeat asks for one. Returns the sequence it reported.
int64_t FlushWhenAsked(Membership& membership, uint64_t incarnation);

// `trainers` except `silent` (and every one of `others_alive`) heartbeat 900 ms in; 200 ms
// later `silent` is declared failed: REQUIREs DetectFailures to return exactly `silent`.
// For a job with failure_timeout_ms 1000.
void FailOne(FakeClock& clock, Membership& membership, const std::vector<uint64_t>& trainers,
             uint64_t silent, std::vector<uint64_t> others_alive = {});

// An in-memory DurableStore for `job` (default durability, the job's step log options);
// REQUIREs that it opens.
std::unique_ptr<storage::DurableStore> OpenInMemoryStore(const JobConfig& job);

// A Membership::PersistFn that commits the server record and the slots to `store`, as
// server/main.cc does. `store` must outlive the function.
Membership::PersistFn StorePersist(storage::DurableStore* store);

}  // namespace rebound::server::testing
