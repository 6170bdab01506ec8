#include "server/center_table.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/status_macros.h"
#include "compute/adahessian.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"

namespace rebound::server {

namespace {

// Elements per block of the fused update loop: a block of each array (64 KiB) stays in the
// L2 cache between the block's steps.
constexpr size_t kBlock = 16384;

// The bound of values that need only be finite.
constexpr float kFiniteOnly = std::numeric_limits<float>::max();

// Sums of squares in a fixed order, so deterministic on a machine: float sums in 16 lanes over
// blocks of kNormBlock elements, each block's sum added in double. The relative error stays
// near float epsilon times log(kNormBlock): plenty for the weighting inputs they feed.
constexpr size_t kNormBlock = 1024;

// Sum over i in [0, n) of f(i)^2 where f(i) = a[i] - b[i] (b != nullptr) or a[i].
double SumOfSquares(const float* a, const float* b, size_t n) {
  double total = 0.0;
  for (size_t begin = 0; begin < n; begin += kNormBlock) {
    const size_t end = std::min(n, begin + kNormBlock);
    size_t i = begin;
    float block = 0.0f;
#if defined(__SSE2__)
    __m128 acc[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
    for (; i + 16 <= end; i += 16) {
      for (int k = 0; k < 4; ++k) {
        __m128 v = _mm_loadu_ps(a + i + 4 * k);
        if (b != nullptr) v = _mm_sub_ps(v, _mm_loadu_ps(b + i + 4 * k));
        acc[k] = _mm_add_ps(acc[k], _mm_mul_ps(v, v));
      }
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, _mm_add_ps(_mm_add_ps(acc[0], acc[1]), _mm_add_ps(acc[2], acc[3])));
    block = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
    for (; i < end; ++i) {
      const float v = b != nullptr ? a[i] - b[i] : a[i];
      block += v * v;
    }
    total += block;
  }
  return total;
}

// The first element of values[0, n) that is not finite or whose magnitude exceeds `limit`, or
// -1. Raises *max_abs to the largest magnitude of the others. One branch-free pass (the values
// are in cache: the caller just wrote them), a second only to find a refused element.
int64_t FirstOutOfBounds(const float* values, size_t n, float limit, float* max_abs) {
  float largest = *max_abs;
  int bad = 0;
  size_t i = 0;
#if defined(__SSE2__)
  // Explicit lanes: without -ffast-math the compiler keeps a float max reduction scalar, which
  // made this check cost 8x the elastic kernel it follows. 4 x 4 lanes break the dependency.
  const __m128 abs_mask = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
  const __m128 bound = _mm_set1_ps(limit);
  __m128 top[4] = {_mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps(), _mm_setzero_ps()};
  __m128 out = _mm_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 4; ++k) {
      const __m128 a = _mm_and_ps(_mm_loadu_ps(values + i + 4 * k), abs_mask);
      top[k] = _mm_max_ps(top[k], a);
      out = _mm_or_ps(out, _mm_cmpnle_ps(a, bound));  // !(a <= bound): also NaN
    }
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, _mm_max_ps(_mm_max_ps(top[0], top[1]), _mm_max_ps(top[2], top[3])));
  for (float lane : lanes) largest = lane > largest ? lane : largest;
  bad |= _mm_movemask_ps(out);
#endif
  for (; i < n; ++i) {
    const float a = std::fabs(values[i]);
    largest = a > largest ? a : largest;
    bad |= !(a <= limit);
  }
  *max_abs = largest;
  if (bad == 0) return -1;
  for (size_t i = 0; i < n; ++i) {
    if (!(std::fabs(values[i]) <= limit)) return static_cast<int64_t>(i);
  }
  return -1;
}

// INVALID_ARGUMENT for an update whose result `what` would hold `value` at packed index `index`:
// names the tensor (id and name), the element within it, the value, the inputs there and the
// bound.
absl::Status RefusedResult(const compute::StageLayout& layout, int stage, const char* what,
                           int64_t index, float value, float limit, const std::string& inputs) {
  std::string tensor = "?";
  int64_t element = index;
  for (const compute::TensorInfo& info : layout.tensors()) {
    if (index >= info.packed_offset && index < info.packed_offset + info.size()) {
      tensor = absl::StrCat(info.id, " (", info.name, ")");
      element = index - info.packed_offset;
      break;
    }
  }
  const std::string bound =
      limit >= std::numeric_limits<float>::max()
          ? std::string("finite")
          : absl::StrCat("finite with |value| <= ", limit, " (weighting.max_abs_value)");
  return absl::InvalidArgumentError(absl::StrCat(
      "refused: the update would make ", what, " of stage ", stage, " hold ", value,
      " at tensor id ", tensor, " element ", element, " (", inputs, "); every value must be ",
      bound, "; nothing was changed"));
}

}  // namespace

