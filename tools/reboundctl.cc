// reboundctl: the operator's command line for a Rebound server.
//
//   reboundctl --server HOST:PORT[,HOST:PORT...] [--output table|json] [--timeout_ms N] COMMAND
//
// --server lists one server, or the members of a replicated group (docs/design.md §10.1): the calls go
// to whichever member is the leader (common/server_addresses.h).
//
// Commands:
//   health   prints the grpc.health.v1 status (SERVING, NOT_SERVING, ...)
//   status   centers, last evaluation, slots (state, owner, step, weight and its inputs) and
//            workers (role, state, incarnation, step, last heartbeat); for a sharded job
//            (docs/design.md §10.2) also K, this server's group and each stage's ranges, [begin, end)
//            per group (this group's marked *)
//   recoveries  every recovery: slot, policy, outcome, failed step, steps replayed, spares,
//               phases (detection, snapshot transfer, replay, takeover), verified bit-identical
//   audits   audit replay (docs/recovery.md#audits): the counts (windows kept and skipped,
//            replays by result, verdicts, quarantines) and each audit on record: id, slot,
//            audited worker, window, auditor, result, verdict (CONFIRMED = AUDIT_MISMATCH),
//            where a replay differed (step, tensor) and why; "audits are off" when the job has
//            none
//   workers  every worker the server knows: incarnation, name, role, state, slot, step,
//            heartbeat age, peer and metrics addresses, why it is fenced
//   watch    status, redrawn every --interval_ms until interrupted (or --count times)
//   drain R,S  asks the trainer of slot (R, S) to leave after its next sync; a spare takes the
//            slot over from that sync's snapshot, with nothing to replay
//   group    a replicated server group (docs/design.md §10.1): this member's role, the leader and
//            its epoch, the in-sync set recorded in etcd, each standby's acknowledged commit,
//            lag and state; from the leader through --server (a list of the members' addresses
//            reaches it), or with --peer HOST:PORT from any member's peer port (a standby says
//            which leader it follows and why it waits)
//   shards   a sharded job's groups: asks --server for sharding.group_addresses, then every
//            group (in parallel, --timeout_ms each) and prints a row per group: its index,
//            address, whether it answered, its role (single server, or its leader's name, epoch
//            and in-sync standbys), its center version per stage; then "all K groups answer" or
//            a DEGRADED line per group that does not answer or answers as another group. Exit 1
//            when degraded or the job is not sharded
//   export -o FILE [--format safetensors]
//            the trained model: every stage's center as committed (ExportCenter, an operator
//            call, from the leader of a group), written atomically to FILE as safetensors
//            (common/export_file.h), which PyTorch loads with safetensors.torch.load_file; the
//            built-in MLP's tensors are layer<l>.weight (out x in) and layer<l>.bias. Prints the
//            job, each stage's center version and the file's size
//   backup DIR
//            an online, consistent backup (Backup, an operator call): the store's checkpoint at
//            one commit, streamed into DIR (which must not exist or be empty) while training
//            goes on, then DIR/MANIFEST.json with every file's size and xxHash64
//            (storage/backup.h); `rebound_server --restore_from DIR` starts from it. Prints the
//            position, files, bytes and seconds. --backup_timeout_s bounds the call (600)
//   plan-logging --job FILE --budget N [--stage_ms MS,...] [--boundary_bytes B,...]
//            (offline, no server) which stage boundaries to log within a log budget of N bytes, by
//            SWIFT's greedy rule (common/logging_plan.h); --stage_ms gives each stage's measured
//            step time (S values; else multiply-adds estimate it), --boundary_bytes each
//            boundary's measured log bytes per step (S-1 values); --budget_bytes is an alias of
//            --budget
//
// Security (docs/operations.md#security): --token_file sends the server's bearer token; --tls,
// --ca_file (verify the server) and --cert_file/--key_file (mutual TLS) turn TLS on;
// --operator_token_file sends the operator token that drain and export need when the server has
// one.
//
// Exit codes (docs/operations.md): 0 success (health: SERVING), 1 the server answered but is not
// serving or refused the call, 2 the server could not be reached in time, 64 usage error.

#include <gflags/gflags.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/util/json_util.h"
#include "grpcpp/grpcpp.h"
#include "common/clock.h"
#include "common/config.h"
#include "common/export_file.h"
#include "common/file.h"
#include "common/grpc_polling.h"
#include "common/logging_plan.h"
#include "common/security.h"
#include "common/usage.h"
#include "common/version.h"
#include "server/checkpoint_transfer.h"
#include "storage/backup.h"
#include "proto/health.grpc.pb.h"
#include "proto/rebound.grpc.pb.h"
#include "proto/replication.grpc.pb.h"
#include "tools/shard_table.h"

DEFINE_string(server, "127.0.0.1:7070",
              "server host:port, or a replicated group's members as host:port,host:port,...");
DEFINE_string(peer, "",
              "group: ask this member's peer port (ServerPeer.GetGroup) instead of the leader "
              "through --server; works on standbys");
DEFINE_string(output, "table", "table|json");
DEFINE_int32(timeout_ms, 5000, "deadline of each call, ms");
DEFINE_int32(interval_ms, 1000, "watch: time between refreshes, ms");
DEFINE_string(token_file, "", "file whose first line is the server's bearer token");
DEFINE_string(operator_token_file, "",
              "file whose first line is the server's operator token (for drain)");
