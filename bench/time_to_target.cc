#include "bench/time_to_target.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/figures.h"
#include "bench/load_average.h"

namespace rebound::bench {
namespace {

constexpr absl::Duration kPoll = absl::Milliseconds(50);
constexpr absl::Duration kCalibrationWarmup = absl::Seconds(2);
constexpr absl::Duration kStartWait = absl::Seconds(60);
constexpr int64_t kMaxSteps = 1000000000;

class Run {
 public:
  Run(const TimeToTargetOptions& flags, const JobConfig& base_job, const std::string& dir, const RunSpec& spec)
      : flags_(flags), job_(MakeRunJob(flags, base_job, spec)), spec_(spec),
        cluster_(flags.cluster, dir) {}

  RunResult Execute() {
    RunResult result;
    const absl::Status status = Train(&result);
    // Killed trainers exit 137; under GLOBAL_CHECKPOINT a rolled-back trainer may have been
    // fenced meanwhile and exit 3.
    cluster_.StopAll(result.ok, [&result](const ChildProcess& worker, int code) {
      if (code != 0 && code != 137 && code != 3 && result.ok) {
        std::fprintf(stderr, "note: %s exited with code %d\n", worker.log_path().c_str(), code);
      }
    });
    if (!status.ok()) {
      result.ok = false;
      result.error = std::string(status.message());
    }
    return result;
  }

 private:
  static std::string NameOf(const GetStatusResponse& status, uint64_t incarnation) {
    for (const WorkerStatus& w : status.workers()) {
      if (w.incarnation() == incarnation) return w.name();
    }
    return "";
  }

  // Kills the owner of `slot` if it is ACTIVE, then starts a fresh spare. Returns whether it
  // killed.
  absl::StatusOr<bool> MaybeKill(const GetStatusResponse& status, int slot) {
    if (slot >= status.slots_size() || status.slots(slot).state() != ACTIVE) return false;
    const std::string victim = NameOf(status, status.slots(slot).owner_incarnation());
    if (victim.empty() || cluster_.FindWorker(victim) == nullptr) return false;
    if (absl::Status killed = cluster_.KillWorker(victim); !killed.ok()) return killed;
    last_victim_ = victim;
    // The warm pool covers the first kills; past it, the replacement starts now.
    if (++kills_ > spec_.standing_spares - 1) {
      if (absl::Status s = cluster_.StartWorker(absl::StrCat("spare-", next_spare_++), "spare");
          !s.ok()) {
        return s;
      }
    }
    return true;
  }