double Distance(absl::Span<const float> a, absl::Span<const float> b) {
  return std::sqrt(SumOfSquares(a.data(), b.data(), a.size()));
}

double Norm(absl::Span<const float> a) {
  return std::sqrt(SumOfSquares(a.data(), nullptr, a.size()));
}

absl::StatusOr<std::unique_ptr<CenterTable>> CenterTable::Create(const JobConfig& job,
                                                                int range) {
  std::unique_ptr<CenterTable> table(new CenterTable());
  const double max_abs = job.weighting().max_abs_value();
  table->max_abs_value_ = max_abs > 0.0 && max_abs < std::numeric_limits<float>::max()
                              ? static_cast<float>(max_abs)
                              : std::numeric_limits<float>::max();
  table->groups_ = std::max(1, job.sharding().groups());
  table->range_ = table->groups_ > 1 ? range : 0;
  if (table->groups_ > 1 && (range < 0 || range >= table->groups_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("range ", range, " of a job sharded across ", table->groups_, " groups"));
  }
  if (job.model().declared_by_worker()) {
    table->declared_model_ = true;
    table->stages_.resize(1);  // filled by Declare
    return table;
  }
  const std::vector<int> starts = StageLayerStarts(job);
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    ASSIGN_OR_RETURN(compute::StageLayout layout,
                     compute::StageLayout::Create(job.model(), starts[s], starts[s + 1]));
    auto stage = std::make_unique<Stage>(std::move(layout));
    std::vector<float> padded(stage->layout.padded_size());
    RETURN_IF_ERROR(compute::InitParams(job.model(), stage->layout, absl::MakeSpan(padded)));
    absl::MutexLock lock(&stage->mu);
    stage->center->resize(stage->layout.packed_size());
    RETURN_IF_ERROR(stage->layout.Pack(padded, absl::MakeSpan(*stage->center)));
    stage->PublishLocked();
    table->stage_parameters_.push_back(stage->layout.packed_size());
    table->stages_.push_back(std::move(stage));
  }
  table->num_stages_.store(static_cast<int>(table->stages_.size()), std::memory_order_release);
  if (job.sharding().groups() <= 1) return table;
  // A sharded job: this group's range of each stage, a one-tensor stage of its own, starting
  // from the same slice of the same initialisation.
  const int groups = table->groups_;
  for (std::unique_ptr<Stage>& stage : table->stages_) {
    const int64_t n = stage->layout.packed_size();
    const int s = static_cast<int>(&stage - table->stages_.data());
    ASSIGN_OR_RETURN(compute::StageLayout layout, compute::RangeLayout(s, n, groups, range));
    auto ranged = std::make_unique<Stage>(std::move(layout));
    absl::MutexLock full_lock(&stage->mu);
    absl::MutexLock lock(&ranged->mu);
    ranged->center->assign(stage->center->begin() + compute::RangeBegin(n, groups, range),
                           stage->center->begin() + compute::RangeBegin(n, groups, range + 1));
    ranged->PublishLocked();
    stage.swap(ranged);
  }
  return table;
}