DEFINE_string(ca_file, "", "TLS: PEM CA bundle to verify the server (turns TLS on)");
DEFINE_string(cert_file, "", "TLS: this client's PEM certificate (mutual TLS)");
DEFINE_string(key_file, "", "TLS: this client's PEM private key (mutual TLS)");
DEFINE_bool(tls, false, "TLS with the system's CA roots (or --ca_file)");
DEFINE_string(job, "", "plan-logging: the job config file");
DEFINE_int64(budget, -1, "plan-logging: bytes the step log may hold at most");
DEFINE_int64(budget_bytes, -1, "plan-logging: alias of --budget");
DEFINE_string(stage_ms, "",
              "plan-logging: measured ms per step of each stage, S comma-separated numbers > 0");
DEFINE_string(boundary_bytes, "",
              "plan-logging: measured log bytes per step of boundaries 1..S-1, comma-separated");
DEFINE_string(o, "", "export: the file to write the model to");
DEFINE_int32(backup_timeout_s, 600, "backup: the deadline of the whole backup, s");
DEFINE_double(backup_max_mb_s, 0,
              "backup: pace the server's stream to at most this many MB (10^6 bytes) per "
              "second, so that it takes less from training; 0 = unpaced");
DEFINE_string(format, "safetensors", "export: the file's format (safetensors)");
DEFINE_int32(count, 0, "watch: refreshes before exiting; 0 = until interrupted");

namespace rebound::ctl {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUnreachable = 2;
constexpr int kExitUsage = 64;

void SetDeadline(grpc::ClientContext* context) {
  context->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(FLAGS_timeout_ms));
}

// Reports a failed call and returns the exit code for it.
int ReportError(const grpc::Status& status) {
  const bool unreachable = status.error_code() == grpc::StatusCode::UNAVAILABLE ||
                           status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
  if (unreachable) {
    std::cerr << "reboundctl: cannot reach the server at " << FLAGS_server << " within "
              << FLAGS_timeout_ms << " ms: " << status.error_message() << "\n";
    return kExitUnreachable;
  }
  std::cerr << "reboundctl: the server at " << FLAGS_server << " answered "
            << status.error_code() << ": " << status.error_message() << "\n";
  return kExitFailed;
}

int Health(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->Check(&context, request, &response);
  if (!status.ok()) return ReportError(status);
  const std::string name =
      grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
  if (FLAGS_output == "json") {
    std::cout << "{\"status\":\"" << name << "\"}\n";
  } else {
    std::cout << name << "\n";
  }
  return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk
                                                                              : kExitFailed;
}

std::string Slot(const SlotId& slot) {
  return absl::StrCat("(", slot.replica(), ",", slot.stage(), ")");
}

std::string Ago(int64_t ms) {
  if (ms < 10000) return absl::StrCat(ms, "ms");
  return absl::StrCat(ms / 1000, "s");
}

void PrintWorkersTable(const GetStatusResponse& s, bool addresses) {
  // FAULT: the decaying fault score of the worker's name (it follows the worker, docs/design.md §4.5).
  std::printf("%-22s %-24s %-10s %-11s %-8s %8s %6s %10s  %s\n", "INCARNATION", "NAME", "ROLE",
              "STATE", "SLOT", "STEP", "FAULT", "HEARTBEAT",
              addresses ? "PEER / METRICS / REASON" : "REASON");
  for (const WorkerStatus& w : s.workers()) {
    std::string last = w.state_reason();
    if (addresses) {
      last = absl::StrCat(w.peer_address().empty() ? "-" : w.peer_address(), " / ",
                          w.metrics_address().empty() ? "-" : w.metrics_address(),
                          last.empty() ? "" : " / ", last);
    }
    if (w.waiting_for_task()) last = absl::StrCat("waiting for a task", last.empty() ? "" : "; ", last);
    if (w.replay_task() != 0) last = absl::StrCat("in task ", w.replay_task(), last.empty() ? "" : "; ", last);
    std::printf("%-22llu %-24s %-10s %-11s %-8s %8lld %6.3f %10s  %s\n",
                static_cast<unsigned long long>(w.incarnation()), w.name().c_str(),
                WorkerRole_Name(w.role()).c_str(), WorkerState_Name(w.state()).c_str(),
                w.has_slot() ? Slot(w.slot()).c_str() : "-", static_cast<long long>(w.step()),
                w.fault_score(), (Ago(w.last_heartbeat_ms_ago()) + " ago").c_str(), last.c_str());
  }
}