  absl::Status Train(RunResult* result) {
    const absl::Time started = absl::Now();
    if (absl::Status s = cluster_.StartServer(job_); !s.ok()) return s;
    // The spare and the evaluator first, each with its data loaded (the evaluator has reported
    // on the initial center); then the trainers all at once, which take the slots in the order
    // they register. The clock starts at the first sync of any slot.
    // The warm pool (none for the "drop" baseline, whose killed trainers' replacements start at
    // their kills and register once their data is loaded).
    std::vector<std::string> pool;
    for (int i = 0; i < spec_.standing_spares; ++i) pool.push_back(absl::StrCat("spare-", i));
    if (!pool.empty()) {
      if (absl::Status s = cluster_.StartSpares(
              pool, job_.fault_tolerance().policy() != RESTART_FROM_CENTER);
          !s.ok()) {
        return s;
      }
    }
    next_spare_ = spec_.standing_spares;
    if (absl::Status s = cluster_.StartEvaluator(); !s.ok()) return s;
    auto evaluating = cluster_.WaitForStatus(
        [](const GetStatusResponse& s) { return s.has_last_eval(); }, kStartWait,
        "the evaluator's first report");
    if (!evaluating.ok()) return evaluating.status();
    const int replicas = job_.topology().replicas();
    for (int i = 0; i < replicas; ++i) {
      if (absl::Status s = cluster_.StartWorker(absl::StrCat("trainer-", i), "trainer"); !s.ok()) {
        return s;
      }
    }
    auto training = cluster_.WaitForStatus(
        [](const GetStatusResponse& s) {
          for (const SlotStatus& slot : s.slots()) {
            if (slot.update_count() > 0) return true;
          }
          return false;
        },
        kStartWait, "a first sync", absl::Milliseconds(10));
    if (!training.ok()) return training.status();
    const absl::Time t0 = absl::Now();
    result->seconds_to_first_sync = absl::ToDoubleSeconds(t0 - started);
    if (absl::Status s = cluster_.WaitForFirstSyncs(replicas); !s.ok()) return s;

    if (spec_.kind == RunKind::kCalibration) return Calibrate(t0, result);
    const double steps_at_t0 = MeanSteps(*training);

    const absl::Time limit = t0 + absl::Seconds(flags_.max_seconds);
    size_t next_kill = 0;
    LoadAverageMeter load;
    absl::Time next_load = t0;
    GetStatusResponse last;
    while (true) {
      if (absl::Status children = cluster_.CheckChildren(); !children.ok()) return children;
      absl::StatusOr<GetStatusResponse> status = cluster_.GetStatus();
      const absl::Time now = absl::Now();
      if (now >= next_load) {
        load.Sample();
        next_load += absl::Seconds(1);
      }
      if (status.ok()) {
        last = *status;
        if (status->has_last_eval()) {
          const EvalStatus& eval = status->last_eval();
          result->last_accuracy = eval.test_accuracy();
          if (eval.test_accuracy() >= flags_.target) {
            const absl::Time reported = now - absl::Milliseconds(eval.reported_ms_ago());
            result->reached = true;
            result->seconds = std::max(0.0, absl::ToDoubleSeconds(reported - t0));
            result->accuracy = eval.test_accuracy();
            result->center_version = eval.center_version();
            break;
          }
        }
        if (next_kill < spec_.kill_seconds.size() &&
            now >= t0 + absl::Seconds(spec_.kill_seconds[next_kill])) {
          const int slot = static_cast<int>(next_kill % job_.topology().replicas());
          absl::StatusOr<bool> killed = MaybeKill(*status, slot);
          if (!killed.ok()) return killed.status();
          if (*killed) {
            KillRecord record;
            record.scheduled_s = spec_.kill_seconds[next_kill];
            record.at_s = absl::ToDoubleSeconds(absl::Now() - t0);
            record.slot = slot;
            record.victim = last_victim_;
            result->kills.push_back(record);
            ++next_kill;
          }
        }
      }
      if (now >= limit) break;
      absl::SleepFor(kPoll);
    }
    absl::StatusOr<GetStatusResponse> final_status = cluster_.GetStatus();
    const absl::Time end = absl::Now();
    result->final_status = final_status.ok() ? *std::move(final_status) : last;
    for (const SlotStatus& slot : result->final_status.slots()) {
      result->steps.push_back(slot.step());
    }
    // Per slot over [t0, end], net: a rollback sets a slot's step back to the checkpoint's.
    const double steps = MeanSteps(result->final_status) - steps_at_t0;
    result->ms_per_step = steps > 0 ? absl::ToDoubleMilliseconds(end - t0) / steps : NAN;
    load.Sample();
    result->load = load.Mean();
    result->ok = true;
    return absl::OkStatus();
  }

  // A failure-free GLOBAL_CHECKPOINT window: step time and checkpoint figures.
  absl::Status Calibrate(absl::Time t0, RunResult* result) {
    LoadAverageMeter load;
    if (absl::Status s = cluster_.Watch(t0 + kCalibrationWarmup, kPoll, [](absl::Time) {});
        !s.ok()) {
      return s;
    }
    absl::StatusOr<GetStatusResponse> a = cluster_.GetStatus();
    const absl::Time at_a = absl::Now();
    if (!a.ok()) return a.status();
    absl::Time next_load = at_a;
    if (absl::Status s = cluster_.Watch(at_a + absl::Seconds(flags_.calibration_seconds), kPoll,
                                        [&](absl::Time now) {
                                          if (now >= next_load) {
                                            load.Sample();
                                            next_load += absl::Seconds(1);
                                          }
                                        });
        !s.ok()) {
      return s;
    }
    absl::StatusOr<GetStatusResponse> b = cluster_.GetStatus();
    const absl::Time at_b = absl::Now();
    if (!b.ok()) return b.status();
    if (!b->recoveries().empty()) {
      return absl::InternalError("a recovery ran during the failure-free calibration");
    }
    const double steps = MeanSteps(*b) - MeanSteps(*a);
    if (steps <= 0) return absl::InternalError("no step in the calibration window");
    result->window_ms_per_step = absl::ToDoubleMilliseconds(at_b - at_a) / steps;
    result->checkpoints = b->checkpoint().count() - a->checkpoint().count();
    result->barrier_wait_ms = b->checkpoint().barrier_wait_ms() - a->checkpoint().barrier_wait_ms();
    result->write_ms = b->checkpoint().write_ms() - a->checkpoint().write_ms();
    result->checkpoint_bytes = b->checkpoint().bytes();
    for (const SlotStatus& slot : b->slots()) result->steps.push_back(slot.step());
    result->final_status = *std::move(b);
    load.Sample();
    result->load = load.Mean();
    result->ok = true;
    return absl::OkStatus();
  }

