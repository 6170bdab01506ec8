#include "server/server_metrics.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/grpc_handoff.h"
#include "common/grpc_status.h"

namespace rebound::server {
namespace {

// "/rebound.ParameterServer/Sync" -> "Sync".
std::string ShortMethod(const char* method) {
  const std::string full = method == nullptr ? "" : method;
  const size_t slash = full.rfind('/');
  return slash == std::string::npos ? full : full.substr(slash + 1);
}

class RpcMetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcMetricsInterceptor(MetricsRegistry* registry, const Clock* clock, std::string method)
      : registry_(registry), clock_(clock), method_(std::move(method)), start_(clock->Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      // The counter family is looked up (and so registered and rendered) first, but the
      // histogram observes first: a scrape that renders the counter before the histogram then
      // never shows more answered RPCs than observed durations.
      Counter* const answered = registry_->GetCounter(
          "rebound_rpcs_total", "RPCs the server answered, by method and status code.",
          {{"method", method_}, {"code", StatusCodeName(status.error_code())}});
      registry_
          ->GetHistogram("rebound_rpc_duration_seconds",
                         "Time from an RPC's start to its status, by method.", LatencyBuckets(),
                         {{"method", method_}})
          ->ObserveDuration(clock_->Now() - start_);
      answered->Increment();
    }
    methods->Proceed();
  }

 private:
  static std::string StatusCodeName(grpc::StatusCode code) {
    return std::string(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)));
  }

  MetricsRegistry* const registry_;
  const Clock* const clock_;
  const std::string method_;
  const absl::Time start_;
};

class RpcMetricsFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  RpcMetricsFactory(MetricsRegistry* registry, const Clock* clock)
      : registry_(registry), clock_(clock) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    MarkTakenFromGrpc();  // on a callback API thread for WorkerSession.Attach
    return new RpcMetricsInterceptor(registry_, clock_, ShortMethod(info->method()));
  }

 private:
  MetricsRegistry* const registry_;
  const Clock* const clock_;
};

std::string SlotLabel(const SlotId& slot) { return absl::StrCat(slot.replica(), ",", slot.stage()); }

// A replicated group as this server sees it (docs/operations.md#high-availability): its role,
// the leader's epoch (a change is a failover), the in-sync set, and each standby's lag.
void WriteGroup(const GroupStatus& g, MetricsWriter* w) {
  w->Family("rebound_group_role", "1 for this server's role in its replicated group.", "gauge");
  for (const GroupStatus::Role role :
       {GroupStatus::LEADER, GroupStatus::STANDBY, GroupStatus::CANDIDATE}) {
    w->Sample("rebound_group_role", {{"group", g.group()}, {"role", GroupStatus::Role_Name(role)}},
              g.role() == role ? 1 : 0);
  }
  w->Family("rebound_group_epoch",
            "The leader's epoch (the etcd revision it won at); it changes at each failover.",
            "gauge");
  w->Sample("rebound_group_epoch", {{"group", g.group()}}, static_cast<double>(g.epoch()));
  w->Family("rebound_group_last_sequence", "This server's last committed (or applied) commit.",
            "gauge");
  w->Sample("rebound_group_last_sequence", {{"group", g.group()}},
            static_cast<double>(g.last_sequence()));
  w->Family("rebound_group_standbys_configured", "replication.standbys.", "gauge");
  w->Sample("rebound_group_standbys_configured", {{"group", g.group()}}, g.standbys_configured());
  w->Family("rebound_group_in_sync_members",
            "Members in the in-sync set recorded in etcd, the leader included; below "
            "1 + standbys_configured the group is degraded.",
            "gauge");
  w->Sample("rebound_group_in_sync_members", {{"group", g.group()}}, g.in_sync_size());
  w->Family("rebound_group_standby_in_sync", "1 while the leader counts the standby in sync.",
            "gauge");
  w->Family("rebound_group_standby_lag_commits",
            "Commits the standby has not acknowledged (the leader's view).", "gauge");
  w->Family("rebound_group_standby_lag_seconds",
            "Age of the oldest commit the standby has not acknowledged (the leader's view).",
            "gauge");
  for (const StandbyStatus& standby : g.standbys()) {
    const MetricLabels labels = {{"group", g.group()}, {"standby", standby.name()}};
    w->Sample("rebound_group_standby_in_sync", labels, standby.in_sync() ? 1 : 0);
    w->Sample("rebound_group_standby_lag_commits", labels,
              static_cast<double>(standby.lag_commits()));
    w->Sample("rebound_group_standby_lag_seconds", labels, standby.lag_ms() / 1000.0);
  }
}