void PrintGroupTable(const GroupStatus& g) {
  std::printf("group %s: %s is %s", g.group().c_str(), g.name().c_str(),
              GroupStatus::Role_Name(g.role()).c_str());
  if (g.role() == GroupStatus::LEADER) {
    std::printf(" (epoch %lld, %s, last commit %llu)", static_cast<long long>(g.epoch()),
                g.sync() ? "sync" : "async", static_cast<unsigned long long>(g.last_sequence()));
  } else if (!g.leader_name().empty()) {
    std::printf("; leader %s at %s (peer %s, epoch %lld)", g.leader_name().c_str(),
                g.leader_address().c_str(), g.leader_peer_address().c_str(),
                static_cast<long long>(g.epoch()));
  }
  std::printf("\n");
  if (g.role() == GroupStatus::LEADER) {
    int in_sync = 0;
    for (const StandbyStatus& standby : g.standbys()) in_sync += standby.in_sync() ? 1 : 0;
    std::printf("in-sync set (etcd): [%s]; %d of %d standbys in sync%s\n",
                absl::StrJoin(g.in_sync(), ", ").c_str(), in_sync, g.standbys_configured(),
                in_sync < g.standbys_configured()
                    ? " (DEGRADED: what is answered now is lost with the leader's host)"
                    : "");
    if (g.standbys_size() > 0) {
      std::printf("%-16s %-22s %-8s %10s %8s %8s  %s\n", "STANDBY", "PEER", "IN SYNC", "ACKED",
                  "LAG", "LAG MS", "STATE");
      for (const StandbyStatus& standby : g.standbys()) {
        std::printf("%-16s %-22s %-8s %10llu %8llu %8lld  %s\n", standby.name().c_str(),
                    standby.peer_address().c_str(), standby.in_sync() ? "yes" : "no",
                    static_cast<unsigned long long>(standby.acked_sequence()),
                    static_cast<unsigned long long>(standby.lag_commits()),
                    static_cast<long long>(standby.lag_ms()), standby.state().c_str());
      }
    }
  }
  if (!g.detail().empty() && g.role() != GroupStatus::LEADER) {
    std::printf("%s\n", g.detail().c_str());
  }
}

void PrintStatusTable(const GetStatusResponse& s) {
  std::printf("job %s  (%s, up %s)  topology %d x %d  weighting %s  recovery %s\n",
              s.job_id().c_str(), s.server_version().c_str(), Ago(s.uptime_ms()).c_str(),
              s.replicas(), s.stages(), WeightingPolicy_Name(s.weighting()).c_str(),
              RecoveryPolicy_Name(s.recovery_policy()).c_str());
  for (const CenterStatus& center : s.centers()) {
    std::printf("center stage %d: version %lld, %lld parameters\n", center.stage(),
                static_cast<long long>(center.version()),
                static_cast<long long>(center.parameter_count()));
  }
  if (s.has_sharding()) {
    const ShardingStatus& sharding = s.sharding();
    const int group = sharding.group();
    std::printf("center sharded across %d groups; this server is group %d (%s) and holds the "
                "ranges marked *:\n%s",
                sharding.groups(), group,
                group < sharding.group_addresses_size()
                    ? sharding.group_addresses(group).c_str()
                    : "?",
                tools::FormatRanges(sharding, group).c_str());
  }
  if (s.has_last_eval()) {
    const std::string accuracy =
        s.last_eval().has_test_accuracy()
            ? absl::StrFormat("test accuracy %.2f%%, ", 100.0 * s.last_eval().test_accuracy())
            : std::string();
    std::printf("%stest loss %.4f (center version %lld, %s ago)\n", accuracy.c_str(),
                s.last_eval().test_loss(), static_cast<long long>(s.last_eval().center_version()),
                Ago(s.last_eval().reported_ms_ago()).c_str());
  }
  if (s.has_checkpoint()) {
    const CheckpointStatus& c = s.checkpoint();
    std::printf("global checkpoint every %lld steps: last at step %lld (%lld taken, %lld bytes), "
                "barrier wait %lld ms, writes %lld ms, %lld rollbacks%s\n",
                static_cast<long long>(c.every_steps()), static_cast<long long>(c.step()),
                static_cast<long long>(c.count()), static_cast<long long>(c.bytes()),
                static_cast<long long>(c.barrier_wait_ms()), static_cast<long long>(c.write_ms()),
                static_cast<long long>(c.rollbacks()),
                c.pending_step() > 0 ? absl::StrCat("; ", c.pending_arrived(),
                                                    " slot(s) wait at step ", c.pending_step())
                                           .c_str()
                                     : "");
  }
  if (s.has_ettr()) {
    // docs/metrics.md#goodput: this server life's accounts, over every slot.
    const SlotGoodput& g = s.goodput();
    std::printf("goodput: ETTR %.3f so far (productive %.1f s; lost: detect %.1f s, replay %.1f "
                "s, restore %.1f s, rollback %.1f s (%lld steps), idle %.1f s)\n",
                s.ettr(), g.goodput_seconds(), g.detect_seconds(), g.replay_seconds(),
                g.restore_seconds(), g.rollback_seconds(),
                static_cast<long long>(g.steps_discarded()), g.idle_seconds());
  }
  if (s.has_group()) PrintGroupTable(s.group());
  if (s.has_storage_error()) {
    std::printf("STORAGE ERROR (writes refused, health NOT_SERVING): %s\n",
                s.storage_error().c_str());
  }
  std::printf("\n%-8s %-11s %-22s %8s %8s %8s  %6s %6s %6s %6s %6s  %s\n", "SLOT", "STATE",
              "OWNER", "STEP", "SYNCED", "LOGGED", "WEIGHT", "STALE", "LATE", "DIV", "FAULT",
              "DETAIL");
  for (const SlotStatus& slot : s.slots()) {
    const WeightInputs& w = slot.weight();
    std::printf("%-8s %-11s %-22s %8lld %8lld %8lld  %6.3f %6.2f %6.2f %6.2f %6.3f  %s\n",
                Slot(slot.slot()).c_str(), SlotState_Name(slot.state()).c_str(),
                slot.owner_incarnation() ? absl::StrCat(slot.owner_incarnation()).c_str() : "-",
                static_cast<long long>(slot.step()), static_cast<long long>(slot.snapshot_step()),
                static_cast<long long>(slot.logged_step()),
                w.weight(), w.staleness(), w.lateness(), w.divergence(), w.fault_score(),
                slot.detail().c_str());
  }
  std::printf("\n");
  PrintWorkersTable(s, /*addresses=*/false);
}

