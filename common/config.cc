#include "common/config.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <tuple>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/file.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"

namespace rebound {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::TextFormat;

// Collects protobuf's syntax errors as "file:line:col: message".
class ErrorCollector : public google::protobuf::io::ErrorCollector {
 public:
  ErrorCollector(std::string file, const std::string& text)
      : file_(std::move(file)), lines_(absl::StrSplit(text, '\n')) {}
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    PointAtEnumValue(message, &line, &column);
    errors_.push_back(absl::StrCat(file_, ":", line + 1, ":", column + 1, ": ", message));
  }
  void AddWarning(int line, google::protobuf::io::ColumnNumber column,
                  const std::string& message) override {
    AddError(line, column, message);
  }
  const std::vector<std::string>& errors() const { return errors_; }

 private:
  // protobuf reports an unknown enum value at the token after it, often the next line; move the
  // location back to the value itself so the message points where the mistake is.
  void PointAtEnumValue(const std::string& message, int* line,
                        google::protobuf::io::ColumnNumber* column) const {
    const std::string prefix = "Unknown enumeration value of \"";
    if (message.rfind(prefix, 0) != 0) return;
    const size_t end = message.find('"', prefix.size());
    if (end == std::string::npos) return;
    const std::string value = message.substr(prefix.size(), end - prefix.size());
    for (int l = std::min<int>(*line, static_cast<int>(lines_.size()) - 1); l >= 0; --l) {
      const std::string& text = lines_[l];
      size_t limit = l == *line ? std::min<size_t>(*column, text.size()) : text.size();
      const size_t at = text.rfind(value, limit);
      if (at != std::string::npos && at + value.size() <= text.size()) {
        *line = l;
        *column = static_cast<int>(at);
        return;
      }
    }
  }

  std::string file_;
  std::vector<std::string> lines_;
  std::vector<std::string> errors_;
};

// Finds where a field path such as "model.layers[2].width" appears in a parsed file. The tree is
// null for messages built in code (no locations); then only the file name is given.
class Locator {
 public:
  Locator(std::string file, const TextFormat::ParseInfoTree* tree, const Descriptor* root)
      : file_(std::move(file)), tree_(tree), root_(root) {}

  // "file:line" of the deepest component of `path` present in the file, or "file".
  std::string Where(const std::string& path) const {
    if (file_.empty()) return "";
    int line = -1;
    const TextFormat::ParseInfoTree* tree = tree_;
    const Descriptor* descriptor = root_;
    for (absl::string_view part : absl::StrSplit(path, '.')) {
      if (tree == nullptr || descriptor == nullptr) break;
      int index = -1;
      std::string name(part);
      const size_t bracket = name.find('[');
      if (bracket != std::string::npos) {
        if (!absl::SimpleAtoi(name.substr(bracket + 1, name.size() - bracket - 2), &index)) break;
        name = name.substr(0, bracket);
      }
      const FieldDescriptor* field = descriptor->FindFieldByName(name);
      if (field == nullptr) break;
      // ParseInfoTree insists on an index exactly for repeated fields; a path naming a repeated
      // field as a whole points at its first occurrence.
      if (field->is_repeated() && index < 0) index = 0;
      if (!field->is_repeated() && index >= 0) break;
      const auto location = tree->GetLocation(field, index);
      if (location.line < 0) break;
      line = location.line;
      if (field->type() != FieldDescriptor::TYPE_MESSAGE) break;
      tree = tree->GetTreeForNested(field, index);
      descriptor = field->message_type();
    }
    return line >= 0 ? absl::StrCat(file_, ":", line + 1) : file_;
  }

 private:
  std::string file_;
  const TextFormat::ParseInfoTree* tree_;
  const Descriptor* root_;
};

// Accumulates "where: field message" lines. `prefix` is prepended to every field path (e.g.
// "job." for a job embedded in a server config).
class Checker {
 public:
  Checker(const Locator* locator, std::string prefix)
      : locator_(locator), prefix_(std::move(prefix)) {}

  void Fail(const std::string& field, const std::string& message) {
    const std::string path = prefix_ + field;
    const std::string where = locator_ == nullptr ? "" : locator_->Where(path);
    errors_.push_back(absl::StrCat(where, where.empty() ? "" : ": ", path, " ", message));
  }

  template <typename T>
  void AtLeast(const std::string& field, T value, T min) {
    if (!(value >= min)) Fail(field, absl::StrCat("must be >= ", min, ", got ", value));
  }

  template <typename T>
  void InRange(const std::string& field, T value, T min, T max) {
    if (!(value >= min && value <= max)) {
      Fail(field, absl::StrCat("must be in [", min, ", ", max, "], got ", value));
    }
  }

  void Positive(const std::string& field, double value) {
    if (!(value > 0) || !std::isfinite(value)) {
      Fail(field, absl::StrCat("must be > 0, got ", value));
    }
  }

  // [lo, hi)
  void InHalfOpen(const std::string& field, double value, double lo, double hi) {
    if (!(value >= lo && value < hi)) {
      Fail(field, absl::StrCat("must be in [", lo, ", ", hi, "), got ", value));
    }
  }

  // (lo, hi]
  void InOpenClosed(const std::string& field, double value, double lo, double hi) {
    if (!(value > lo && value <= hi)) {
      Fail(field, absl::StrCat("must be in (", lo, ", ", hi, "], got ", value));
    }
  }

  void HostPort(const std::string& field, const std::string& value) {
    absl::Status status = ValidateHostPort(value, "");
    if (!status.ok()) Fail(field, std::string(status.message()));
  }

