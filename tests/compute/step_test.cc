// Whole local steps (compute/step.h): determinism across repeated runs, across parallel-replay
// block splits and across stage splits, the loss normalisation, evaluation and learning, and the
// gradient and D handed out without an update (mode ASYNC_ADAHESSIAN).

#include "compute/step.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "compute/adahessian.h"
#include "tests/compute/reference_mlp.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::MakeSpec;
using testing::UniformFloats;
using testing::UniformLabels;

ModelSpec TestModel() {
  return MakeSpec(12, {{16, rebound::GELU}, {14, rebound::TANH}, {10, rebound::RELU},
                       {5, rebound::IDENTITY}},
                  /*init_seed=*/3);
}

struct Batch {
  std::vector<float> images;
  std::vector<int32_t> labels;
};

Batch MakeBatch(int samples, int input_dim, int classes, uint32_t seed) {
  return Batch{UniformFloats(samples * input_dim, -1, 1, seed),
               UniformLabels(samples, classes, seed + 1)};
}

// Parameters, then m, v and last D, each concatenated over the stages in the packed layout (so
// the result does not depend on how the model is split).
std::vector<float> FullState(LocalTrainer& trainer) {
  std::vector<float> parts[4];
  for (int s = 0; s < trainer.num_stages(); ++s) {
    const int64_t n = trainer.stage(s).layout().packed_size();
    std::vector<float> p(n), m(n), v(n), d(n);
    REQUIRE(trainer.stage(s).GetParams(absl::MakeSpan(p)).ok());
    REQUIRE(trainer.optimizer(s).GetState(absl::MakeSpan(m), absl::MakeSpan(v),
                                          absl::MakeSpan(d))
                .ok());
    parts[0].insert(parts[0].end(), p.begin(), p.end());
    parts[1].insert(parts[1].end(), m.begin(), m.end());
    parts[2].insert(parts[2].end(), v.begin(), v.end());
    parts[3].insert(parts[3].end(), d.begin(), d.end());
  }
  std::vector<float> all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

std::vector<float> Params(LocalTrainer& trainer) {
  std::vector<float> all;
  for (int s = 0; s < trainer.num_stages(); ++s) {
    std::vector<float> p(trainer.stage(s).layout().packed_size());
    REQUIRE(trainer.stage(s).GetParams(absl::MakeSpan(p)).ok());
    all.insert(all.end(), p.begin(), p.end());
  }
  return all;
}

std::unique_ptr<LocalTrainer> NewTrainer(Backend* backend, const TrainerOptions& options) {
  auto trainer = LocalTrainer::Create(backend, options);
  REQUIRE(trainer.ok());
  REQUIRE((*trainer)->InitParams().ok());
  return std::move(trainer).value();
}

TrainerOptions DefaultOptions() {
  TrainerOptions options;
  options.model = TestModel();
  options.optimizer.set_lr(0.05);
  options.batch_size = 24;
  options.micro_batches = 6;
  options.seed = 1234;
  options.replica = 2;
  return options;
}

TEST_CASE("repeated runs of the same steps give bit-identical parameters", "[step]") {
  auto backend = testing::CpuBackend();
  const TrainerOptions options = DefaultOptions();
  std::vector<float> first_state;
  std::vector<float> first_losses;
  for (int run = 0; run < 2; ++run) {
    auto trainer = NewTrainer(backend.get(), options);
    std::vector<float> losses;
    for (int t = 1; t <= 3; ++t) {
      const Batch batch = MakeBatch(24, 12, 5, 100 + t);
      auto loss = trainer->Step(t, batch.images, batch.labels);
      REQUIRE(loss.ok());
      losses.push_back(*loss);
    }
    if (run == 0) {
      first_state = FullState(*trainer);
      first_losses = losses;
    } else {
      CHECK(BitEqual(FullState(*trainer), first_state));
      CHECK(BitEqual(losses, first_losses));
    }
  }
}

// Replays steps 1..3 the way k spares would: each tree-aligned block separately (with only its
// own rows uploaded when `block_rows`, as a spare does), then the combination with the top of
// the tree, then the same update everywhere.
std::vector<float> RunWithBlocks(Backend* backend, const TrainerOptions& options, int k,
                                 bool block_rows = false) {
  auto trainer = NewTrainer(backend, options);
  const int m = options.micro_batches;
  const std::vector<TreeNode> blocks = TreeAlignedBlocks(m, k).value();
  std::vector<std::unique_ptr<TreeAccumulator>> leaders;
  for (int s = 0; s < trainer->num_stages(); ++s) {
    leaders.push_back(
        TreeAccumulator::Create(backend, trainer->stage(s).layout().sums_size()).value());
  }
  for (int t = 1; t <= 3; ++t) {
    const Batch batch = MakeBatch(options.batch_size, 12, 5, 100 + t);
    if (!block_rows) REQUIRE(trainer->LoadBatch(batch.images, batch.labels).ok());
    // partials[block][stage]
    std::vector<std::vector<DeviceBuffer>> partials;
    const int rows = options.batch_size / m;
    for (const TreeNode& block : blocks) {
      if (block_rows) {
        REQUIRE(trainer
                    ->LoadBlock(block,
                                absl::MakeConstSpan(batch.images)
                                    .subspan(block.begin * rows * 12, block.size() * rows * 12),
                                absl::MakeConstSpan(batch.labels)
                                    .subspan(block.begin * rows, block.size() * rows))
                    .ok());
        if (block.begin > 0) {
          // The other rows are not there: computing outside the block is refused.
          CHECK(trainer->ComputeBlock(t, {0, m}).status().code() ==
                absl::StatusCode::kFailedPrecondition);
        }
      }
      auto sums = trainer->ComputeBlock(t, block);
      REQUIRE(sums.ok());
      std::vector<DeviceBuffer> copies;
      for (const ConstDSpan& span : *sums) {
        DeviceBuffer copy = backend->Allocate(span.size).value();
        REQUIRE(backend->Copy(span, copy.span()).ok());
        copies.push_back(std::move(copy));
      }
      partials.push_back(std::move(copies));
    }
    std::vector<ConstDSpan> combined;
    for (int s = 0; s < trainer->num_stages(); ++s) {
      REQUIRE(leaders[s]->Start(m, {0, m}, trainer->ActiveSumsLength(s, t)).ok());
      for (size_t b = 0; b < blocks.size(); ++b) {
        REQUIRE(leaders[s]->CommitCopy(blocks[b], partials[b][s].span()).ok());
      }
      combined.push_back(leaders[s]->Result().value());
    }
    REQUIRE(trainer->Apply(t, combined).ok());
  }
  return FullState(*trainer);
}

TEST_CASE("block splits for k = 1, 2, 4 spares reproduce the trainer's bits", "[step]") {
  auto backend = testing::CpuBackend();
  for (int m : {4, 6}) {
    TrainerOptions options = DefaultOptions();
    options.micro_batches = m;
    options.optimizer.set_hessian_every(2);  // steps 1 and 3 with Hessian, step 2 without
    // A schedule: steps 1, 2 and 3 each use a different lr, which the replay must reproduce.
    options.optimizer.set_warmup_steps(2);
    options.optimizer.set_lr_decay(LR_COSINE);
    options.optimizer.set_decay_steps(4);
    REQUIRE(LearningRate(options.optimizer, 3) < LearningRate(options.optimizer, 2));
    auto trainer = NewTrainer(backend.get(), options);
    for (int t = 1; t <= 3; ++t) {
      const Batch batch = MakeBatch(options.batch_size, 12, 5, 100 + t);
      REQUIRE(trainer->Step(t, batch.images, batch.labels).ok());
    }
    const std::vector<float> reference = FullState(*trainer);
    for (int k : {1, 2, 4}) {
      INFO("M = " << m << ", k = " << k);
      CHECK(BitEqual(RunWithBlocks(backend.get(), options, k), reference));
      CHECK(BitEqual(RunWithBlocks(backend.get(), options, k, /*block_rows=*/true), reference));
    }
  }
}

TEST_CASE("1-stage and multi-stage runs of the same model end bit-identical", "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  options.optimizer.set_block_size(3);
  options.optimizer.set_hessian_every(2);
  std::vector<float> reference;
  std::vector<float> reference_losses;
  for (const std::vector<int>& boundaries :
       std::vector<std::vector<int>>{{}, {2}, {1, 3}, {1, 2, 3}}) {
    INFO("stage boundaries " << ::Catch::Detail::stringify(boundaries));
    options.stage_boundaries = boundaries;
    auto trainer = NewTrainer(backend.get(), options);
    REQUIRE(trainer->num_stages() == static_cast<int>(boundaries.size()) + 1);
    std::vector<float> losses;
    for (int t = 1; t <= 4; ++t) {
      const Batch batch = MakeBatch(options.batch_size, 12, 5, 200 + t);
      auto loss = trainer->Step(t, batch.images, batch.labels);
      REQUIRE(loss.ok());
      losses.push_back(*loss);
    }
    const std::vector<float> state = FullState(*trainer);
    if (boundaries.empty()) {
      reference = state;
      reference_losses = losses;
    } else {
      CHECK(BitEqual(state, reference));
      CHECK(BitEqual(losses, reference_losses));

    }
  }
}

// Copies a device span to the host (what a pipeline stage sends to its neighbour).
std::vector<float> HostCopy(Backend& backend, ConstDSpan span) {
  return testing::ToHost(backend, span);
}

TEST_CASE("segments run in GPipe order across stages end bit-identical to the whole model",
          "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  options.optimizer.set_hessian_every(2);  // steps with and without the R-op
  auto whole = NewTrainer(backend.get(), options);
  // Three segments: layers [0, 1), [1, 3) (two stages inside) and [3, 4).
  std::vector<std::unique_ptr<LocalTrainer>> segments;
  for (auto [first, end, inner] : std::vector<std::tuple<int, int, std::vector<int>>>{
           {0, 1, {}}, {1, 3, {2}}, {3, 4, {}}}) {
    TrainerOptions part = options;
    part.first_layer = first;
    part.end_layer = end;
    part.stage_boundaries = inner;
    segments.push_back(NewTrainer(backend.get(), part));
  }
  CHECK(segments[0]->starts_at_input());
  CHECK_FALSE(segments[0]->ends_at_loss());
  CHECK_FALSE(segments[1]->starts_at_input());
  CHECK(segments[2]->ends_at_loss());
  const int m = options.micro_batches;
  for (int t = 1; t <= 4; ++t) {
    INFO("step " << t);
    const Batch batch = MakeBatch(options.batch_size, 12, 5, 300 + t);
    auto whole_loss = whole->Step(t, batch.images, batch.labels);
    REQUIRE(whole_loss.ok());
    for (auto& segment : segments) {
      REQUIRE(segment
                  ->LoadBatch(segment->starts_at_input() ? absl::Span<const float>(batch.images)
                                                         : absl::Span<const float>(),
                              batch.labels)
                  .ok());
      REQUIRE(segment->BeginStep(t).ok());
    }
    // Every forward first, stage by stage, then every backward in reverse micro-batch order.
    for (int mb = 0; mb < m; ++mb) {
      std::vector<float> pair;
      for (size_t k = 0; k < segments.size(); ++k) {
        if (k > 0) REQUIRE(segments[k]->SetForwardInput(mb, pair).ok());
        auto out = segments[k]->ForwardMicroBatch(mb);
        REQUIRE(out.ok());
        pair = HostCopy(*backend, *out);
        if (k + 1 < segments.size()) {
          CHECK(static_cast<int64_t>(pair.size()) == segments[k + 1]->ForwardInputLength(t));
        }
      }
    }
    for (int mb = m - 1; mb >= 0; --mb) {
      std::vector<float> pair;
      for (size_t k = segments.size(); k-- > 0;) {
        if (k + 1 < segments.size()) REQUIRE(segments[k]->SetBackwardInput(mb, pair).ok());
        auto back = segments[k]->BackwardMicroBatch(mb);
        REQUIRE(back.ok());
        pair = HostCopy(*backend, *back);
      }
      CHECK(pair.empty());  // the first segment returns nothing
    }
    float loss = 0;
    for (size_t k = 0; k < segments.size(); ++k) {
      auto finished = segments[k]->FinishStep();
      REQUIRE(finished.ok());
      if (k + 1 < segments.size()) {
        CHECK(std::isnan(*finished));
      } else {
        loss = *finished;
      }
    }
    CHECK(BitEqual(std::vector<float>{loss}, std::vector<float>{*whole_loss}));
  }
  std::vector<float> split;
  for (auto& segment : segments) {
    const std::vector<float> part = Params(*segment);
    split.insert(split.end(), part.begin(), part.end());
  }
  CHECK(BitEqual(split, Params(*whole)));
  // Out of order: a backward before its inputs, a step finished early.
  REQUIRE(segments[1]->BeginStep(5).ok());
  CHECK(segments[1]->FinishStep().status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(segments[1]->SetForwardInput(0, std::vector<float>(3)).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(segments[0]->SetForwardInput(0, std::vector<float>(3)).code() ==
        absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("the step loss is the batch mean cross-entropy for any micro-batch count", "[step]") {
  auto backend = testing::CpuBackend();
  const Batch batch = MakeBatch(24, 12, 5, 7);
  const std::vector<LayerInfo> layers = ModelLayers(TestModel()).value();
  for (int m : {1, 2, 3, 8}) {
    INFO("M = " << m);
    TrainerOptions options = DefaultOptions();
    options.micro_batches = m;
    auto trainer = NewTrainer(backend.get(), options);
    const std::vector<float> theta = Params(*trainer);
    const double ref = testing::RefLoss(
        layers, std::vector<double>(theta.begin(), theta.end()),
        std::vector<double>(batch.images.begin(), batch.images.end()),
        std::vector<int>(batch.labels.begin(), batch.labels.end()), 24);
    auto eval = trainer->Evaluate(batch.images, batch.labels, 5);
    REQUIRE(eval.ok());
    CHECK(eval->samples == 24);
    CHECK(eval->loss == Approx(ref).epsilon(1e-5));
    auto loss = trainer->Step(1, batch.images, batch.labels);
    REQUIRE(loss.ok());
    CHECK(*loss == Approx(ref).epsilon(1e-5));
  }
}

TEST_CASE("the summed micro-batch gradient is the full-batch gradient", "[step]") {
  auto backend = testing::CpuBackend();
  const Batch batch = MakeBatch(24, 12, 5, 8);
  TrainerOptions options = DefaultOptions();
  auto trainer = NewTrainer(backend.get(), options);
  const std::vector<float> theta = Params(*trainer);
  REQUIRE(trainer->LoadBatch(batch.images, batch.labels).ok());
  auto sums = trainer->ComputeBlock(1, {0, options.micro_batches});
  REQUIRE(sums.ok());
  const StageLayout& layout = trainer->stage(0).layout();
  std::vector<float> padded = testing::ToHost(*backend, (*sums)[0].sub(0, layout.padded_size()));
  std::vector<float> grad(layout.packed_size());
  REQUIRE(layout.Pack(padded, absl::MakeSpan(grad)).ok());
  const std::vector<double> ref = testing::RefGradient(
      ModelLayers(TestModel()).value(), std::vector<double>(theta.begin(), theta.end()),
      std::vector<double>(batch.images.begin(), batch.images.end()),
      std::vector<int>(batch.labels.begin(), batch.labels.end()), 24);
  double gmax = 0;
  for (double g : ref) gmax = std::max(gmax, std::abs(g));
  for (size_t i = 0; i < grad.size(); ++i) {
    INFO("parameter " << i);
    CHECK(std::abs(grad[i] - ref[i]) <= 1e-5 * gmax + 1e-7);
  }
}

TEST_CASE("evaluation reports the fraction of correct argmax predictions", "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  auto trainer = NewTrainer(backend.get(), options);
  const Batch data = MakeBatch(37, 12, 5, 9);
  auto eval = trainer->Evaluate(data.images, data.labels, 10);
  REQUIRE(eval.ok());
  // Counted here with the double reference: the label is the argmax of the logits iff no other
  // label gives the sample a lower cross-entropy.
  const std::vector<LayerInfo> layers = ModelLayers(TestModel()).value();
  const std::vector<float> theta = Params(*trainer);
  int correct = 0;
  for (int r = 0; r < 37; ++r) {
    std::vector<double> x(data.images.begin() + r * 12, data.images.begin() + (r + 1) * 12);
    const std::vector<double> th(theta.begin(), theta.end());
    const double own = testing::RefLoss(layers, th, x, {data.labels[r]}, 1);
    bool best = true;
    for (int c = 0; c < 5; ++c) {
      if (c != data.labels[r] && testing::RefLoss(layers, th, x, {c}, 1) < own) best = false;
    }
    correct += best;
  }
  CHECK(eval->accuracy == Approx(correct / 37.0).margin(1e-12));
  CHECK(eval->samples == 37);
}

TEST_CASE("training on a learnable synthetic task lowers the loss", "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  options.batch_size = 32;
  options.micro_batches = 4;
  options.optimizer.set_lr(0.02);
  auto trainer = NewTrainer(backend.get(), options);
  // Labels from a fixed random linear teacher: learnable by the model.
  const int n = 256;
  const std::vector<float> x = UniformFloats(n * 12, -1, 1, 55);
  const std::vector<float> teacher = UniformFloats(12 * 5, -1, 1, 56);
  std::vector<int32_t> y(n);
  for (int i = 0; i < n; ++i) {
    int best = 0;
    double best_score = -1e30;
    for (int c = 0; c < 5; ++c) {
      double s = 0;
      for (int j = 0; j < 12; ++j) s += x[i * 12 + j] * teacher[j * 5 + c];
      if (s > best_score) {
        best_score = s;
        best = c;
      }
    }
    y[i] = best;
  }
  const EvalResult before = trainer->Evaluate(x, y).value();
  for (int t = 1; t <= 120; ++t) {
    const int first = ((t - 1) * 32) % n;
    const std::vector<float> bx(x.begin() + first * 12, x.begin() + (first + 32) * 12);
    const std::vector<int32_t> by(y.begin() + first, y.begin() + first + 32);
    REQUIRE(trainer->Step(t, bx, by).ok());
  }
  const EvalResult after = trainer->Evaluate(x, y).value();
  INFO("loss " << before.loss << " -> " << after.loss << ", accuracy " << before.accuracy
               << " -> " << after.accuracy);
  CHECK(after.loss < 0.6 * before.loss);
  CHECK(after.accuracy > before.accuracy + 0.3);
}

void SetAllParams(LocalTrainer& trainer, const std::vector<float>& all) {
  size_t offset = 0;
  for (int s = 0; s < trainer.num_stages(); ++s) {
    const size_t n = trainer.stage(s).layout().packed_size();
    REQUIRE(trainer.stage(s)
                .SetParams(absl::MakeConstSpan(all).subspan(offset, n))
                .ok());
    offset += n;
  }
  REQUIRE(offset == all.size());
}

// The per-step g and D of ComputeGradients over steps 1..4 of a model split at `boundaries`.
struct PushedSteps {
  std::vector<std::vector<float>> g, d;
  std::vector<float> losses;
};

TEST_CASE("ComputeGradients' g and D applied as the server does reproduce Step bit for bit",
          "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  options.optimizer.set_block_size(3);
  options.optimizer.set_hessian_every(2);  // D at steps 1 and 3, reused at 2 and 4
  options.optimizer.set_weight_decay(0.01);
  std::vector<PushedSteps> runs;
  for (const std::vector<int>& boundaries : std::vector<std::vector<int>>{{}, {2}, {1, 3}}) {
    INFO("stage boundaries " << ::Catch::Detail::stringify(boundaries));
    options.stage_boundaries = boundaries;
    auto pusher = NewTrainer(backend.get(), options);  // plays the trainer of §4.6
    auto local = NewTrainer(backend.get(), options);   // plays the local AdaHessian of §4.3
    const int64_t n = pusher->packed_size();
    REQUIRE(n == static_cast<int64_t>(Params(*pusher).size()));
    // The server's copy of the center and its own m, v, fresh.
    std::vector<float> theta = Params(*pusher);
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    PushedSteps run;
    for (int t = 1; t <= 4; ++t) {
      INFO("step " << t);
      const Batch batch = MakeBatch(options.batch_size, 12, 5, 300 + t);
      std::vector<float> g(n, NAN), d(n, NAN);
      auto pushed_loss = pusher->ComputeGradients(t, batch.images, batch.labels,
                                                  absl::MakeSpan(g), absl::MakeSpan(d));
      REQUIRE(pushed_loss.ok());
      // Nothing was applied: the parameters and m, v are as before.
      CHECK(BitEqual(Params(*pusher), theta));
      const std::vector<float> state = FullState(*pusher);
      CHECK(BitEqual(std::vector<float>(state.begin() + n, state.begin() + 3 * n),
                     std::vector<float>(2 * n, 0.0f)));
      // The trainer's last D is the one it handed out.
      CHECK(BitEqual(std::vector<float>(state.begin() + 3 * n, state.end()), d));

      REQUIRE(ServerAdaHessianApply(options.optimizer, 1.0, t, g, d, absl::MakeSpan(m),
                                    absl::MakeSpan(v), absl::MakeSpan(theta))
                  .ok());
      auto local_loss = local->Step(t, batch.images, batch.labels);
      REQUIRE(local_loss.ok());
      CHECK(*pushed_loss == *local_loss);
      const std::vector<float> local_state = FullState(*local);
      CHECK(BitEqual(std::vector<float>(local_state.begin(), local_state.begin() + n), theta));
      CHECK(BitEqual(std::vector<float>(local_state.begin() + n, local_state.begin() + 2 * n),
                     m));
      CHECK(BitEqual(std::vector<float>(local_state.begin() + 2 * n,
                                        local_state.begin() + 3 * n),
                     v));
      CHECK(BitEqual(std::vector<float>(local_state.begin() + 3 * n, local_state.end()), d));
      // The trainer pulls the updated center.
      SetAllParams(*pusher, theta);
      run.g.push_back(g);
      run.d.push_back(d);
      run.losses.push_back(*pushed_loss);
    }
    // D is fresh at the Hessian steps 1 and 3 and reused at 2 and 4; g is fresh every step.
    CHECK(BitEqual(run.d[1], run.d[0]));
    CHECK(BitEqual(run.d[3], run.d[2]));
    CHECK_FALSE(BitEqual(run.d[2], run.d[0]));
    CHECK_FALSE(BitEqual(run.g[1], run.g[0]));
    // Block averaging over 3 along a row: layer 0's weight rows have 12 = 4 x 3 entries, so
    // each block of 3 holds one value.
    for (int i = 0; i < 12; i += 3) {
      CHECK(run.d[0][i] == run.d[0][i + 1]);
      CHECK(run.d[0][i] == run.d[0][i + 2]);
    }
    bool nonzero = false;
    for (float x : run.d[0]) nonzero = nonzero || x != 0.0f;
    CHECK(nonzero);
    runs.push_back(std::move(run));
  }
  // Any split of the model hands out the same bits.
  for (size_t r = 1; r < runs.size(); ++r) {
    for (int t = 0; t < 4; ++t) {
      CHECK(BitEqual(runs[r].g[t], runs[0].g[t]));
      CHECK(BitEqual(runs[r].d[t], runs[0].d[t]));
    }
    CHECK(BitEqual(runs[r].losses, runs[0].losses));
  }
}

TEST_CASE("ComputeGradients rejects wrong output sizes and changes nothing", "[step]") {
  auto backend = testing::CpuBackend();
  const TrainerOptions options = DefaultOptions();
  auto trainer = NewTrainer(backend.get(), options);
  const std::vector<float> before = FullState(*trainer);
  const int64_t n = trainer->packed_size();
  const Batch batch = MakeBatch(options.batch_size, 12, 5, 11);
  std::vector<float> g(n), d(n + 1);
  CHECK(trainer->ComputeGradients(1, batch.images, batch.labels, absl::MakeSpan(g),
                                  absl::MakeSpan(d))
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  d.resize(n);
  Batch bad = batch;
  bad.labels[0] = 5;
  CHECK(trainer->ComputeGradients(1, bad.images, bad.labels, absl::MakeSpan(g),
                                  absl::MakeSpan(d))
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(BitEqual(FullState(*trainer), before));
}

TEST_CASE("bad trainer options and batches are rejected", "[step]") {
  auto backend = testing::CpuBackend();
  TrainerOptions options = DefaultOptions();
  options.micro_batches = 5;  // does not divide 24
  CHECK(LocalTrainer::Create(backend.get(), options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options = DefaultOptions();
  options.stage_boundaries = {2, 2};
  CHECK(LocalTrainer::Create(backend.get(), options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  options = DefaultOptions();
  auto trainer = NewTrainer(backend.get(), options);
  Batch batch = MakeBatch(24, 12, 5, 1);
  batch.labels[3] = 5;
  CHECK(trainer->Step(1, batch.images, batch.labels).status().code() ==
        absl::StatusCode::kInvalidArgument);
  batch = MakeBatch(23, 12, 5, 1);
  CHECK(trainer->Step(1, batch.images, batch.labels).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(trainer->ComputeBlock(1, {0, 6}).status().code() ==
        absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace compute
}  // namespace rebound