absl::Status CenterTable::Declare(const TensorBundle& model) {
  absl::MutexLock declaring(&declare_mu_);
  if (!declared_model_) {
    return absl::FailedPreconditionError(
        "this job's model is its spec's MLP (model.layers); workers cannot declare another");
  }
  if (num_stages() > 0) {
    return absl::FailedPreconditionError("the job's model is already declared");
  }
  ASSIGN_OR_RETURN(compute::StageLayout layout, compute::StageLayout::FromDeclared(model));
  RETURN_IF_ERROR(compute::ValidateBundle(layout, model, "model"));
  std::vector<float> values = compute::PackedFromBundle(layout, model);
  declared_layout_ = std::make_unique<compute::StageLayout>(layout);
  declaration_ = model;
  std::unique_ptr<Stage> stage;
  if (groups_ > 1) {
    // A sharded job: this group's range of the declared values (as Create does for an MLP).
    const int64_t n = layout.packed_size();
    ASSIGN_OR_RETURN(compute::StageLayout ranged, compute::RangeLayout(0, n, groups_, range_));
    values = std::vector<float>(values.begin() + compute::RangeBegin(n, groups_, range_),
                                values.begin() + compute::RangeBegin(n, groups_, range_ + 1));
    stage = std::make_unique<Stage>(std::move(ranged));
  } else {
    stage = std::make_unique<Stage>(std::move(layout));
  }
  {
    absl::MutexLock lock(&stage->mu);
    *stage->center = std::move(values);
    stage->version = 0;
    stage->PublishLocked();
  }
  stages_[0] = std::move(stage);
  num_stages_.store(1, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<TensorBundle> CenterTable::Declaration() const {
  if (!declared_model_ || num_stages() == 0) {
    return absl::FailedPreconditionError(
        declared_model_ ? "no worker has declared the job's model yet"
                        : "this job's model is its spec's MLP (model.layers), not declared");
  }
  return declaration_;
}

int64_t CenterTable::StageParameters(int stage) const {
  if (declared_model_) return declared_layout_->packed_size();
  return stage_parameters_[stage];
}

absl::Status CenterTable::CheckModel(const TensorBundle& model,
                                     const std::string& fixed_by) const {
  int i = 0;
  for (int s = 0; s < num_stages(); ++s) {
    // A declared model's whole layout (a sharded table's stage holds one range of it).
    const compute::StageLayout& whole =
        declared_layout_ != nullptr ? *declared_layout_ : stages_[s]->layout;
    for (const compute::TensorInfo& info : whole.tensors()) {
      const std::string expected =
          absl::StrCat("tensor ", info.id, " '", info.name, "' of shape ",
                       compute::ShapeString(info.shape), " FLOAT32");
      if (i >= model.tensors_size()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the declared model differs from the job's (fixed by ", fixed_by,
            "): it ends after ", i, " tensors where the job has ", expected));
      }
      const Tensor& t = model.tensors(i);
      const bool same = t.id() == info.id && t.name() == info.name && t.dtype() == FLOAT32 &&
                        static_cast<size_t>(t.shape_size()) == info.shape.size() &&
                        std::equal(info.shape.begin(), info.shape.end(), t.shape().begin());
      if (!same) {
        return absl::FailedPreconditionError(absl::StrCat(
            "the declared model differs from the job's (fixed by ", fixed_by, ") at tensor ", i,
            ": declared tensor ", t.id(), " '", t.name(), "' of shape ",
            compute::ShapeString(absl::MakeConstSpan(t.shape().data(), t.shape_size())), " ",
            DType_Name(t.dtype()), ", the job has ", expected));
      }
      ++i;
    }
  }
  if (i != model.tensors_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the declared model differs from the job's (fixed by ", fixed_by, "): it declares ",
        model.tensors_size(), " tensors, the job has ", i, "; the first extra is tensor ", i,
        " '", model.tensors(i).name(), "'"));
  }
  return absl::OkStatus();
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