  Checker Nested(const std::string& path) const { return Checker(locator_, prefix_ + path); }

  void Merge(const Checker& other) {
    errors_.insert(errors_.end(), other.errors_.begin(), other.errors_.end());
  }

  const std::vector<std::string>& errors() const { return errors_; }

 private:
  const Locator* locator_;
  std::string prefix_;
  std::vector<std::string> errors_;
};

bool ValidJobId(const std::string& id) {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) return false;
  }
  return true;
}

void CheckJob(const JobConfig& job, Checker& c) {
  if (!ValidJobId(job.job_id())) {
    c.Fail("job_id", absl::StrCat("must match [A-Za-z0-9._-]{1,64}, got \"", job.job_id(), "\""));
  }

  const ModelSpec& model = job.model();
  const int num_layers = model.layers_size();
  c.AtLeast("model.input_dim", model.input_dim(), 1);
  if (model.declared_by_worker()) {
    // A model the workers bring (docs/python.md): its layout comes from the first registration.
    if (num_layers > 0) {
      c.Fail("model.layers",
             absl::StrCat("must be empty when model.declared_by_worker is true (the workers "
                          "declare the model's tensors), got ",
                          num_layers, " layers"));
    }
    if (job.topology().stages() != 1) {
      c.Fail("topology.stages",
             absl::StrCat("must be 1 for a model declared by its workers (pipeline stages are "
                          "C++-only: docs/python.md#limits), got ",
                          job.topology().stages()));
    }
    if (job.fault_tolerance().recovery_parallelism() != 1) {
      c.Fail("fault_tolerance.recovery_parallelism",
             absl::StrCat("must be 1 for a model declared by its workers (parallel replay is "
                          "C++-only: docs/python.md#limits), got ",
                          job.fault_tolerance().recovery_parallelism()));
    }
  } else if (num_layers == 0) {
    c.Fail("model.layers", "must list at least one layer, got none");
  }
  for (int i = 0; i < num_layers; ++i) {
    const std::string layer = absl::StrCat("model.layers[", i, "]");
    const LayerSpec& spec = model.layers(i);
    if (!spec.has_width()) {
      c.Fail(layer + ".width", "must be set");
    } else {
      c.AtLeast(layer + ".width", spec.width(), i + 1 == num_layers ? 2 : 1);
    }
    const bool last = i + 1 == num_layers;
    if (last && spec.activation() != IDENTITY) {
      c.Fail(layer + ".activation",
             absl::StrCat("must be IDENTITY for the output layer (softmax cross-entropy follows), "
                          "got ",
                          Activation_Name(spec.activation())));
    }
    if (!last && spec.activation() != RELU && spec.activation() != TANH &&
        spec.activation() != GELU) {
      c.Fail(layer + ".activation", absl::StrCat("must be RELU, TANH or GELU for a hidden layer, got ",
                                                 Activation_Name(spec.activation())));
    }
  }

  const TopologyConfig& topology = job.topology();
  c.InRange("topology.replicas", topology.replicas(), 1, 4096);
  if (!model.declared_by_worker()) {
    c.InRange("topology.stages", topology.stages(), 1, std::max(1, num_layers));
  }
  if (topology.stage_boundaries_size() > 0) {
    if (topology.stage_boundaries_size() != topology.stages() - 1) {
      c.Fail("topology.stage_boundaries",
             absl::StrCat("must list stages - 1 = ", topology.stages() - 1, " layer indices, got ",
                          topology.stage_boundaries_size()));
    } else {
      int previous = 0;
      for (int i = 0; i < topology.stage_boundaries_size(); ++i) {
        const int b = topology.stage_boundaries(i);
        if (b <= previous || b >= num_layers) {
          c.Fail(absl::StrCat("topology.stage_boundaries[", i, "]"),
                 absl::StrCat("must be increasing layer indices in (", previous, ", ", num_layers,
                              "), got ", b));
          break;
        }
        previous = b;
      }
    }
  }
  c.InRange("topology.spares", topology.spares(), 0, 4096);
  if (topology.replicas() >= 1 && topology.replicas() <= 4096 && topology.stages() >= 1 &&
      topology.stages() <= 4096) {
    c.InRange("topology.min_trainers", topology.min_trainers(), 0,
              topology.replicas() * topology.stages());
  }
  c.InRange("topology.start_barrier_ms", topology.start_barrier_ms(), 0, 3600000);  // an hour

  const DataConfig& data = job.data();
  if (data.dataset_dir().empty()) c.Fail("data.dataset_dir", "must not be empty");
  c.AtLeast("data.batch_size", data.batch_size(), 1);
  c.InRange("data.micro_batches", data.micro_batches(), 1, 4096);
  if (data.batch_size() >= 1 && data.micro_batches() >= 1 &&
      data.batch_size() % data.micro_batches() != 0) {
    c.Fail("data.micro_batches", absl::StrCat("must divide data.batch_size = ", data.batch_size(),
                                              ", got ", data.micro_batches()));
  }
  c.InHalfOpen("data.shard_overlap", data.shard_overlap(), 0.0, 1.0);
  c.AtLeast("data.train_limit", data.train_limit(), 0);
  c.AtLeast("data.test_limit", data.test_limit(), 0);

  const ComputeConfig& compute = job.compute();
  if (compute.backend() == BACKEND_UNSPECIFIED) c.Fail("compute.backend", "must be CPU or CUDA");
  c.InRange("compute.threads", compute.threads(), 1, 256);
  c.AtLeast("compute.cuda_device", compute.cuda_device(), 0);

  const AdaHessianConfig& ada = job.adahessian();
  c.Positive("adahessian.lr", ada.lr());
  c.InHalfOpen("adahessian.beta1", ada.beta1(), 0.0, 1.0);
  c.InHalfOpen("adahessian.beta2", ada.beta2(), 0.0, 1.0);
  c.Positive("adahessian.epsilon", ada.epsilon());
  c.InRange("adahessian.hessian_power", ada.hessian_power(), 0.0, 1.0);
  c.AtLeast("adahessian.weight_decay", ada.weight_decay(), 0.0);
  c.AtLeast("adahessian.hessian_every", ada.hessian_every(), 1);
  c.AtLeast("adahessian.block_size", ada.block_size(), 0);
  c.AtLeast<int64_t>("adahessian.warmup_steps", ada.warmup_steps(), 0);
  if (ada.lr_decay() == LR_DECAY_UNSPECIFIED) {
    c.Fail("adahessian.lr_decay", "must be LR_CONSTANT, LR_COSINE, LR_LINEAR or LR_STEP");
  }
  if (ada.lr_decay() == LR_COSINE || ada.lr_decay() == LR_LINEAR) {
    // 0 means the job's length (EffectiveAdaHessianConfig), which must outlast the warm-up too.
    if (ada.decay_steps() != 0) {
      c.AtLeast<int64_t>("adahessian.decay_steps", ada.decay_steps(), ada.warmup_steps() + 1);
    } else if (job.training().max_steps() <= ada.warmup_steps()) {
      c.Fail("adahessian.decay_steps",
             absl::StrCat("is 0 (= training.max_steps = ", job.training().max_steps(),
                          "), which must be > adahessian.warmup_steps = ", ada.warmup_steps()));
    }
  }
  c.InRange("adahessian.final_lr_fraction", ada.final_lr_fraction(), 0.0, 1.0);
  if (ada.lr_decay() == LR_STEP) c.AtLeast<int64_t>("adahessian.step_every", ada.step_every(), 1);
  c.InOpenClosed("adahessian.step_gamma", ada.step_gamma(), 0.0, 1.0);

  const EasgdConfig& easgd = job.easgd();
  if (easgd.mode() == SYNC_MODE_UNSPECIFIED) {
    c.Fail("easgd.mode", "must be EASGD or ASYNC_ADAHESSIAN");
  }
  if (easgd.moving_rate() != 0.0) {
    c.InOpenClosed("easgd.moving_rate", easgd.moving_rate(), 0.0, 1.0);
  }
  c.AtLeast("easgd.sync_period", easgd.sync_period(), 1);

  const WeightingConfig& weighting = job.weighting();
  if (weighting.policy() == WEIGHTING_UNSPECIFIED) {
    c.Fail("weighting.policy", "must be UNIFORM or DYNAMIC");
  }
  c.AtLeast("weighting.lambda", weighting.lambda(), 0.0);
  c.InOpenClosed("weighting.min_weight", weighting.min_weight(), 0.0, 1.0);
  c.Positive("weighting.fault_half_life_s", weighting.fault_half_life_s());
  c.InOpenClosed("weighting.fault_increment", weighting.fault_increment(), 0.0, 1.0);
  // 0 = raw inputs; beyond 1000 syncs an average would no longer follow a trainer that slows down
  // for good (NaN and infinity fail the range too).
  c.InRange("weighting.input_smoothing_half_life_syncs",
            weighting.input_smoothing_half_life_syncs(), 0.0, 1000.0);
  // Center integrity bounds (issue R9): 0 turns a bound off; a ratio below 2 would refuse the
  // ordinary spread of healthy trainers around their median.
  if (weighting.max_divergence_ratio() != 0.0 &&
      !(weighting.max_divergence_ratio() >= 2.0 &&
        std::isfinite(weighting.max_divergence_ratio()))) {
    c.Fail("weighting.max_divergence_ratio",
           absl::StrCat("must be 0 (off) or a finite value >= 2, got ",
                        weighting.max_divergence_ratio()));
  }
  if (weighting.max_abs_value() != 0.0 &&
      !(weighting.max_abs_value() > 0.0 && weighting.max_abs_value() <= 3.4e38)) {
    c.Fail("weighting.max_abs_value",
           absl::StrCat("must be 0 (finite only) or in (0, 3.4e38], got ",
                        weighting.max_abs_value()));
  }

  if (job.scheduling() == SCHEDULING_UNSPECIFIED) {
    c.Fail("scheduling", "must be ASYNC or DETERMINISTIC");
  }

  const FaultToleranceConfig& ft = job.fault_tolerance();
  if (ft.policy() == RECOVERY_POLICY_UNSPECIFIED) {
    c.Fail("fault_tolerance.policy", "must be REPLAY, RESTART_FROM_CENTER or GLOBAL_CHECKPOINT");
  }
  c.AtLeast("fault_tolerance.heartbeat_interval_ms", ft.heartbeat_interval_ms(), 10);
  if (ft.failure_timeout_ms() <= ft.heartbeat_interval_ms()) {
    c.Fail("fault_tolerance.failure_timeout_ms",
           absl::StrCat("must be greater than fault_tolerance.heartbeat_interval_ms = ",
                        ft.heartbeat_interval_ms(), ", got ", ft.failure_timeout_ms()));
  }
  c.InRange("fault_tolerance.crash_confirm_ms", ft.crash_confirm_ms(), 0, 60000);
  c.InRange("fault_tolerance.recovery_parallelism", ft.recovery_parallelism(), 1,
            std::max(1, data.micro_batches()));
  c.AtLeast("fault_tolerance.checkpoint_every_steps", ft.checkpoint_every_steps(), 1);
  if (ft.policy() == GLOBAL_CHECKPOINT) {
    if (job.easgd().mode() != EASGD) {
      c.Fail("fault_tolerance.policy",
             "GLOBAL_CHECKPOINT needs easgd.mode EASGD (its barrier is the trainers' sync)");
    } else if (job.easgd().sync_period() >= 1 && ft.checkpoint_every_steps() >= 1 &&
               ft.checkpoint_every_steps() % job.easgd().sync_period() != 0) {
      c.Fail("fault_tolerance.checkpoint_every_steps",
             absl::StrCat("must be a multiple of easgd.sync_period = ", job.easgd().sync_period(),
                          " under GLOBAL_CHECKPOINT (trainers sync at every checkpoint), got ",
                          ft.checkpoint_every_steps()));
    }
  }
  c.AtLeast("fault_tolerance.neighbour_timeout_ms", ft.neighbour_timeout_ms(), 100);
  c.AtLeast("fault_tolerance.reconnect_grace_ms", ft.reconnect_grace_ms(), 0);
  c.AtLeast("fault_tolerance.recovery_timeout_ms", ft.recovery_timeout_ms(), 1000);
  c.InRange("fault_tolerance.max_replay_attempts", ft.max_replay_attempts(), 1, 100);

  const StepLogConfig& log = job.step_log();
  int previous = 0;
  for (int i = 0; i < log.logged_boundaries_size(); ++i) {
    const int b = log.logged_boundaries(i);
    if (b <= previous || b >= topology.stages()) {
      c.Fail(absl::StrCat("step_log.logged_boundaries[", i, "]"),
             absl::StrCat("must be increasing boundary indices in [1, stages - 1 = ",
                          topology.stages() - 1, "], got ", b));
      break;
    }
    previous = b;
  }
  if (topology.stages() > 1) {
    // Pipelines (docs/design.md §2, §5.3): every stage of a replica syncs with its stage's center and a
    // lost stage is rebuilt by replay while its neighbours wait; nothing else keeps the stages of
    // a replica at one step.
    if (job.easgd().mode() != EASGD) {
      c.Fail("easgd.mode", "stages > 1 trains in mode EASGD only (ASYNC_ADAHESSIAN keeps whole "
                           "models on the trainers)");
    } else if (ft.policy() != REPLAY) {
      c.Fail("fault_tolerance.policy",
             absl::StrCat("stages > 1 needs policy REPLAY (a stage rebuilt any other way would "
                          "not match the step its live neighbours are at), got ",
                          RecoveryPolicy_Name(ft.policy())));
    } else if (!log.enabled()) {
      c.Fail("step_log.enabled", "stages > 1 under REPLAY needs the step log");
    }
  }
  c.AtLeast("step_log.buffer_bytes", log.buffer_bytes(), int64_t{1} << 20);
  c.InRange("step_log.linger_ms", log.linger_ms(), 0, 1000);
  if (log.compression() == COMPRESSION_UNSPECIFIED) {
    c.Fail("step_log.compression", "must be NO_COMPRESSION, LZ4 or ZSTD");
  }

  c.AtLeast("training.max_steps", job.training().max_steps(), int64_t{1});
  c.AtLeast("training.eval_every_ms", job.training().eval_every_ms(), 100);

  // The center sharded across K groups (docs/design.md §10.2, docs/sharding.md): EASGD syncs and
  // ASYNC_ADAHESSIAN pushes of a model spec or a declared model; GLOBAL_CHECKPOINT's range
  // checkpoints need the spec's layout at start, which a declared model has only later.
  const ShardingConfig& sharding = job.sharding();
  c.InRange("sharding.groups", sharding.groups(), 1, kMaxShardGroups);
  if (sharding.groups() > 1 && job.model().declared_by_worker() &&
      ft.policy() == GLOBAL_CHECKPOINT) {
    c.Fail("sharding.groups",
           "> 1 with a model declared by its workers needs fault_tolerance.policy REPLAY or "
           "RESTART_FROM_CENTER (GLOBAL_CHECKPOINT shards a model spec with layers only)");
  }

  // Exports while training (docs/operations.md#exports-while-training).
  if (job.has_export_()) {
    const ExportConfig& exports = job.export_();
    c.AtLeast("export.every_steps", exports.every_steps(), int64_t{0});
    c.AtLeast("export.every_seconds", exports.every_seconds(), int64_t{0});
    if (exports.every_steps() == 0 && exports.every_seconds() == 0) {
      c.Fail("export", "needs every_steps or every_seconds (or both) > 0");
    }
    c.AtLeast("export.keep_last", exports.keep_last(), 0);
    if (exports.format() != SAFETENSORS) {
      c.Fail("export.format", "must be SAFETENSORS (a .pt file: python3 -m rebound export)");
    }
    if (sharding.groups() > 1) {
      c.Fail("export", absl::StrCat("is not supported yet for a sharded center (sharding.groups ",
                                    sharding.groups(), "): no server holds the whole center"));
    }
  }

  // Audits (docs/recovery.md#audits).
  if (job.has_audit()) {
    const AuditConfig& audit = job.audit();
    c.InRange("audit.fraction", audit.fraction(), 0.0, 1.0);
    c.InRange("audit.max_concurrent", audit.max_concurrent(), 1, 64);
    c.AtLeast("audit.steps_per_hour", audit.steps_per_hour(), int64_t{0});
    c.InRange("audit.max_wait_ms", audit.max_wait_ms(), 1000, 3600000);
    if (audit.on_mismatch() != AUDIT_REPORT && audit.on_mismatch() != AUDIT_QUARANTINE) {
      c.Fail("audit.on_mismatch", "must be AUDIT_REPORT or AUDIT_QUARANTINE");
    }
    if (audit.fraction() > 0) {
      if (!job.step_log().enabled()) {
        c.Fail("audit.fraction", "> 0 needs step_log.enabled: an audit replays the logged steps");
      }
      if (audit.on_mismatch() == AUDIT_QUARANTINE && job.topology().stages() > 1) {
        c.Fail("audit.on_mismatch",
               "AUDIT_QUARANTINE needs topology.stages 1 (a quarantined slot restarts from the "
               "center, which a pipeline stage cannot do apart from its neighbours); use "
               "AUDIT_REPORT");
      }
      if (EffectiveRecoveryPolicy(job) != REPLAY) {
        c.Fail("audit.fraction",
               "> 0 needs fault_tolerance.policy REPLAY and easgd.mode EASGD: trainers log "
               "their steps only then, and a rollback (GLOBAL_CHECKPOINT) rewrites logged "
               "windows");
      }
      for (int stage = 0; stage < job.topology().stages(); ++stage) {
        const auto [first, end] = RecoveryGroup(job, stage);
        if (end - first > 1) {
          c.Fail("audit.fraction",
                 absl::StrCat("> 0 needs every pipeline boundary logged (stage ", stage,
                              " replays only with stages [", first, ", ", end,
                              "): see step_log.logged_boundaries)"));
          break;
        }
      }
    }
  }
}