void WriteStatus(const GetStatusResponse& s, MetricsWriter* w) {
  w->Family("rebound_up", "1 while the server serves its job.", "gauge");
  w->Sample("rebound_up", {{"job", s.job_id()}, {"version", s.server_version()}}, 1);
  w->Family("rebound_uptime_seconds", "Seconds since the server started.", "gauge");
  w->Sample("rebound_uptime_seconds", {}, s.uptime_ms() / 1000.0);

  struct SlotFamily {
    const char* name;
    const char* help;
    std::function<double(const SlotStatus&)> value;
  };
  const SlotFamily slot_families[] = {
      {"rebound_slot_step", "The step the slot's trainer last reported (rate() is the slot's "
                            "training throughput in steps/s).",
       [](const SlotStatus& x) { return static_cast<double>(x.step()); }},
      {"rebound_slot_snapshot_step", "The step of the slot's last applied sync (its snapshot).",
       [](const SlotStatus& x) { return static_cast<double>(x.snapshot_step()); }},
      {"rebound_slot_logged_step",
       "The highest step of the slot whose step log this server has committed.",
       [](const SlotStatus& x) { return static_cast<double>(x.logged_step()); }},
      {"rebound_slot_updates", "Syncs or pushes of the slot applied to the center.",
       [](const SlotStatus& x) { return static_cast<double>(x.update_count()); }},
      {"rebound_slot_refused_updates",
       "Syncs or pushes of the slot refused as its sender's fault (malformed, non-finite, or "
       "breaking the center's integrity) since the server started.",
       [](const SlotStatus& x) { return static_cast<double>(x.refused_updates()); }},
      {"rebound_slot_weight", "The slot's reliability weight (docs/design.md §4.5).",
       [](const SlotStatus& x) { return x.weight().weight(); }},
      {"rebound_slot_staleness", "Weight input: normalized staleness at the last update.",
       [](const SlotStatus& x) { return x.weight().staleness(); }},
      {"rebound_slot_lateness", "Weight input: lateness at the last update.",
       [](const SlotStatus& x) { return x.weight().lateness(); }},
      {"rebound_slot_divergence", "Weight input: normalized divergence at the last update.",
       [](const SlotStatus& x) { return x.weight().divergence(); }},
      {"rebound_slot_fault_score",
       "Weight input: the decaying fault score of the slot's owner (scores follow workers).",
       [](const SlotStatus& x) { return x.weight().fault_score(); }},
  };
  for (const SlotFamily& f : slot_families) {
    w->Family(f.name, f.help, "gauge");
    for (const SlotStatus& slot : s.slots()) {
      w->Sample(f.name, {{"slot", SlotLabel(slot.slot())}}, f.value(slot));
    }
  }
  w->Family("rebound_slot_state", "1 for the slot's current state.", "gauge");
  for (const SlotStatus& slot : s.slots()) {
    w->Sample("rebound_slot_state",
              {{"slot", SlotLabel(slot.slot())}, {"state", SlotState_Name(slot.state())}}, 1);
  }

  std::map<std::pair<std::string, std::string>, int> workers;
  for (const WorkerStatus& worker : s.workers()) {
    ++workers[{WorkerRole_Name(worker.role()), WorkerState_Name(worker.state())}];
  }
  w->Family("rebound_workers", "Workers the server knows, by role and state (FAILED ones are the "
                               "failures declared so far, as long as their records are kept).",
            "gauge");
  for (const auto& [key, count] : workers) {
    w->Sample("rebound_workers", {{"role", key.first}, {"state", key.second}}, count);
  }
  // One sample per distinct worker name that is alive or has a nonzero score: at most the
  // tracker's kMaxWorkers (256) charged names plus the alive workers, whatever the history.
  std::map<std::string, double> fault_scores;
  for (const WorkerStatus& worker : s.workers()) {
    if (worker.state() != ALIVE && !(worker.fault_score() > 0.0)) continue;
    double& score = fault_scores[worker.name()];
    score = std::max(score, worker.fault_score());
  }
  w->Family("rebound_worker_fault_score",
            "The decaying fault score of each worker name (docs/design.md §4.5: it follows the worker "
            "across incarnations and slots), for alive workers and names with a nonzero score.",
            "gauge");
  for (const auto& [name, score] : fault_scores) {
    w->Sample("rebound_worker_fault_score", {{"worker", name}}, score);
  }
  w->Family("rebound_worker_heartbeat_age_seconds",
            "Seconds since each alive worker's last heartbeat.", "gauge");
  for (const WorkerStatus& worker : s.workers()) {
    if (worker.state() != ALIVE) continue;
    w->Sample("rebound_worker_heartbeat_age_seconds",
              {{"worker", worker.name()}, {"role", WorkerRole_Name(worker.role())}},
              worker.last_heartbeat_ms_ago() / 1000.0);
  }

  w->Family("rebound_center_version", "Updates applied to the stage's center.", "gauge");
  for (const CenterStatus& c : s.centers()) {
    w->Sample("rebound_center_version", {{"stage", absl::StrCat(c.stage())}},
              static_cast<double>(c.version()));
  }
  w->Family("rebound_center_max_abs_value",
            "The largest |value| of the center and snapshots that accepted updates produced since "
            "the server started (bound: weighting.max_abs_value).",
            "gauge");
  for (const CenterStatus& c : s.centers()) {
    w->Sample("rebound_center_max_abs_value", {{"stage", absl::StrCat(c.stage())}},
              c.max_abs_value());
  }
  w->Family("rebound_center_max_divergence_ratio",
            "The largest ||x - c|| (||g||) of an accepted update over the median of the stage's "
            "other live trainers' since the server started (bound: "
            "weighting.max_divergence_ratio).",
            "gauge");
  for (const CenterStatus& c : s.centers()) {
    w->Sample("rebound_center_max_divergence_ratio", {{"stage", absl::StrCat(c.stage())}},
              c.max_divergence_ratio());
  }

  // Goodput (docs/metrics.md#goodput): counters of this server life, per slot; sum() over `slot`
  // gives the job's.
  w->Family("rebound_goodput_seconds_total",
            "Productive training time of the slot in this server life: ACTIVE less the failures' "
            "detection and the steps discarded.",
            "counter");
  w->Family("rebound_badput_seconds_total",
            "Training time of the slot lost in this server life, by cause (detect, replay, "
            "restore, rollback, idle).",
            "counter");
  for (const SlotStatus& slot : s.slots()) {
    const SlotGoodput& g = slot.goodput();
    const std::string label = SlotLabel(slot.slot());
    w->Sample("rebound_goodput_seconds_total", {{"slot", label}}, g.goodput_seconds());
    const std::pair<const char*, double> causes[] = {
        {"detect", g.detect_seconds()},     {"replay", g.replay_seconds()},
        {"restore", g.restore_seconds()},   {"rollback", g.rollback_seconds()},
        {"idle", g.idle_seconds()}};
    for (const auto& [cause, seconds] : causes) {
      w->Sample("rebound_badput_seconds_total", {{"slot", label}, {"cause", cause}}, seconds);
    }
  }
  if (s.has_ettr()) {
    w->Family("rebound_job_ettr",
              "The job's effective training time ratio in this server life: goodput / (goodput "
              "+ badput), over every slot.",
              "gauge");
    w->Sample("rebound_job_ettr", {}, s.ettr());
  }

  std::map<std::pair<std::string, std::string>, int> recoveries;
  double replayed = 0;
  std::map<std::string, double> phase_ms;
  for (const RecoveryStatus& r : s.recoveries()) {
    ++recoveries[{RecoveryPolicy_Name(r.policy()),
                  r.has_outcome() ? RecoveryOutcome_Name(r.outcome()) : "RUNNING"}];
    replayed += r.steps_replayed();
    phase_ms["detection"] += r.phases().detection_ms();
    phase_ms["snapshot_transfer"] += r.phases().snapshot_transfer_ms();
    phase_ms["replay"] += r.phases().replay_ms();
    phase_ms["takeover"] += r.phases().takeover_ms();
  }
  w->Family("rebound_recoveries", "Recoveries in the server's record (the newest 256), by policy "
                                  "and outcome.",
            "gauge");
  for (const auto& [key, count] : recoveries) {
    w->Sample("rebound_recoveries", {{"policy", key.first}, {"outcome", key.second}}, count);
  }
  w->Family("rebound_recovery_steps_replayed", "Steps replayed by the recoveries on record.",
            "gauge");
  w->Sample("rebound_recovery_steps_replayed", {}, replayed);
  w->Family("rebound_recovery_phase_seconds",
            "Time the recoveries on record spent in each phase, summed.", "gauge");
  for (const auto& [phase, ms] : phase_ms) {
    w->Sample("rebound_recovery_phase_seconds", {{"phase", phase}}, ms / 1000.0);
  }
  if (!s.recovery_durations().empty()) {
    w->Family("rebound_recovery_duration_seconds",
              "Recoveries that ended in a takeover in this server life, by policy: the time from "
              "the failure (its detection included) to the takeover.",
              "histogram");
  }
  for (const RecoveryDurations& h : s.recovery_durations()) {
    const std::string policy = RecoveryPolicy_Name(h.policy());
    uint64_t cumulative = 0;
    for (int i = 0; i < h.bucket_counts_size(); ++i) {
      cumulative += h.bucket_counts(i);
      const std::string le = i < h.bucket_le_seconds_size()
                                 ? absl::StrCat(h.bucket_le_seconds(i))
                                 : std::string("+Inf");
      w->Sample("rebound_recovery_duration_seconds_bucket", {{"policy", policy}, {"le", le}},
                static_cast<double>(cumulative));
    }
    w->Sample("rebound_recovery_duration_seconds_sum", {{"policy", policy}}, h.sum_seconds());
    w->Sample("rebound_recovery_duration_seconds_count", {{"policy", policy}},
              static_cast<double>(h.count()));
  }
  if (s.has_audit_counts()) {
    // Audits (docs/recovery.md#audits): counters of this server life.
    const AuditCounts& a = s.audit_counts();
    w->Family("rebound_audits_total", "Audit replays that ended in this server life, by result.",
              "counter");
    w->Sample("rebound_audits_total", {{"result", "matched"}}, a.matched());
    w->Sample("rebound_audits_total", {{"result", "mismatched"}}, a.mismatched());
    w->Sample("rebound_audits_total", {{"result", "incomplete"}}, a.incomplete());
    w->Sample("rebound_audits_total", {{"result", "preempted"}}, a.preempted());
    w->Family("rebound_audit_verdicts_total",
              "Decided mismatches: confirmed (the trainer's), auditor_fault (the first auditor's), "
              "inconclusive (nobody's).",
              "counter");
    w->Sample("rebound_audit_verdicts_total", {{"verdict", "confirmed"}}, a.confirmed());
    w->Sample("rebound_audit_verdicts_total", {{"verdict", "auditor_fault"}}, a.auditor_faults());
    w->Sample("rebound_audit_verdicts_total", {{"verdict", "inconclusive"}}, a.inconclusive());
    w->Family("rebound_audit_windows_total",
              "Sync windows chosen for an audit and kept, chosen but skipped (max_concurrent, "
              "steps_per_hour), kept but expired unreplayed, and chosen but unread (the "
              "starting snapshot could not be read).",
              "counter");
    w->Sample("rebound_audit_windows_total", {{"state", "kept"}}, a.windows_chosen());
    w->Sample("rebound_audit_windows_total", {{"state", "skipped"}}, a.windows_skipped());
    w->Sample("rebound_audit_windows_total", {{"state", "expired"}}, a.expired());
    w->Sample("rebound_audit_windows_total", {{"state", "unread"}}, a.windows_unread());
    w->Family("rebound_audit_steps_total", "Steps replayed by audits that ran to the end.",
              "counter");
    w->Sample("rebound_audit_steps_total", {}, a.steps_audited());
    w->Family("rebound_audit_quarantines_total",
              "Trainers fenced QUARANTINED after a confirmed mismatch.", "counter");
    w->Sample("rebound_audit_quarantines_total", {}, a.quarantined());
    w->Family("rebound_audit_mismatches_total",
              "Confirmed mismatches (AUDIT_MISMATCH) by the audited worker's registered name.",
              "counter");
    for (const auto& [worker, n] : a.confirmed_by_worker()) {
      w->Sample("rebound_audit_mismatches_total", {{"worker", worker}}, n);
    }
    w->Family("rebound_audit_auditor_faults_total",
              "Mismatches a second replay overturned, by the first auditor's registered name.",
              "counter");
    for (const auto& [worker, n] : a.auditor_faults_by_worker()) {
      w->Sample("rebound_audit_auditor_faults_total", {{"worker", worker}}, n);
    }
  }
  if (!s.recoveries().empty()) {
    const RecoveryStatus& last = s.recoveries(s.recoveries_size() - 1);
    w->Family("rebound_last_recovery_phase_seconds", "The newest recovery's phases.", "gauge");
    w->Sample("rebound_last_recovery_phase_seconds", {{"phase", "detection"}},
              last.phases().detection_ms() / 1000.0);
    w->Sample("rebound_last_recovery_phase_seconds", {{"phase", "snapshot_transfer"}},
              last.phases().snapshot_transfer_ms() / 1000.0);
    w->Sample("rebound_last_recovery_phase_seconds", {{"phase", "replay"}},
              last.phases().replay_ms() / 1000.0);
    w->Sample("rebound_last_recovery_phase_seconds", {{"phase", "takeover"}},
              last.phases().takeover_ms() / 1000.0);
  }

  const StepLogStatus& log = s.step_log();
  w->Family("rebound_steplog_records_written_total", "Step-log records committed.", "counter");
  w->Sample("rebound_steplog_records_written_total", {}, static_cast<double>(log.records_written()));
  w->Family("rebound_steplog_bytes_written_total", "Step-log bytes committed.", "counter");
  w->Sample("rebound_steplog_bytes_written_total", {}, static_cast<double>(log.bytes_written()));
  w->Family("rebound_steplog_records_dropped_total",
            "Step-log records not committed: resent duplicates, or below a newer snapshot.",
            "counter");
  w->Sample("rebound_steplog_records_dropped_total", {{"reason", "duplicate"}},
            static_cast<double>(log.duplicates_dropped()));
  w->Sample("rebound_steplog_records_dropped_total", {{"reason", "below_snapshot"}},
            static_cast<double>(log.below_snapshot_dropped()));

  if (s.has_checkpoint()) {
    const CheckpointStatus& c = s.checkpoint();
    w->Family("rebound_checkpoint_step", "GLOBAL_CHECKPOINT: the last checkpoint's step.", "gauge");
    w->Sample("rebound_checkpoint_step", {}, static_cast<double>(c.step()));
    w->Family("rebound_checkpoints_total", "GLOBAL_CHECKPOINT: checkpoints taken.", "counter");
    w->Sample("rebound_checkpoints_total", {}, static_cast<double>(c.count()));
    w->Family("rebound_checkpoint_barrier_wait_seconds_total",
              "GLOBAL_CHECKPOINT: time slots waited at barriers, summed over slots.", "counter");
    w->Sample("rebound_checkpoint_barrier_wait_seconds_total", {}, c.barrier_wait_ms() / 1000.0);
    w->Family("rebound_checkpoint_write_seconds_total",
              "GLOBAL_CHECKPOINT: time spent gathering and writing checkpoints.", "counter");
    w->Sample("rebound_checkpoint_write_seconds_total", {}, c.write_ms() / 1000.0);
    w->Family("rebound_checkpoint_rollbacks_total",
              "GLOBAL_CHECKPOINT: failures that rolled every slot back.", "counter");
    w->Sample("rebound_checkpoint_rollbacks_total", {}, static_cast<double>(c.rollbacks()));
  }
  if (s.has_group()) WriteGroup(s.group(), w);
  if (s.has_sharding()) {
    const ShardingStatus& sharding = s.sharding();
    w->Family("rebound_shard_groups", "K: the server groups the center is sharded across.",
              "gauge");
    w->Sample("rebound_shard_groups", {}, sharding.groups());
    w->Family("rebound_shard_group", "This server group's range of the center (0 coordinates).",
              "gauge");
    w->Sample("rebound_shard_group", {}, sharding.group());
  }
  if (s.has_last_eval() && s.last_eval().has_test_accuracy()) {
    w->Family("rebound_test_accuracy", "The evaluator's last test accuracy of the center, in "
                                       "[0, 1].",
              "gauge");
    w->Sample("rebound_test_accuracy", {}, s.last_eval().test_accuracy());
  }
  if (s.has_last_eval()) {
    w->Family("rebound_test_loss", "The evaluator's last test loss of the center.", "gauge");
    w->Sample("rebound_test_loss", {}, s.last_eval().test_loss());
  }
}

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewRpcMetricsFactory(
    MetricsRegistry* registry, const Clock* clock) {
  return std::make_unique<RpcMetricsFactory>(registry, clock);
}