absl::Status CenterTable::Restore(const CenterRecord& center, const CenterOptRecord* opt) {
  const int stage = center.stage();
  if (declared_model_ && num_stages() == 0 && stage == 0 && groups_ == 1) {
    // The stored center holds the declared tensors: it declares the model again.
    if (absl::Status declared = Declare(center.params()); !declared.ok()) {
      return absl::DataLossError(absl::StrCat("the stored center of the declared model: ",
                                              declared.message()));
    }
  }
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
  // A staged sync still writing would overwrite the restored record with its own.
  s.mu.Await(absl::Condition(&s, &Stage::NoWritesInFlight));
  s.center = std::make_shared<std::vector<float>>(std::move(values));
  s.version = center.version();
  s.lost = absl::OkStatus();
  if (!m.empty()) {
    s.m = std::move(m);
    s.v = std::move(v);
    s.opt_step = opt->state().step();
  }
  s.PublishLocked();
  return absl::OkStatus();
}

void CenterTable::Stage::PublishLocked() {
  written = version;
  durable_version = version;
  durable_center = center;
}

bool CenterTable::Stage::NoWritesInFlight() const { return written == version; }

std::shared_ptr<std::vector<float>> CenterTable::Stage::AcquireBuffer(size_t n) {
  std::unique_ptr<std::vector<float>> buffer;
  {
    absl::MutexLock lock(&pool->mu);
    if (!pool->free.empty()) {
      buffer = std::move(pool->free.back());
      pool->free.pop_back();
    }
  }
  if (buffer == nullptr) buffer = std::make_unique<std::vector<float>>();
  buffer->resize(n);
  std::shared_ptr<BufferPool> home = pool;
  return std::shared_ptr<std::vector<float>>(buffer.release(), [home](std::vector<float>* b) {
    std::unique_ptr<std::vector<float>> owned(b);
    absl::MutexLock lock(&home->mu);
    if (home->free.size() < kPooledBuffers) home->free.push_back(std::move(owned));
  });
}

std::vector<float>& CenterTable::Stage::WritableSpareLocked(size_t n) {
  // A spare still referenced (a staged sync writing it, a reader copying it) is left to them.
  if (spare == nullptr || spare.use_count() > 1) spare = AcquireBuffer(n);
  spare->resize(n);
  return *spare;
}