// A server of a sharded job: its group and every group's address (docs/sharding.md).
void CheckShard(const ServerConfig& config, Checker& c) {
  const int groups = config.job().sharding().groups();
  if (groups <= 1) {
    if (config.has_shard()) {
      c.Fail("shard", "is set but the job's sharding.groups is 1: one group holds the center");
    }
    return;
  }
  if (!config.has_shard()) {
    c.Fail("shard", absl::StrCat("must say this server's group and the ", groups,
                                 " groups' addresses (the job's sharding.groups is ", groups, ")"));
    return;
  }
  const ShardConfig& shard = config.shard();
  c.InRange("shard.group", shard.group(), 0, groups - 1);
  if (shard.group_addresses_size() != groups) {
    c.Fail("shard.group_addresses",
           absl::StrCat("must have one entry per group (sharding.groups = ", groups, "), got ",
                        shard.group_addresses_size()));
    return;
  }
  std::string remote;  // a member on another host, if any
  for (const std::string& entry : shard.group_addresses()) {
    for (absl::string_view member : absl::StrSplit(entry, ',')) {
      c.HostPort("shard.group_addresses", std::string(member));
      const size_t colon = member.rfind(':');
      const absl::string_view host =
          member.substr(0, colon == absl::string_view::npos ? 0 : colon);
      if (remote.empty() && host != "127.0.0.1" && host != "localhost" && host != "[::1]") {
        remote = std::string(member);
      }
    }
  }
  // GLOBAL_CHECKPOINT: group 0's CheckpointRange and RollbackRange are operator calls, which a
  // server takes from another host only with the operator token.
  if (config.job().fault_tolerance().policy() == GLOBAL_CHECKPOINT && !remote.empty() &&
      config.security().operator_token_file().empty()) {
    c.Fail("security.operator_token_file",
           absl::StrCat("must be set, the same on every group, in a sharded GLOBAL_CHECKPOINT job "
                        "across hosts: group 0 asks the range groups to keep and roll back their "
                        "ranges with it (docs/sharding.md#global-checkpoint); "
                        "shard.group_addresses names ",
                        remote));
  }
  // Audits: group 0 reads each audited window's start from every range, an operator call too.
  if (config.job().has_audit() && config.job().audit().fraction() > 0 && !remote.empty() &&
      config.security().operator_token_file().empty()) {
    c.Fail("security.operator_token_file",
           absl::StrCat("must be set, the same on every group, in a sharded job with audits "
                        "across hosts: group 0 reads each audited window's start from the range "
                        "groups with it (docs/sharding.md#audits); shard.group_addresses names ",
                        remote));
  }
}

