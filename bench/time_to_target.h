#pragma once

// Time to a target accuracy on a real local cluster, with trainers killed on a schedule: one run
// of the shipped job as bench/failures (its header says how a run goes) and bench/goodput use it.
// A run starts rebound_server (inline job, in-memory state), its warm pool of spares (each with
// its data loaded), the evaluator (it reports on the initial center first) and the trainers all
// at once; its clock starts at the first sync of any slot (t0). At t0 + each of its kill times it
// SIGKILLs the trainer of slot k % R (k the kill's index; a slot not ACTIVE then is killed as
// soon as it is); once the pool's spares are spent (the pool's first spare stands for the job's
// own, every further one for a kill's replacement machine), each kill also starts a fresh spare
// (a replacement machine) at once. The pool exists because on a 2-core machine a replacement
// started at the kill takes the trainers' CPU for seconds while it loads the data set, which a
// replacement machine with CPUs of its own would not. It ends at the evaluator's first report at
// or above the target accuracy, or at max_seconds.
//
// Thread-safety: a run uses its cluster from the calling thread (the main thread: see
// testing/cluster). Ownership: nothing outlives the call. Status codes: a run that failed (a
// process that could not start, a wait past its limit) has ok false and the error.

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "bench/local_cluster.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"

namespace rebound::bench {

inline constexpr double kNotReached = std::numeric_limits<double>::infinity();

struct TimeToTargetOptions {
  std::string job_id;
  double target = 0.87;
  int eval_every_ms = 500;
  int max_seconds = 180;
  bool uniform_weights = false;  // weighting.policy UNIFORM instead of the shipped job's
  int calibration_seconds = 10;  // RunKind::kCalibration's window
  ClusterFlags cluster;          // resolved (ResolveClusterFlags)
};

enum class RunKind { kFailureFree, kCalibration, kWithFailures };

struct RunSpec {
  RunKind kind;
  RecoveryPolicy policy;  // kWithFailures; REPLAY for kFailureFree, GLOBAL_CHECKPOINT calibrating
  int rep;
  int checkpoint_every_steps = 0;  // GLOBAL_CHECKPOINT
  std::vector<double> kill_seconds;  // after t0, kWithFailures; kill k takes slot k % R
  // Spares started (data loaded) before t0: the job's one and the replacements of the first
  // standing_spares - 1 kills. 0: the "drop" baseline, whose only spares are the killed
  // trainers' replacements, each started at its kill.
  int standing_spares = 1;
};

// "FAILURE-FREE", "CALIBRATION" or the policy's name.
std::string RunName(const RunSpec& spec);

// The shipped job `base` as a run uses it: options.job_id, max_steps 10^9, the evaluator every
// eval_every_ms, one spare, the run's policy (and GLOBAL_CHECKPOINT's interval), the step log on
// for REPLAY only.
JobConfig MakeRunJob(const TimeToTargetOptions& options, const JobConfig& base,
                     const RunSpec& spec);

struct KillRecord {
  double scheduled_s = 0;  // after t0
  double at_s = 0;         // when it happened
  int slot = 0;
  std::string victim;
};

struct RunResult {
  bool ok = false;
  std::string error;
  bool reached = false;
  double seconds = kNotReached;  // t0 -> the report that reached the target
  double accuracy = 0;         // that report's
  int64_t center_version = 0;
  double last_accuracy = 0;    // at the end when not reached
  std::vector<KillRecord> kills;
  std::vector<int64_t> steps;  // per slot, at the end
  double ms_per_step = NAN;    // per slot: time / mean steps over [t0, end]
  GetStatusResponse final_status;
  // kCalibration only: the window's step time per slot and the checkpoints' figures.
  double window_ms_per_step = NAN;
  int64_t checkpoints = 0;
  int64_t barrier_wait_ms = 0;
  int64_t write_ms = 0;
  int64_t checkpoint_bytes = 0;
  double seconds_to_first_sync = 0;
  double load = 0;
};

// The slots' mean step.
double MeanSteps(const GetStatusResponse& status);

// Runs `spec` in `dir` (which exists) and stops every process it started.
RunResult ExecuteRun(const TimeToTargetOptions& options, const JobConfig& base,
                     const std::string& dir, const RunSpec& spec);

// "12.3 s" or "not reached".
std::string Seconds(double s);
// One line per (policy, outcome) of the run's recoveries, with their median phases.
std::string DescribeRecoveries(const GetStatusResponse& status);
std::string DescribeKills(const std::vector<KillRecord>& kills);

}  // namespace rebound::bench