void AddStatusMetrics(MetricsRegistry* registry, std::function<GetStatusResponse()> status,
                      const storage::DurableStore* store) {
  registry->AddCollector([status = std::move(status), store](MetricsWriter* w) {
    WriteStatus(status(), w);
    if (store == nullptr) return;
    w->Family("rebound_store_background_errors_total",
              "RocksDB background errors (corrupt SST met by a compaction, I/O errors) since the "
              "server started.",
              "counter");
    w->Sample("rebound_store_background_errors_total", {},
              static_cast<double>(store->background_errors()));
    w->Family("rebound_store_writable",
              "1 while RocksDB accepts writes, 0 after a background error (health NOT_SERVING; "
              "GetStatus storage_error says why).",
              "gauge");
    w->Sample("rebound_store_writable", {}, store->BackgroundError().ok() ? 1.0 : 0.0);
    absl::StatusOr<storage::StoreStats> stats = store->Stats();
    if (!stats.ok()) return;
    w->Family("rebound_store_bytes",
              "RocksDB bytes by column family (SST files and memtables) and the tensor files.",
              "gauge");
    for (const auto& [family, cf] : stats->column_families) {
      w->Sample("rebound_store_bytes", {{"part", family}},
                static_cast<double>(cf.approximate_bytes()));
    }
    w->Sample("rebound_store_bytes", {{"part", "tensor_files"}},
              static_cast<double>(stats->tensor_file_bytes));
    w->Family("rebound_store_steplog_keys", "Estimated step-log keys in RocksDB.", "gauge");
    w->Sample("rebound_store_steplog_keys", {}, static_cast<double>(stats->steplog_keys_estimate));
  });
}

}  // namespace rebound::server