void CheckMetrics(const MetricsConfig& metrics, Checker& c) {
  if (metrics.bind_address().empty()) c.Fail("metrics.bind_address", "must not be empty");
  c.InRange("metrics.port", metrics.port(), 0, 65535);
}

// The path alone when it cannot be opened, else ReadBoundedFile's reason (it names the path).
std::string UnreadableWhy(const absl::Status& status, const std::string& path) {
  if (status.code() == absl::StatusCode::kNotFound) return path;
  return std::string(status.message());
}

void CheckSecurity(const SecurityConfig& security, bool server, Checker& c) {
  for (const auto& [name, path] :
       {std::pair<std::string, std::string>{"token_file", security.token_file()},
        {"operator_token_file", security.operator_token_file()}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> text = ReadBoundedFile(path, "token file");
    std::istringstream in(text.ok() ? *text : std::string());
    std::string token;
    if (!text.ok()) {
      c.Fail("security." + name,
             absl::StrCat("cannot be read: ", UnreadableWhy(text.status(), path)));
    } else if (!std::getline(in, token) || token.empty()) {
      c.Fail("security." + name, absl::StrCat("must hold the token on its first line: ", path));
    }
  }
  if (!security.has_tls()) return;
  const TlsConfig& tls = security.tls();
  if (server && (tls.cert_file().empty() || tls.key_file().empty())) {
    c.Fail("security.tls", "needs cert_file and key_file on the server");
  }
  if (tls.cert_file().empty() != tls.key_file().empty()) {
    c.Fail("security.tls", "needs both cert_file and key_file, or neither");
  }
  if (tls.require_client_cert() && tls.ca_file().empty()) {
    c.Fail("security.tls.require_client_cert", "needs security.tls.ca_file to verify clients");
  }
  for (const auto& [name, path, label] :
       {std::tuple<std::string, std::string, std::string>{"cert_file", tls.cert_file(),
                                                          "CERTIFICATE"},
        {"key_file", tls.key_file(), "PRIVATE KEY"},
        {"ca_file", tls.ca_file(), "CERTIFICATE"}}) {
    if (path.empty()) continue;
    absl::StatusOr<std::string> text = ReadBoundedFile(path, "security.tls." + name);
    if (!text.ok()) {
      c.Fail("security.tls." + name,
             absl::StrCat("cannot be read: ", UnreadableWhy(text.status(), path)));
    } else if (absl::Status pem = CheckPem(*text, label, "security.tls." + name, path);
               !pem.ok()) {
      c.Fail("security.tls." + name, std::string(pem.message()));
    }
  }
}

std::string Resolve(const std::string& base_dir, const std::string& path) {
  if (path.empty() || path[0] == '/' || base_dir.empty()) return path;
  return absl::StrCat(base_dir, "/", path);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// Parses `text` into `message`, recording locations into `tree`.
absl::Status ParseText(const std::string& text, const std::string& display_name, Message* message,
                       TextFormat::ParseInfoTree* tree) {
  ErrorCollector errors(display_name, text);
  TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(tree);
  if (!parser.ParseFromString(text, message) || !errors.errors().empty()) {
    if (errors.errors().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(display_name, ": cannot parse"));
    }
    return absl::InvalidArgumentError(absl::StrJoin(errors.errors(), "\n"));
  }
  return absl::OkStatus();
}

absl::Status ErrorsToStatus(const std::vector<std::string>& errors) {
  if (errors.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrJoin(errors, "\n"));
}

void ResolveSecurityPaths(SecurityConfig* security, const std::string& base_dir) {
  if (!security->token_file().empty()) {
    security->set_token_file(Resolve(base_dir, security->token_file()));
  }
  if (!security->operator_token_file().empty()) {
    security->set_operator_token_file(Resolve(base_dir, security->operator_token_file()));
  }
  if (security->has_tls()) {
    TlsConfig* tls = security->mutable_tls();
    if (tls->has_cert_file()) tls->set_cert_file(Resolve(base_dir, tls->cert_file()));
    if (tls->has_key_file()) tls->set_key_file(Resolve(base_dir, tls->key_file()));
    if (tls->has_ca_file()) tls->set_ca_file(Resolve(base_dir, tls->ca_file()));
  }
}

// ServerConfig's admission bounds (0 = sized from the job, server/call_gate.h).
void CheckAdmissionBounds(const ServerConfig& config, Checker& c) {
  c.InRange("max_parked_calls", config.max_parked_calls(), 0, 100000);
  if (config.max_inflight_bytes() != 0 && config.max_inflight_bytes() < (int64_t{1} << 20)) {
    c.Fail("max_inflight_bytes",
           absl::StrCat("must be 0 (sized from the job) or >= 1048576, got ",
                        config.max_inflight_bytes()));
  }
  c.InRange("max_threads", config.max_threads(), 0, 1000000);
  if (config.max_threads() > 0 && config.max_parked_calls() > 0 &&
      config.max_threads() < config.max_parked_calls() + 16) {
    c.Fail("max_threads",
           absl::StrCat("must leave at least 16 threads beyond max_parked_calls = ",
                        config.max_parked_calls(), " for other calls, got ",
                        config.max_threads()));
  }
  if (config.max_threads() > 0 && config.max_threads() < 16) {
    c.Fail("max_threads", absl::StrCat("must be 0 (sized from the job) or >= 16, got ",
                                       config.max_threads()));
  }
}

// A replicated group's member (docs/design.md §10.1): the group's block, and what the rest of the
// config must give it (a fixed worker port: the leader is reached there; a data directory: a
// standby's copy lives there).
void CheckReplication(const ServerConfig& config, Checker& c) {
  const ReplicationConfig& r = config.replication();
  auto valid_name = [](const std::string& name) {
    return !name.empty() && name.size() <= 64 &&
           std::all_of(name.begin(), name.end(), [](char ch) {
             return absl::ascii_isalnum(static_cast<unsigned char>(ch)) || ch == '_' ||
                    ch == '.' || ch == '-';
           });
  };
  if (r.etcd_endpoints_size() == 0) {
    c.Fail("replication.etcd_endpoints", "must name at least one etcd member (host:port)");
  }
  for (int i = 0; i < r.etcd_endpoints_size(); ++i) {
    const std::string field = absl::StrCat("replication.etcd_endpoints");
    c.HostPort(field, r.etcd_endpoints(i));
    if (absl::EndsWith(r.etcd_endpoints(i), ":0")) {
      c.Fail(field, absl::StrCat("needs a port other than 0, got \"", r.etcd_endpoints(i), "\""));
    }
  }
  c.InRange("replication.standbys", r.standbys(), 0, 16);
  if (r.leader_lease_ms() < 1000 || r.leader_lease_ms() > 60000 || r.leader_lease_ms() % 1000 != 0) {
    c.Fail("replication.leader_lease_ms",
           absl::StrCat("must be a multiple of 1000 (etcd leases are whole seconds) in [1000, "
                        "60000], got ",
                        r.leader_lease_ms()));
  }
  if (!valid_name(r.group())) {
    c.Fail("replication.group", absl::StrCat("must be [A-Za-z0-9_.-]{1,64}, got \"", r.group(), "\""));
  }
  if (!r.name().empty() && !valid_name(r.name())) {
    c.Fail("replication.name", absl::StrCat("must be [A-Za-z0-9_.-]{1,64}, got \"", r.name(), "\""));
  }
  c.HostPort("replication.peer_listen_address", r.peer_listen_address());
  if (r.max_buffered_bytes() < (int64_t{1} << 20) || r.max_buffered_bytes() > (int64_t{16} << 30)) {
    c.Fail("replication.max_buffered_bytes",
           absl::StrCat("must be in [1048576, 17179869184], got ", r.max_buffered_bytes()));
  }
  if (absl::EndsWith(config.listen_address(), ":0")) {
    c.Fail("listen_address",
           "needs a fixed port in a replicated group (workers reach the leader there), got port 0");
  }
  if (!config.has_durability() || config.durability().data_dir().empty()) {
    c.Fail("replication", "needs durability.data_dir (a standby keeps its copy there)");
  }
  // GLOBAL_CHECKPOINT's checkpoints are files beside the store, which replication does not carry:
  // a new leader would have none to roll back to.
  if (config.job().fault_tolerance().policy() == GLOBAL_CHECKPOINT) {
    c.Fail("replication",
           "cannot be set under fault_tolerance.policy GLOBAL_CHECKPOINT: its checkpoints are "
           "files in the data directory that standbys do not receive, so a new leader would have "
           "none to roll back to; use REPLAY or RESTART_FROM_CENTER, or one server per group");
  }
}

}  // namespace

absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, const std::string& what) {
  return ReadFile(path, kMaxConfigFileBytes, what);
}

absl::Status CheckPem(const std::string& text, const std::string& label, const std::string& what,
                      const std::string& path) {
  auto fail = [&](const std::string& why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " is not a PEM ", label, ": ", why));
  };
  std::vector<std::string> labels = {label};
  if (label == "PRIVATE KEY") labels = {"PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY"};
  for (const std::string& l : labels) {
    const std::string begin = absl::StrCat("-----BEGIN ", l, "-----");
    const std::string end = absl::StrCat("-----END ", l, "-----");
    const size_t at = text.find(begin);
    if (at == std::string::npos) continue;
    const size_t stop = text.find(end, at + begin.size());
    if (stop == std::string::npos) return fail(absl::StrCat("no \"", end, "\" line"));
    std::string body;
    for (char c : text.substr(at + begin.size(), stop - at - begin.size())) {
      if (c != '\n' && c != '\r' && c != ' ' && c != '\t') body.push_back(c);
    }
    std::string decoded;
    if (body.empty() || !absl::Base64Unescape(body, &decoded) || decoded.empty()) {
      return fail("its body is not base64");
    }
    return absl::OkStatus();
  }
  return fail(absl::StrCat("no \"-----BEGIN ", label, "-----\" line"));
}