int Status(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = ParameterServer::NewStub(channel);
  GetStatusRequest request;
  GetStatusResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->GetStatus(&context, request, &response);
  if (!status.ok()) return ReportError(status);
  if (FLAGS_output == "json") {
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    google::protobuf::util::MessageToJsonString(response, &json, options);
    std::cout << json << "\n";
  } else {
    PrintStatusTable(response);
  }
  return kExitOk;
}

void PrintJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  google::protobuf::util::MessageToJsonString(message, &json, options);
  std::cout << json << "\n";
}

// The replicated group (docs/design.md §10.1): from the leader's GetStatus, or with --peer from any
// member's ServerPeer.GetGroup (a standby names the leader it follows).
int Group(const std::shared_ptr<grpc::Channel>& channel, const SecurityConfig& security) {
  GroupStatus group;
  grpc::ClientContext context;
  SetDeadline(&context);
  if (!FLAGS_peer.empty()) {
    auto peer = MakeChannel(FLAGS_peer, security, grpc::ChannelArguments());
    if (!peer.ok()) {
      std::cerr << "reboundctl: " << peer.status().message() << "\n";
      return kExitUsage;
    }
    auto stub = ServerPeer::NewStub(*peer);
    const grpc::Status status = stub->GetGroup(&context, GetGroupRequest(), &group);
    if (!status.ok()) return ReportError(status);
  } else {
    auto stub = ParameterServer::NewStub(channel);
    GetStatusResponse response;
    const grpc::Status status = stub->GetStatus(&context, GetStatusRequest(), &response);
    if (!status.ok()) return ReportError(status);
    if (!response.has_group()) {
      std::cerr << "reboundctl: the server at " << FLAGS_server
                << " is a single server (no replication block)\n";
      return kExitFailed;
    }
    group = response.group();
  }
  if (FLAGS_output == "json") {
    PrintJson(group);
  } else {
    PrintGroupTable(group);
  }
  return kExitOk;
}

void PrintRecoveries(const GetStatusResponse& s) {
  if (s.recoveries_size() == 0) {
    std::printf("no recoveries\n");
    return;
  }
  std::printf("%-5s %-7s %-20s %-10s %8s %8s %6s %9s %9s %9s %9s %-8s  %s\n", "TASK", "SLOT",
              "POLICY", "OUTCOME", "FAILED@", "REPLAYED", "SPARES", "DETECT", "TRANSFER", "REPLAY",
              "TAKEOVER", "VERIFIED", "DETAIL");
  for (const RecoveryStatus& r : s.recoveries()) {
    const RecoveryPhases& p = r.phases();
    std::printf("%-5llu %-7s %-20s %-10s %8lld %8lld %6d %7lldms %7lldms %7lldms %7lldms %-8s  %s\n",
                static_cast<unsigned long long>(r.task_id()), Slot(r.slot()).c_str(),
                RecoveryPolicy_Name(r.policy()).c_str(),
                r.has_outcome() ? RecoveryOutcome_Name(r.outcome()).c_str() : "RUNNING",
                static_cast<long long>(r.failed_step()),
                static_cast<long long>(r.steps_replayed()), r.spares_size(),
                static_cast<long long>(p.detection_ms()),
                static_cast<long long>(p.snapshot_transfer_ms()),
                static_cast<long long>(p.replay_ms()), static_cast<long long>(p.takeover_ms()),
                r.verified() ? "yes" : "no", r.detail().c_str());
  }
}

void PrintAudits(const GetStatusResponse& s) {
  if (!s.has_audit_counts()) {
    std::printf("audits are off (the job has no audit.fraction > 0)\n");
    return;
  }
  const AuditCounts& c = s.audit_counts();
  std::printf("windows kept %lld, skipped %lld, expired %lld, unread %lld; replays matched %lld, "
              "mismatched %lld, incomplete %lld, preempted %lld; steps audited %lld\n",
              static_cast<long long>(c.windows_chosen()), static_cast<long long>(c.windows_skipped()),
              static_cast<long long>(c.expired()), static_cast<long long>(c.windows_unread()),
              static_cast<long long>(c.matched()),
              static_cast<long long>(c.mismatched()), static_cast<long long>(c.incomplete()),
              static_cast<long long>(c.preempted()), static_cast<long long>(c.steps_audited()));
  std::printf("verdicts: %lld confirmed (AUDIT_MISMATCH), %lld auditor faults, %lld inconclusive; "
              "%lld quarantined\n",
              static_cast<long long>(c.confirmed()), static_cast<long long>(c.auditor_faults()),
              static_cast<long long>(c.inconclusive()), static_cast<long long>(c.quarantined()));
  if (s.audits_size() == 0) return;
  std::printf("%-6s %-7s %-20s %-15s %-20s %-17s %-20s %-18s  %s\n", "AUDIT", "SLOT", "WORKER",
              "WINDOW", "AUDITOR", "RESULT", "VERDICT", "WHERE", "DETAIL");
  for (const AuditStatus& a : s.audits()) {
    std::string window = absl::StrCat("(", a.from_step(), ", ", a.to_step(), "]");
    std::string where = "-";
    if (a.has_mismatch()) {
      where = absl::StrCat("step ", a.mismatch().step());
      if (!a.mismatch().tensor_name().empty()) absl::StrAppend(&where, " ", a.mismatch().tensor_name());
    }
    std::string result = a.has_result()     ? AuditResult_Name(a.result())
                         : a.auditor() != 0 ? "RUNNING"
                         : a.has_ended_ms_ago() ? "-"
                                                : "WAITING";
    std::string verdict = a.has_verdict() ? AuditVerdict_Name(a.verdict()) : "-";
    if (a.confirms() != 0) absl::StrAppend(&verdict, " (2nd of ", a.confirms(), ")");
    std::printf("%-6llu %-7s %-20s %-15s %-20s %-17s %-20s %-18s  %s\n",
                static_cast<unsigned long long>(a.audit_id()), Slot(a.slot()).c_str(),
                a.worker().c_str(), window.c_str(),
                a.auditor_name().empty() ? "-" : a.auditor_name().c_str(), result.c_str(),
                verdict.c_str(), where.c_str(), a.detail().c_str());
  }
}

