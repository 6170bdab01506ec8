#pragma once

// One time scale for every test that runs real Rebound processes: the factor by which the tests'
// waits and RPC deadlines, and the timing fields of the jobs and worker configs they write
// (heartbeat interval, failure timeout, deadlines), are stretched. A ThreadSanitizer build runs
// 5-15x slower than the normal one; `.bazelrc` sets REBOUND_TEST_TIME_SCALE for `--config=tsan`
// tests (`test:tsan --test_env=...`), so that the same assertions hold on a slower machine
// instead of being left out. Unset (the normal build), the scale is 1 and nothing changes.
//
// What is scaled: bounds, never what a test measures or provokes. A limit the test waits up to
// (a status it polls for, an exit, an RPC deadline), and a timeout the server or a worker keeps
// (a worker is declared failed after failure_timeout_ms of silence) grow by the factor; paces
// that shape the run (a sync period, the step log's linger, backoff, the server's max_wait_ms)
// do not.
//
// Thread-safety: every function is safe to call from any thread; the variable is read once, on
// the first call. Ownership: nothing is kept; ScaleTimingFields borrows its argument for the
// call. Status codes: none. A REBOUND_TEST_TIME_SCALE that is not a whole number in [1, 100]
// aborts the process with a message on stderr: a test that silently ran unscaled would fail for
// a reason nobody sees.

#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "proto/config.pb.h"

namespace rebound::testing {

// The environment variable, and the factor it holds (1 when unset or empty).
inline constexpr char kTimeScaleVariable[] = "REBOUND_TEST_TIME_SCALE";
int TimeScale();

// `d` (or `ms` milliseconds) times TimeScale().
absl::Duration Scaled(absl::Duration d);
int64_t ScaledMs(int64_t ms);

// Multiplies the timing fields that are bounds by TimeScale(), their defaults included (set
// explicitly once scaled): the job's fault_tolerance heartbeat_interval_ms (so that its ratio to
// failure_timeout_ms stays), failure_timeout_ms, crash_confirm_ms, neighbour_timeout_ms,
// reconnect_grace_ms and recovery_timeout_ms; a worker's rpc_deadline_ms and give_up_after_ms.
// At scale 1 the message is left untouched.
void ScaleTimingFields(JobConfig* job);
void ScaleTimingFields(WorkerConfig* worker);

// `text`, a ServerConfig (the timing fields of its inline job) or a WorkerConfig in protobuf text,
// with its timing fields scaled as above, for a harness that writes the config files of the
// processes it starts. At scale 1, or when `text` does not parse (the daemon will then say why),
// `text` itself: the normal build's files are exactly what the test wrote.
std::string ScaledServerConfig(const std::string& text);
std::string ScaledWorkerConfig(const std::string& text);

}  // namespace rebound::testing