absl::Status CenterTable::MoveIntoSpare(Stage& s, int stage, absl::Span<const float> x,
                                        double alpha, double w, absl::Span<float> worker_after,
                                        float* max_abs) {
  const size_t n = s.center->size();
  const std::vector<float>& center = *s.center;
  std::vector<float>& spare = s.WritableSpareLocked(n);
  // One pass in cache-sized blocks: the worker's pull toward c_before and the center's move.
  // The kernels are element-wise, so blocks give the same bits as whole-vector calls.
  // Each block's results are checked while in cache; a refused one returns before the commit,
  // with the center as it was (the spare buffer is scratch).
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t len = std::min(kBlock, n - begin);
    const absl::Span<const float> before = absl::MakeConstSpan(center).subspan(begin, len);
    const absl::Span<float> after = worker_after.subspan(begin, len);
    const absl::Span<float> moved = absl::MakeSpan(spare).subspan(begin, len);
    std::memcpy(after.data(), x.data() + begin, len * sizeof(float));
    RETURN_IF_ERROR(compute::ElasticPullWorker(alpha, before, after));
    std::memcpy(moved.data(), before.data(), len * sizeof(float));
    RETURN_IF_ERROR(compute::ElasticMoveCenter(alpha, w, x.subspan(begin, len), moved));
    for (const auto& [values, what] : {std::pair<const float*, const char*>{moved.data(),
                                                                            "the center"},
                                       {after.data(), "the worker's post-sync snapshot"}}) {
      const int64_t bad = FirstOutOfBounds(values, len, max_abs_value_, max_abs);
      if (bad >= 0) {
        const size_t i = begin + static_cast<size_t>(bad);
        return RefusedResult(s.layout, stage, what, static_cast<int64_t>(i), values[bad],
                             max_abs_value_,
                             absl::StrCat("x = ", x[i], ", c = ", center[i], ", weight ", w));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<CenterTable::WeightDecision> CenterTable::MoveLocked(
    Stage& s, int stage, absl::Span<const float> x, double alpha, const WeightFn& weight,
    absl::Span<float> worker_after, float* max_abs) {
  RETURN_IF_ERROR(s.lost);
  const size_t n = s.center->size();
  if (x.size() != n || worker_after.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("params and worker_after must hold ", n,
                                                   " floats (stage ", stage, "), got ", x.size(),
                                                   " and ", worker_after.size()));
  }
  ASSIGN_OR_RETURN(const WeightDecision decision, weight(s.version, Distance(x, *s.center)));
  if (decision.declined()) return decision;
  // The moved center goes to the spare buffer, so the current one stays as it is: it is
  // c_before (no copy for the reply) and what remains if the commit fails (no rollback).
  *max_abs = s.max_abs_seen;
  RETURN_IF_ERROR(MoveIntoSpare(s, stage, x, alpha, decision.weight(), worker_after, max_abs));
  return decision;
}

absl::StatusOr<CenterTable::Update> CenterTable::ElasticSync(int stage, absl::Span<const float> x,
                                                             double alpha, const WeightFn& weight,
                                                             const CommitFn& commit,
                                                             absl::Span<float> worker_after) {
  Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  // Its commit is written here, after every staged sync's before it.
  s.mu.Await(absl::Condition(&s, &Stage::NoWritesInFlight));
  float max_abs = 0.0f;
  ASSIGN_OR_RETURN(const WeightDecision decision,
                   MoveLocked(s, stage, x, alpha, weight, worker_after, &max_abs));
  if (decision.declined()) return Update{true, s.version};
  RETURN_IF_ERROR(commit(s.version + 1, *s.spare, worker_after, *s.center));
  s.center.swap(s.spare);
  s.max_abs_seen = max_abs;
  ++s.version;
  s.PublishLocked();
  return Update{false, s.version};
}

absl::StatusOr<CenterTable::Update> CenterTable::ElasticSyncStaged(
    int stage, absl::Span<const float> x, double alpha, const WeightFn& weight,
    const DecideFn& decide, absl::Span<float> worker_after) {
  Stage& s = *stages_[stage];
  // Kept alive until the writes are done: the records and the reply refer to them.
  std::shared_ptr<const std::vector<float>> before, after;
  StagedWrite staged;
  int64_t mine = 0;
  {
    absl::MutexLock lock(&s.mu);
    auto room = [&s]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
      return s.staged_in_flight < kMaxStagedInFlight;
    };
    s.mu.Await(absl::Condition(&room));
    float max_abs = 0.0f;
    ASSIGN_OR_RETURN(const WeightDecision decision,
                     MoveLocked(s, stage, x, alpha, weight, worker_after, &max_abs));
    if (decision.declined()) return Update{true, s.version};
    mine = s.version + 1;
    ASSIGN_OR_RETURN(staged, decide(mine, *s.spare, worker_after, *s.center));
    // Decided: the next sync moves from this center, while this one's bytes are written.
    before = s.center;
    after = s.spare;
    s.center.swap(s.spare);
    s.max_abs_seen = max_abs;
    s.version = mine;
    ++s.staged_in_flight;
  }
  // Every return below ends this sync's place among the staged ones.
  struct Leave {
    Stage& s;
    ~Leave() {
      absl::MutexLock lock(&s.mu);
      --s.staged_in_flight;
    }
  } leave{s};
  // Outside the lock, beside other syncs of the stage: the tensor files (and the reply).
  const absl::Status prepared = staged.prepare ? staged.prepare() : absl::OkStatus();
  {
    // The records are written in version order: the store's record of the stage always
    // matches the order of its updates.
    absl::MutexLock lock(&s.mu);
    auto my_turn = [&s, mine]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
      return s.written == mine - 1 || !s.lost.ok();
    };
    s.mu.Await(absl::Condition(&my_turn));
    if (!s.lost.ok()) {
      // An earlier sync's write failed: this one is not written (but counted, so that
      // NoWritesInFlight holds again once every decided sync has had its turn).
      if (s.written < mine) s.written = mine;
      return s.lost;
    }
    if (!prepared.ok()) return LoseLocked(s, stage, mine, prepared);
  }
  // Still this sync's turn (written is mine - 1 until it says otherwise): no lock held.
  const absl::Status written = staged.write ? staged.write() : absl::OkStatus();
  {
    absl::MutexLock lock(&s.mu);
    if (!written.ok()) return LoseLocked(s, stage, mine, written);
    s.written = mine;
  }
  // The standbys' acknowledgements, beside the next syncs' writes.
  const absl::Status replicated = staged.await ? staged.await() : absl::OkStatus();
  absl::MutexLock lock(&s.mu);
  if (!replicated.ok()) return LoseLocked(s, stage, mine, replicated);
  if (mine > s.durable_version) {
    s.durable_version = mine;
    s.durable_center = std::move(after);
  }
  return Update{false, mine};
}