int Audits(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = ParameterServer::NewStub(channel);
  GetStatusResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) return ReportError(status);
  if (FLAGS_output == "json") {
    GetStatusResponse audits;
    *audits.mutable_audits() = response.audits();
    if (response.has_audit_counts()) *audits.mutable_audit_counts() = response.audit_counts();
    PrintJson(audits);
  } else {
    PrintAudits(response);
  }
  return kExitOk;
}

int Recoveries(const std::shared_ptr<grpc::Channel>& channel) {
  auto stub = ParameterServer::NewStub(channel);
  GetStatusResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  const grpc::Status status = stub->GetStatus(&context, GetStatusRequest(), &response);
  if (!status.ok()) return ReportError(status);
  if (FLAGS_output == "json") {
    std::string json = "[";
    google::protobuf::util::JsonPrintOptions options;
    options.preserve_proto_field_names = true;
    for (int i = 0; i < response.recoveries_size(); ++i) {
      std::string one;
      google::protobuf::util::MessageToJsonString(response.recoveries(i), &one, options);
      json += (i ? "," : "") + one;
    }
    std::cout << json << "]\n";
  } else {
    PrintRecoveries(response);
  }
  return kExitOk;
}

std::string Json(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  google::protobuf::util::MessageToJsonString(message, &json, options);
  return json;
}

absl::StatusOr<GetStatusResponse> FetchStatus(const std::shared_ptr<grpc::Channel>& channel,
                                              grpc::Status* failure) {
  auto stub = ParameterServer::NewStub(channel);
  GetStatusResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  *failure = stub->GetStatus(&context, GetStatusRequest(), &response);
  if (!failure->ok()) return absl::UnavailableError(failure->error_message());
  return response;
}

// A sharded job's groups (docs/design.md §10.2): the addresses from --server's reply, then one
// GetStatus of each group, all at once (a group that does not answer costs --timeout_ms, not
// --timeout_ms per group).
int Shards(const std::shared_ptr<grpc::Channel>& channel, const SecurityConfig& security) {
  grpc::Status failure;
  auto first = FetchStatus(channel, &failure);
  if (!first.ok()) return ReportError(failure);
  if (!first->has_sharding()) {
    std::cerr << "reboundctl: the job at " << FLAGS_server
              << " is not sharded (sharding.groups 1: one server group holds the whole center)\n";
    return kExitFailed;
  }
  const ShardingStatus& sharding = first->sharding();
  std::vector<tools::ShardGroupView> views(sharding.group_addresses_size());
  std::vector<std::thread> askers;
  for (int g = 0; g < sharding.group_addresses_size(); ++g) {
    views[g].group = g;
    views[g].address = sharding.group_addresses(g);
    askers.emplace_back([&view = views[g], &security] {
      auto made = MakeChannel(view.address, security, grpc::ChannelArguments());
      if (!made.ok()) {
        view.error = std::string(made.status().message());
        return;
      }
      grpc::Status failed;
      auto status = FetchStatus(*made, &failed);
      if (status.ok()) {
        view.status = *std::move(status);
      } else {
        view.error = absl::StrCat(
            absl::StatusCodeToString(static_cast<absl::StatusCode>(failed.error_code())), ": ",
            failed.error_message());
      }
    });
  }
  for (std::thread& asker : askers) asker.join();
  if (FLAGS_output == "json") {
    std::cout << tools::ShardTableJson(views) << "\n";
  } else {
    std::printf("job %s: center sharded across %d groups (asked through %s, group %d)\n%s",
                first->job_id().c_str(), sharding.groups(), FLAGS_server.c_str(),
                sharding.group(), tools::FormatShardTable(views).c_str());
  }
  return tools::Degraded(views) ? kExitFailed : kExitOk;
}

int Workers(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::Status failure;
  auto status = FetchStatus(channel, &failure);
  if (!status.ok()) return ReportError(failure);
  if (FLAGS_output == "json") {
    std::string json = "[";
    for (int i = 0; i < status->workers_size(); ++i) {
      json += (i ? "," : "") + Json(status->workers(i));
    }
    std::cout << json << "]\n";
  } else {
    PrintWorkersTable(*status, /*addresses=*/true);
  }
  return kExitOk;
}

