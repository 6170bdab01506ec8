#include "server/center_table.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"
#include "compute/tensor_bundle.h"

namespace rebound::server {

double Distance(absl::Span<const float> a, absl::Span<const float> b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    sum += d * d;
  }
  return std::sqrt(sum);
}

double Norm(absl::Span<const float> a) {
  double sum = 0.0;
  for (float x : a) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

absl::StatusOr<std::unique_ptr<CenterTable>> CenterTable::Create(const JobConfig& job) {
  std::unique_ptr<CenterTable> table(new CenterTable());
  const std::vector<int> starts = StageLayerStarts(job);
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    ASSIGN_OR_RETURN(compute::StageLayout layout,
                     compute::StageLayout::Create(job.model(), starts[s], starts[s + 1]));
    auto stage = std::make_unique<Stage>(std::move(layout));
    std::vector<float> padded(stage->layout.padded_size());
    RETURN_IF_ERROR(compute::InitParams(job.model(), stage->layout, absl::MakeSpan(padded)));
    absl::MutexLock lock(&stage->mu);
    stage->center.resize(stage->layout.packed_size());
    RETURN_IF_ERROR(stage->layout.Pack(padded, absl::MakeSpan(stage->center)));
    table->stages_.push_back(std::move(stage));
  }
  return table;
}

absl::Status CenterTable::ValidateBundle(int stage, const TensorBundle& bundle,
                                         const std::string& what) const {
  if (stage < 0 || stage >= num_stages()) {
    return absl::InvalidArgumentError(
        absl::StrCat("stage ", stage, " is outside [0, ", num_stages(), ")"));
  }
  return compute::ValidateBundle(stages_[stage]->layout, bundle, what);
}

std::vector<float> CenterTable::Unbundle(int stage, const TensorBundle& bundle) const {
  return compute::PackedFromBundle(stages_[stage]->layout, bundle);
}

TensorBundle CenterTable::Bundle(int stage, absl::Span<const float> packed) const {
  return compute::BundleFromPacked(stages_[stage]->layout, packed);
}

CenterRecord CenterTable::MakeRecordLocked(int stage, const Stage& s) const {
  CenterRecord record;
  record.set_stage(stage);
  record.set_version(s.version);
  *record.mutable_params() = Bundle(stage, s.center);
  return record;
}

absl::Status CenterTable::Restore(const CenterRecord& center, const CenterOptRecord* opt) {
  const int stage = center.stage();
  RETURN_IF_ERROR(ValidateBundle(stage, center.params(), "center"));
  Stage& s = *stages_[stage];
  std::vector<float> values = Unbundle(stage, center.params());
  std::vector<float> m, v;
  if (opt != nullptr && opt->state().has_m()) {
    RETURN_IF_ERROR(ValidateBundle(stage, opt->state().m(), "center_opt.m"));
    RETURN_IF_ERROR(ValidateBundle(stage, opt->state().v(), "center_opt.v"));
    m = Unbundle(stage, opt->state().m());
    v = Unbundle(stage, opt->state().v());
  }
  absl::MutexLock lock(&s.mu);
  s.center = std::move(values);
  s.version = center.version();
  if (!m.empty()) {
    s.m = std::move(m);
    s.v = std::move(v);
    s.opt_step = opt->state().step();
  }
  return absl::OkStatus();
}

absl::StatusOr<CenterTable::SyncResult> CenterTable::ElasticSync(int stage,
                                                                   absl::Span<const float> x,
                                                                   double alpha,
                                                                   const WeightFn& weight,
                                                                   const CommitFn& commit) {
  Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  if (x.size() != s.center.size()) {
    return absl::InvalidArgumentError(absl::StrCat("params hold ", x.size(), " floats, stage ",
                                                   stage, " has ", s.center.size()));
  }
  SyncResult result;
  result.center_before = s.center;
  ASSIGN_OR_RETURN(const double w, weight(s.version, Distance(x, s.center)));
  result.worker_after.assign(x.begin(), x.end());
  RETURN_IF_ERROR(
      compute::ElasticPullWorker(alpha, result.center_before, absl::MakeSpan(result.worker_after)));
  RETURN_IF_ERROR(compute::ElasticMoveCenter(alpha, w, x, absl::MakeSpan(s.center)));
  ++s.version;
  absl::Status committed = commit(MakeRecordLocked(stage, s), result.worker_after);
  if (!committed.ok()) {
    s.center = result.center_before;
    --s.version;
    return committed;
  }
  result.version = s.version;
  return result;
}

absl::StatusOr<int64_t> CenterTable::ApplyAdaHessian(int stage, absl::Span<const float> g,
                                                     absl::Span<const float> d,
                                                     const AdaHessianConfig& config,
                                                     const WeightFn& weight,
                                                     const OptCommitFn& commit) {
  Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  if (g.size() != s.center.size() || d.size() != s.center.size()) {
    return absl::InvalidArgumentError(absl::StrCat("gradient and hessian_diag must hold ",
                                                   s.center.size(), " floats"));
  }
  if (s.m.empty()) {
    s.m.assign(s.center.size(), 0.0f);
    s.v.assign(s.center.size(), 0.0f);
  }
  ASSIGN_OR_RETURN(const double w, weight(s.version, Norm(g)));
  const std::vector<float> center_before = s.center;
  const std::vector<float> m_before = s.m;
  const std::vector<float> v_before = s.v;
  RETURN_IF_ERROR(compute::ServerAdaHessianApply(config, w, s.opt_step + 1, g, d,
                                                 absl::MakeSpan(s.m), absl::MakeSpan(s.v),
                                                 absl::MakeSpan(s.center)));
  ++s.opt_step;
  ++s.version;
  CenterOptRecord opt;
  opt.set_stage(stage);
  opt.mutable_state()->set_step(s.opt_step);
  *opt.mutable_state()->mutable_m() = Bundle(stage, s.m);
  *opt.mutable_state()->mutable_v() = Bundle(stage, s.v);
  absl::Status committed = commit(MakeRecordLocked(stage, s), opt);
  if (!committed.ok()) {
    s.center = center_before;
    s.m = m_before;
    s.v = v_before;
    --s.opt_step;
    --s.version;
    return committed;
  }
  return s.version;
}

std::pair<std::vector<float>, int64_t> CenterTable::Read(int stage) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  return {s.center, s.version};
}

int64_t CenterTable::version(int stage) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  return s.version;
}

int64_t CenterTable::WaitForVersion(int stage, int64_t min_version, absl::Duration timeout) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  auto reached = [&s, min_version]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    return s.version >= min_version;
  };
  s.mu.AwaitWithTimeout(absl::Condition(&reached), timeout);
  return s.version;
}

}  // namespace rebound::server