RecoveryPolicy EffectiveRecoveryPolicy(const JobConfig& job) {
  const RecoveryPolicy policy = job.fault_tolerance().policy();
  if (policy == REPLAY && job.easgd().mode() == ASYNC_ADAHESSIAN) return RESTART_FROM_CENTER;
  return policy;
}

std::vector<bool> LoggedBoundaries(const JobConfig& job) {
  const int stages = std::max(1, job.topology().stages());
  const StepLogConfig& log = job.step_log();
  std::vector<bool> logged(stages + 1, false);
  if (!log.enabled() || log.log_no_boundaries()) return logged;
  if (log.logged_boundaries_size() == 0) {
    for (int b = 1; b < stages; ++b) logged[b] = true;
    return logged;
  }
  for (int b : log.logged_boundaries()) {
    if (b >= 1 && b < stages) logged[b] = true;
  }
  return logged;
}

std::pair<int, int> RecoveryGroup(const JobConfig& job, int stage) {
  const std::vector<bool> logged = LoggedBoundaries(job);
  const int stages = static_cast<int>(logged.size()) - 1;
  int first = stage;
  while (first > 0 && !logged[first]) --first;
  int end = stage + 1;
  while (end < stages && !logged[end]) ++end;
  return {first, end};
}

AdaHessianConfig EffectiveAdaHessianConfig(const JobConfig& job) {
  AdaHessianConfig config = job.adahessian();
  const bool decays = config.lr_decay() == LR_COSINE || config.lr_decay() == LR_LINEAR;
  if (decays && config.decay_steps() == 0) {
    int64_t steps = job.training().max_steps();
    if (job.easgd().mode() == ASYNC_ADAHESSIAN) steps *= job.topology().replicas();
    config.set_decay_steps(steps);
  }
  return config;
}