// Redraws the status table until interrupted or --count refreshes. A server that stops
// answering is reported on the screen and polled again; one never reached is exit 2.
int Watch(const std::shared_ptr<grpc::Channel>& channel) {
  if (FLAGS_interval_ms < 100) {
    std::cerr << "reboundctl: --interval_ms must be >= 100\n";
    return kExitUsage;
  }
  bool reached = false;
  for (int i = 0; FLAGS_count == 0 || i < FLAGS_count; ++i) {
    if (i > 0) DefaultClock()->WaitFor(absl::Milliseconds(FLAGS_interval_ms), nullptr);
    grpc::Status failure;
    auto status = FetchStatus(channel, &failure);
    if (FLAGS_output == "json") {
      if (status.ok()) std::cout << Json(*status) << "\n" << std::flush;
    } else {
      std::printf("\033[H\033[2J");  // home, clear
      std::printf("reboundctl watch %s every %d ms (%s)\n\n", FLAGS_server.c_str(),
                  FLAGS_interval_ms,
                  absl::FormatTime("%H:%M:%S", DefaultClock()->Now(), absl::LocalTimeZone())
                      .c_str());
      if (status.ok()) {
        PrintStatusTable(*status);
      } else {
        std::printf("cannot reach the server: %s\n", failure.error_message().c_str());
      }
      std::fflush(stdout);
    }
    if (status.ok()) {
      reached = true;
    } else if (!reached && i == 0) {
      return ReportError(failure);
    }
  }
  return kExitOk;
}

// Adds --operator_token_file's token to an operator call; false (having said why) when the file
// cannot be read.
bool AddOperatorToken(grpc::ClientContext* context) {
  if (FLAGS_operator_token_file.empty()) return true;
  auto token = ReadBearerToken(FLAGS_operator_token_file);
  if (!token.ok()) {
    std::cerr << "reboundctl: --operator_token_file: " << token.status().message() << "\n";
    return false;
  }
  context->AddMetadata(kOperatorTokenKey, *token);
  return true;
}

int Export(const std::shared_ptr<grpc::Channel>& channel) {
  if (FLAGS_o.empty()) {
    std::cerr << "reboundctl: export needs -o FILE\n";
    return kExitUsage;
  }
  if (FLAGS_format != "safetensors") {
    std::cerr << "reboundctl: --format: safetensors is the one format export writes, got '"
              << FLAGS_format << "'\n";
    return kExitUsage;
  }
  auto stub = ParameterServer::NewStub(channel);
  ExportCenterResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  if (!AddOperatorToken(&context)) return kExitUsage;
  const grpc::Status status = stub->ExportCenter(&context, ExportCenterRequest(), &response);
  if (!status.ok()) return ReportError(status);
  absl::StatusOr<std::string> bytes = ExportToSafetensors(response);
  if (!bytes.ok()) {
    std::cerr << "reboundctl: export: " << bytes.status().message() << "\n";
    return kExitFailed;
  }
  if (absl::Status written = WriteFileDurably(FLAGS_o, *bytes); !written.ok()) {
    std::cerr << "reboundctl: export: " << written.message() << "\n";
    return kExitFailed;
  }
  std::vector<int64_t> versions;
  int tensors = 0;
  for (const ExportedStage& stage : response.stages()) {
    versions.push_back(stage.center_version());
    tensors += stage.center().tensors_size();
  }
  if (FLAGS_output == "json") {
    std::cout << "{\"file\": \"" << FLAGS_o << "\", \"bytes\": " << bytes->size()
              << ", \"job_id\": \"" << response.job_id() << "\", \"center_versions\": ["
              << absl::StrJoin(versions, ", ") << "], \"tensors\": " << tensors << "}\n";
  } else {
    std::printf("exported job '%s' (center version %s; %d tensors) to %s: %zu bytes, safetensors\n",
                response.job_id().c_str(), absl::StrJoin(versions, ",").c_str(), tensors,
                FLAGS_o.c_str(), bytes->size());
  }
  return kExitOk;
}

int Backup(const std::shared_ptr<grpc::Channel>& channel, const std::string& dir) {
  if (!(FLAGS_backup_max_mb_s >= 0) || !std::isfinite(FLAGS_backup_max_mb_s)) {
    std::cerr << "reboundctl: backup: --backup_max_mb_s must be >= 0, got " << FLAGS_backup_max_mb_s
              << "\n";
    return kExitUsage;
  }
  std::error_code error;
  if (std::filesystem::exists(dir, error) && !std::filesystem::is_empty(dir, error)) {
    std::cerr << "reboundctl: backup: " << dir << " is not empty\n";
    return kExitUsage;
  }
  std::filesystem::create_directories(dir, error);
  if (error) {
    std::cerr << "reboundctl: backup: creating " << dir << ": " << error.message() << "\n";
    return kExitFailed;
  }
  auto stub = ParameterServer::NewStub(channel);
  GetStatusResponse status;
  {
    grpc::ClientContext context;
    SetDeadline(&context);
    const grpc::Status got = stub->GetStatus(&context, GetStatusRequest(), &status);
    if (!got.ok()) return ReportError(got);
  }
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(FLAGS_backup_timeout_s));
  if (!AddOperatorToken(&context)) return kExitUsage;
  BackupRequest request;
  request.set_max_bytes_per_second(static_cast<int64_t>(FLAGS_backup_max_mb_s * 1e6));
  std::unique_ptr<grpc::ClientReader<CheckpointChunk>> reader = stub->Backup(&context, request);
  absl::StatusOr<CheckpointChunk> done =
      server::ReceiveCheckpoint(reader.get(), &context, dir, FLAGS_server);
  if (!done.ok()) {
    std::filesystem::remove_all(dir, error);
    const grpc::StatusCode code = static_cast<grpc::StatusCode>(done.status().code());
    return ReportError(grpc::Status(code, std::string(done.status().message())));
  }
  storage::BackupInfo info;
  info.epoch = done->epoch();
  info.sequence = done->sequence();
  info.server_version = status.server_version();
  if (done->has_data_format_version()) info.data_format_version = done->data_format_version();
  info.created_unix_ms = absl::ToUnixMillis(absl::Now());
  absl::StatusOr<storage::BackupInfo> written = storage::WriteBackupManifest(dir, info);
  if (!written.ok()) {
    std::cerr << "reboundctl: backup: " << written.status().message() << "\n";
    return kExitFailed;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (FLAGS_output == "json") {
    std::cout << "{\"dir\": \"" << dir << "\", \"epoch\": " << written->epoch
              << ", \"sequence\": " << written->sequence << ", \"files\": " << written->files
              << ", \"bytes\": " << written->bytes << ", \"seconds\": " << seconds << "}\n";
  } else {
    std::printf("backed up job '%s' at commit (epoch %llu, sequence %llu) to %s: %lld files, "
                "%lld bytes, %.2f s\n",
                status.job_id().c_str(), static_cast<unsigned long long>(written->epoch),
                static_cast<unsigned long long>(written->sequence), dir.c_str(),
                static_cast<long long>(written->files), static_cast<long long>(written->bytes),
                seconds);
  }
  return kExitOk;
}