absl::Status CenterTable::LoseLocked(Stage& s, int stage, int64_t version,
                                     const absl::Status& error) {
  // The decided center holds this update, which is not durable: the stage refuses work (and
  // every sync decided after this one fails at its turn) until the server restarts and
  // reloads its durable state. Readers never saw it: they read the durable center.
  if (s.lost.ok()) {
    s.lost = absl::UnavailableError(absl::StrCat(
        "stage ", stage, " could not commit version ", version, " (", error.message(),
        "); it refuses work until the server restarts and reloads its durable state"));
  }
  if (s.written < version) s.written = version;
  return error;
}

void CenterTable::AwaitWrites(int stage) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  // The versions decided so far, not the ones decided while waiting (no starvation).
  const int64_t decided = s.version;
  auto done = [&s, decided]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    return s.durable_version >= decided || !s.lost.ok();
  };
  s.mu.Await(absl::Condition(&done));
}

absl::StatusOr<CenterTable::Update> CenterTable::ApplyAdaHessian(
    int stage, absl::Span<const float> g, absl::Span<const float> d,
    const AdaHessianConfig& config, const WeightFn& weight, const OptCommitFn& commit) {
  Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  s.mu.Await(absl::Condition(&s, &Stage::NoWritesInFlight));
  RETURN_IF_ERROR(s.lost);
  const size_t n = s.center->size();
  if (g.size() != n || d.size() != n) {
    return absl::InvalidArgumentError(
        absl::StrCat("gradient and hessian_diag must hold ", n, " floats"));
  }
  if (s.m.empty()) {
    s.m.assign(n, 0.0f);
    s.v.assign(n, 0.0f);
  }
  ASSIGN_OR_RETURN(const WeightDecision decision, weight(s.version, Norm(g)));
  if (decision.declined()) return Update{true, s.version};
  const double w = decision.weight();
  const std::vector<float>& center = *s.center;
  if (!(w >= 0.0 && w <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("weight must be in [0, 1], got ", w));
  }
  const int64_t t = s.opt_step + 1;
  if (t < 1) return absl::InvalidArgumentError(absl::StrCat("optimizer step ", t, " < 1"));
  const compute::AdaHessianScalars scalars = compute::MakeAdaHessianScalars(config, t, w);
  // Out of place into the spare buffers, in cache-sized blocks, each block's results checked
  // while in cache: a refused push returns with c, m and v as they were.
  std::vector<float>& spare = s.WritableSpareLocked(n);
  s.spare_m.resize(n);
  s.spare_v.resize(n);
  float max_abs = s.max_abs_seen;
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t len = std::min(kBlock, n - begin);
    RETURN_IF_ERROR(compute::AdaHessianUpdateInto(
        scalars, g.subspan(begin, len), d.subspan(begin, len),
        absl::MakeConstSpan(s.m).subspan(begin, len), absl::MakeConstSpan(s.v).subspan(begin, len),
        absl::MakeConstSpan(center).subspan(begin, len),
        absl::MakeSpan(s.spare_m).subspan(begin, len),
        absl::MakeSpan(s.spare_v).subspan(begin, len),
        absl::MakeSpan(spare).subspan(begin, len)));
    float unbounded = 0.0f;  // m and v need only be finite
    for (const auto& [values, what, limit, seen] :
         {std::tuple<const float*, const char*, float, float*>{
              spare.data() + begin, "the center", max_abs_value_, &max_abs},
          {s.spare_m.data() + begin, "the center's AdaHessian m", kFiniteOnly, &unbounded},
          {s.spare_v.data() + begin, "the center's AdaHessian v", kFiniteOnly, &unbounded}}) {
      const int64_t bad = FirstOutOfBounds(values, len, limit, seen);
      if (bad >= 0) {
        const size_t i = begin + static_cast<size_t>(bad);
        return RefusedResult(
            s.layout, stage, what, static_cast<int64_t>(i), values[bad], limit,
            absl::StrCat("g = ", g[i], ", D = ", d[i], ", c = ", center[i], ", m = ", s.m[i],
                         ", v = ", s.v[i], ", weight ", w));
      }
    }
  }
  absl::Status committed = commit(s.version + 1, spare, t, s.spare_m, s.spare_v);
  if (!committed.ok()) {
    // The store is failing (its batch is atomic, so memory still matches it), which needs the
    // operator: the stage refuses work until the server restarts and reloads its durable state.
    s.lost = absl::UnavailableError(absl::StrCat(
        "stage ", stage, " could not commit a push (", committed.message(),
        "); it refuses work until the server restarts and reloads its durable state"));
    return committed;
  }
  s.center.swap(s.spare);
  s.m.swap(s.spare_m);
  s.v.swap(s.spare_v);
  s.max_abs_seen = max_abs;
  s.opt_step = t;
  ++s.version;
  s.PublishLocked();
  return Update{false, s.version};
}