double EffectiveMovingRate(const JobConfig& job) {
  if (job.easgd().moving_rate() != 0.0) return job.easgd().moving_rate();
  return 0.9 / std::max(1, job.topology().replicas());
}

std::vector<int> StageLayerStarts(const JobConfig& job) {
  const int layers = job.model().layers_size();
  const int stages = std::max(1, job.topology().stages());
  std::vector<int> starts;
  starts.push_back(0);
  if (job.topology().stage_boundaries_size() == stages - 1) {
    for (int b : job.topology().stage_boundaries()) starts.push_back(b);
  } else {
    for (int s = 1; s < stages; ++s) starts.push_back(s * layers / stages);
  }
  starts.push_back(layers);
  return starts;
}

absl::Status ValidateJobConfig(const JobConfig& job) {
  Checker checker(nullptr, "");
  CheckJob(job, checker);
  return ErrorsToStatus(checker.errors());
}

absl::StatusOr<JobConfig> ParseJobConfig(const std::string& text, const std::string& display_name) {
  JobConfig job;
  TextFormat::ParseInfoTree tree;
  absl::Status parsed = ParseText(text, display_name, &job, &tree);
  if (!parsed.ok()) return parsed;
  Locator locator(display_name, &tree, JobConfig::descriptor());
  Checker checker(&locator, "");
  CheckJob(job, checker);
  absl::Status valid = ErrorsToStatus(checker.errors());
  if (!valid.ok()) return valid;
  return job;
}

absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path) {
  auto text = ReadBoundedFile(path, "config file");
  if (!text.ok()) return text.status();
  return ParseJobConfig(*text, path);
}

absl::StatusOr<ServerConfig> ParseServerConfig(const std::string& text,
                                               const std::string& display_name,
                                               const std::string& base_dir) {
  ServerConfig config;
  TextFormat::ParseInfoTree tree;
  absl::Status parsed = ParseText(text, display_name, &config, &tree);
  if (!parsed.ok()) return parsed;
  Locator locator(display_name, &tree, ServerConfig::descriptor());
  Checker checker(&locator, "");
  ResolveSecurityPaths(config.mutable_security(), base_dir);
  if (config.has_durability() && !config.durability().data_dir().empty()) {
    config.mutable_durability()->set_data_dir(Resolve(base_dir, config.durability().data_dir()));
  }

  checker.HostPort("listen_address", config.listen_address());
  if (config.has_job() && config.has_job_file()) {
    checker.Fail("job_file", "and job { ... } are mutually exclusive; set exactly one");
  } else if (!config.has_job() && !config.has_job_file()) {
    checker.Fail("job", "must be set inline, or job_file must name the job config");
  } else if (config.has_job()) {
    Checker job_checker = checker.Nested("job.");
    CheckJob(config.job(), job_checker);
    checker.Merge(job_checker);
  }
  CheckSecurity(config.security(), /*server=*/true, checker);
  CheckMetrics(config.metrics(), checker);
  if (config.max_message_bytes() < (1 << 20)) {
    checker.Fail("max_message_bytes",
                 absl::StrCat("must be in [1048576, 2147483647), got ", config.max_message_bytes()));
  }
  checker.AtLeast("max_wait_ms", config.max_wait_ms(), 100);
  CheckAdmissionBounds(config, checker);
  if (config.has_replication()) CheckReplication(config, checker);
  absl::Status valid = ErrorsToStatus(checker.errors());
  if (!valid.ok()) return valid;

  if (config.has_job_file()) {
    auto job = LoadJobConfig(Resolve(base_dir, config.job_file()));
    if (!job.ok()) return job.status();
    *config.mutable_job() = *std::move(job);
    config.clear_job_file();
  }
  if (config.job().has_export_() && !config.job().export_().dir().empty()) {
    config.mutable_job()->mutable_export_()->set_dir(
        Resolve(base_dir, config.job().export_().dir()));
  }
  Checker shard_checker(&locator, "");
  CheckShard(config, shard_checker);
  valid = ErrorsToStatus(shard_checker.errors());
  if (!valid.ok()) return valid;
  return config;
}

absl::StatusOr<ServerConfig> LoadServerConfig(const std::string& path) {
  auto text = ReadBoundedFile(path, "config file");
  if (!text.ok()) return text.status();
  return ParseServerConfig(*text, path, DirName(path));
}

absl::StatusOr<WorkerConfig> ParseWorkerConfig(const std::string& text,
                                               const std::string& display_name,
                                               const std::string& base_dir) {
  WorkerConfig config;
  TextFormat::ParseInfoTree tree;
  absl::Status parsed = ParseText(text, display_name, &config, &tree);
  if (!parsed.ok()) return parsed;
  Locator locator(display_name, &tree, WorkerConfig::descriptor());
  Checker checker(&locator, "");
  ResolveSecurityPaths(config.mutable_security(), base_dir);

  if (auto listed = ParseServerAddresses(config.server_address(), ""); !listed.ok()) {
    checker.Fail("server_address", std::string(listed.status().message()));
  }
  checker.HostPort("peer_listen_address", config.peer_listen_address());
  if (config.has_compute()) {
    checker.InRange("compute.threads", config.compute().threads(), 1, 256);
    checker.AtLeast("compute.cuda_device", config.compute().cuda_device(), 0);
  }
  CheckSecurity(config.security(), /*server=*/false, checker);
  CheckMetrics(config.metrics(), checker);
  checker.AtLeast("rpc_deadline_ms", config.rpc_deadline_ms(), 10);
  checker.AtLeast("backoff_initial_ms", config.backoff_initial_ms(), 1);
  if (config.backoff_max_ms() < config.backoff_initial_ms()) {
    checker.Fail("backoff_max_ms", absl::StrCat("must be >= backoff_initial_ms = ",
                                                config.backoff_initial_ms(), ", got ",
                                                config.backoff_max_ms()));
  }
  checker.AtLeast("give_up_after_ms", config.give_up_after_ms(), 0);
  checker.InRange("progress_interval_s", config.progress_interval_s(), 0, 86400);
  absl::Status valid = ErrorsToStatus(checker.errors());
  if (!valid.ok()) return valid;
  return config;
}

absl::StatusOr<WorkerConfig> LoadWorkerConfig(const std::string& path) {
  auto text = ReadBoundedFile(path, "config file");
  if (!text.ok()) return text.status();
  return ParseWorkerConfig(*text, path, DirName(path));
}

}  // namespace rebound