int Drain(const std::shared_ptr<grpc::Channel>& channel, const std::string& slot_text) {
  const std::vector<std::string> parts = absl::StrSplit(slot_text, ',');
  int replica = -1;
  int stage = -1;
  if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &replica) ||
      !absl::SimpleAtoi(parts[1], &stage) || replica < 0 || stage < 0) {
    std::cerr << "reboundctl: drain takes a slot as REPLICA,STAGE (e.g. 1,0), got '" << slot_text
              << "'\n";
    return kExitUsage;
  }
  auto stub = ParameterServer::NewStub(channel);
  DrainRequest request;
  request.mutable_slot()->set_replica(replica);
  request.mutable_slot()->set_stage(stage);
  DrainResponse response;
  grpc::ClientContext context;
  SetDeadline(&context);
  if (!AddOperatorToken(&context)) return kExitUsage;
  const grpc::Status status = stub->Drain(&context, request, &response);
  if (!status.ok()) return ReportError(status);
  if (FLAGS_output == "json") {
    std::cout << Json(response) << "\n";
  } else {
    std::printf("draining slot (%d,%d): its trainer (incarnation %llu) leaves after its next "
                "sync\n",
                replica, stage, static_cast<unsigned long long>(response.incarnation()));
  }
  return kExitOk;
}

// Parses the comma-separated list of `flag` into *values: `count` numbers that `parse` accepts.
// On a wrong count or a bad number prints a usage error naming the flag and returns false.
template <typename T, typename Parse>
bool ParseList(const std::string& flag, const std::string& text, int count, const char* what,
               Parse parse, std::vector<T>* values) {
  values->clear();
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    T value{};
    if (!parse(absl::StripAsciiWhitespace(part), &value)) {
      std::cerr << "reboundctl: --" << flag << ": '" << part << "' is not " << what << "\n";
      return false;
    }
    values->push_back(value);
  }
  if (static_cast<int>(values->size()) != count) {
    std::cerr << "reboundctl: --" << flag << " needs " << count << " comma-separated values, got "
              << values->size() << "\n";
    return false;
  }
  return true;
}

int PlanLoggingCommand() {
  const bool budget_set = !gflags::GetCommandLineFlagInfoOrDie("budget").is_default;
  const bool alias_set = !gflags::GetCommandLineFlagInfoOrDie("budget_bytes").is_default;
  if (budget_set && alias_set && FLAGS_budget != FLAGS_budget_bytes) {
    std::cerr << "reboundctl: --budget and --budget_bytes (its alias) disagree\n";
    return kExitUsage;
  }
  const int64_t budget = budget_set ? FLAGS_budget : FLAGS_budget_bytes;
  if (FLAGS_job.empty() || !(budget_set || alias_set) || budget < 0) {
    std::cerr << "reboundctl: plan-logging needs --job FILE and --budget N (bytes, >= 0)\n";
    return kExitUsage;
  }
  auto job = LoadJobConfig(FLAGS_job);
  if (!job.ok()) {
    std::cerr << "reboundctl: " << job.status().message() << "\n";
    return kExitUsage;
  }
  const int stages = static_cast<int>(StageLayerStarts(*job).size()) - 1;
  MeasuredCosts measured;
  const auto positive_ms = [](absl::string_view text, double* ms) {
    return absl::SimpleAtod(text, ms) && std::isfinite(*ms) && *ms > 0;
  };
  const auto positive_bytes = [](absl::string_view text, int64_t* bytes) {
    return absl::SimpleAtoi(text, bytes) && *bytes > 0;
  };
  if (!FLAGS_stage_ms.empty() &&
      !ParseList("stage_ms", FLAGS_stage_ms, stages, "a finite number > 0 (ms)", positive_ms,
                 &measured.stage_ms)) {
    return kExitUsage;
  }
  if (!FLAGS_boundary_bytes.empty() &&
      !ParseList("boundary_bytes", FLAGS_boundary_bytes, stages - 1, "a whole number of bytes > 0",
                 positive_bytes, &measured.boundary_bytes_per_step)) {
    return kExitUsage;
  }
  auto plan = PlanLogging(*job, budget, measured);
  if (!plan.ok()) {
    std::cerr << "reboundctl: " << plan.status().message() << "\n";
    return kExitUsage;
  }
  std::cout << FormatLoggingPlan(*job, budget, *plan);
  return kExitOk;
}