absl::StatusOr<std::pair<std::vector<float>, int64_t>> CenterTable::Read(int stage) const {
  const Stage& s = *stages_[stage];
  std::shared_ptr<const std::vector<float>> center;
  int64_t version = 0;
  {
    absl::MutexLock lock(&s.mu);
    RETURN_IF_ERROR(s.lost);
    center = s.durable_center;
    version = s.durable_version;
  }
  // Copied outside the lock: a published center is never written again.
  return std::make_pair(*center, version);
}

float CenterTable::max_abs_seen(int stage) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  return s.max_abs_seen;
}

int64_t CenterTable::version(int stage) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  return s.durable_version;
}

absl::Status CenterTable::Health() const {
  for (int s = 0; s < num_stages(); ++s) {
    const Stage& stage = *stages_[s];
    absl::MutexLock lock(&stage.mu);
    if (!stage.lost.ok()) return stage.lost;
  }
  return absl::OkStatus();
}

int64_t CenterTable::WaitForVersion(int stage, int64_t min_version, absl::Duration timeout) const {
  const Stage& s = *stages_[stage];
  absl::MutexLock lock(&s.mu);
  auto reached = [&s, min_version]() ABSL_SHARED_LOCKS_REQUIRED(s.mu) {
    return s.durable_version >= min_version;
  };
  s.mu.AwaitWithTimeout(absl::Condition(&reached), timeout);
  return s.durable_version;
}

}  // namespace rebound::server