  const TimeToTargetOptions& flags_;
  const JobConfig job_;
  const RunSpec spec_;
  LocalCluster cluster_;
  int next_spare_ = 0;
  int kills_ = 0;
  std::string last_victim_;
};

}  // namespace

std::string RunName(const RunSpec& spec) {
  switch (spec.kind) {
    case RunKind::kFailureFree: return "FAILURE-FREE";
    case RunKind::kCalibration: return "CALIBRATION";
    case RunKind::kWithFailures: return RecoveryPolicy_Name(spec.policy);
  }
  return "?";
}

JobConfig MakeRunJob(const TimeToTargetOptions& flags, const JobConfig& base, const RunSpec& spec) {
  JobConfig job = base;
  job.set_job_id(flags.job_id);
  job.mutable_topology()->set_spares(1);
  job.mutable_topology()->set_evaluator(true);
  job.mutable_training()->set_max_steps(kMaxSteps);
  job.mutable_training()->set_eval_every_ms(flags.eval_every_ms);
  job.mutable_fault_tolerance()->set_policy(spec.policy);
  if (spec.policy == GLOBAL_CHECKPOINT) {
    job.mutable_fault_tolerance()->set_checkpoint_every_steps(spec.checkpoint_every_steps);
  }
  // Only REPLAY reads the step log.
  job.mutable_step_log()->set_enabled(spec.policy == REPLAY);
  if (flags.uniform_weights) job.mutable_weighting()->set_policy(UNIFORM);
  return job;
}

double MeanSteps(const GetStatusResponse& status) {
  if (status.slots_size() == 0) return 0;
  double sum = 0;
  for (const SlotStatus& slot : status.slots()) sum += slot.step();
  return sum / status.slots_size();
}

RunResult ExecuteRun(const TimeToTargetOptions& options, const JobConfig& base,
                     const std::string& dir, const RunSpec& spec) {
  return Run(options, base, dir, spec).Execute();
}


std::string Seconds(double s) {
  return std::isinf(s) ? std::string("not reached") : absl::StrFormat("%.1f s", s);
}

// One line per (policy, outcome) of the run's recoveries, with their median phases.
std::string DescribeRecoveries(const GetStatusResponse& status) {
  std::map<std::string, std::vector<const RecoveryStatus*>> groups;
  for (const RecoveryStatus& r : status.recoveries()) {
    groups[absl::StrCat(RecoveryPolicy_Name(r.policy()), " ",
                        r.has_outcome() ? RecoveryOutcome_Name(r.outcome()) : "RUNNING")]
        .push_back(&r);
  }
  if (groups.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& [key, list] : groups) {
    std::vector<double> detection, rebuild, replayed;
    int verified = 0;
    for (const RecoveryStatus* r : list) {
      detection.push_back(r->phases().detection_ms());
      rebuild.push_back(r->phases().snapshot_transfer_ms() + r->phases().replay_ms() +
                        r->phases().takeover_ms());
      replayed.push_back(r->steps_replayed());
      verified += r->verified() ? 1 : 0;
    }
    parts.push_back(absl::StrFormat(
        "%d x %s (median detection %.0f ms, transfer+replay+takeover %.0f ms, %.0f steps "
        "replayed; %d verified)",
        list.size(), key, Median(detection), Median(rebuild), Median(replayed), verified));
  }
  return absl::StrJoin(parts, "; ");
}

std::string DescribeKills(const std::vector<KillRecord>& kills) {
  if (kills.empty()) return "none";
  std::vector<std::string> parts;
  for (const KillRecord& k : kills) {
    std::string part = absl::StrFormat("%.1f s slot %d (%s)", k.at_s, k.slot, k.victim);
    if (k.at_s - k.scheduled_s > 0.25) {
      absl::StrAppend(&part, absl::StrFormat(", %.1f s late: slot not ACTIVE", k.at_s - k.scheduled_s));
    }
    parts.push_back(part);
  }
  return absl::StrJoin(parts, ", ");
}


}  // namespace rebound::bench