constexpr char kUsage[] =
    "usage: reboundctl [--server HOST:PORT[,HOST:PORT...]] [--output table|json] [--timeout_ms N]\n"
    "                  [--token_file F] [--tls] [--ca_file F] [--cert_file F --key_file F]\n"
    "                  [--operator_token_file F] COMMAND\n"
    "  health | status | workers | recoveries | audits | watch [--interval_ms N --count N] | drain R,S\n"
    "  group [--peer HOST:PORT]   (a replicated server group: leader, standbys, in-sync, lag)\n"
    "  shards                     (a sharded job: every group, reachable?, role, versions)\n"
    "  export -o FILE [--format safetensors]   (the trained model; an operator call)\n"
    "  backup DIR [--backup_timeout_s N] [--backup_max_mb_s R]\n"
    "                                          (an online backup; an operator call)\n"
    "  plan-logging --job FILE --budget N [--stage_ms MS,...] [--boundary_bytes B,...]"
    "   (offline)\n";

int Main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << kUsage;
    return kExitUsage;
  }
  if (FLAGS_output != "table" && FLAGS_output != "json") {
    std::cerr << "reboundctl: --output must be table or json, got '" << FLAGS_output << "'\n";
    return kExitUsage;
  }
  if (FLAGS_timeout_ms <= 0) {
    std::cerr << "reboundctl: --timeout_ms must be > 0\n";
    return kExitUsage;
  }
  if (std::string(argv[1]) == "plan-logging") {
    if (argc != 2) {
      std::cerr << kUsage;
      return kExitUsage;
    }
    return PlanLoggingCommand();
  }
  SecurityConfig security;
  security.set_token_file(FLAGS_token_file);
  if (FLAGS_tls || !FLAGS_ca_file.empty() || !FLAGS_cert_file.empty()) {
    security.mutable_tls()->set_ca_file(FLAGS_ca_file);
    security.mutable_tls()->set_cert_file(FLAGS_cert_file);
    security.mutable_tls()->set_key_file(FLAGS_key_file);
  }
  if (FLAGS_cert_file.empty() != FLAGS_key_file.empty()) {
    std::cerr << "reboundctl: --cert_file and --key_file go together\n";
    return kExitUsage;
  }
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);  // an export holds the whole model
  auto made = MakeChannel(FLAGS_server, security, channel_args);
  if (!made.ok()) {
    std::cerr << "reboundctl: " << made.status().message() << "\n";
    // A group member whose name does not resolve: unreachable, as a single server's would be.
    return made.status().code() == absl::StatusCode::kUnavailable ? kExitUnreachable : kExitUsage;
  }
  std::shared_ptr<grpc::Channel> channel = *std::move(made);
  const std::string command = argv[1];
  const int args = argc - 2;
  if (command == "backup") {
    if (args != 1) {
      std::cerr << "reboundctl: backup takes one directory\n" << kUsage;
      return kExitUsage;
    }
    return Backup(channel, argv[2]);
  }
  if (command == "drain") {
    if (args != 1) {
      std::cerr << "reboundctl: drain takes one slot, REPLICA,STAGE\n" << kUsage;
      return kExitUsage;
    }
    return Drain(channel, argv[2]);
  }
  if (args != 0) {
    std::cerr << "reboundctl: " << command << " takes no arguments\n" << kUsage;
    return kExitUsage;
  }
  if (command == "health") return Health(channel);
  if (command == "status") return Status(channel);
  if (command == "workers") return Workers(channel);
  if (command == "recoveries") return Recoveries(channel);
  if (command == "audits") return Audits(channel);
  if (command == "watch") return Watch(channel);
  if (command == "group") return Group(channel, security);
  if (command == "shards") return Shards(channel, security);
  if (command == "export") return Export(channel);
  std::cerr << "reboundctl: unknown command '" << command << "'\n" << kUsage;
  return kExitUsage;
}

}  // namespace
}  // namespace rebound::ctl

constexpr char kUsageFooter[] =
    "Exit codes: 0 success (health: SERVING); 1 the server answered but is not serving or refused\n"
    "the call; 2 the server could not be reached within --timeout_ms; 64 usage error.\n";

int main(int argc, char** argv) {
  rebound::ExitIfVersionFlag(argc, argv);
  rebound::ExitIfHelpFlag(argc, argv,
                          rebound::UsageText(rebound::ctl::kUsage, __FILE__, kUsageFooter));
  // A usage error is 64 (EX_USAGE), not gflags' exit 1.
  if (const absl::Status flags = rebound::CheckCommandLineFlags(argc, argv); !flags.ok()) {
    std::cerr << "reboundctl: " << flags.message() << "\n"
              << rebound::ctl::kUsage << "(--help: every flag)\n";
    return rebound::ctl::kExitUsage;
  }
  rebound::ShortenGrpcBackupPolling();
  gflags::SetUsageMessage("reboundctl [flags] COMMAND (--help: the commands and flags)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return rebound::ctl::Main(argc, argv);
}
