// Worker-step benchmark (docs/design.md §9: "worker step (fwd + bwd + HVP), CPU >= 0.5x of OpenBLAS
// sgemm's FLOP rate on the same shapes").
//
// Measures, in one run and on the CPU backend:
//   * a full local training step (LocalTrainer::Step: M micro-batches of forward, backward and
//     the exact Hessian-vector product, the tree reduction, D and the AdaHessian update), and
//     the forward + backward + HVP part alone (ComputeBlock);
//   * bare cblas_sgemm on exactly the GEMM calls of one step (same shapes, transposes, alpha and
//     beta), enumerated below from the algorithm of compute/mlp.h and checked against the
//     backend's own count of the FLOPs it ran.
// FLOPs are those of the GEMMs only (2 m n k each); everything else the step does counts as
// overhead. Each figure is the best of several rounds. The last line is
//   RESULT compute: step_gflops=<x> sgemm_gflops=<y> ratio=<x/y>
//
// Flags: --threads=N (OpenBLAS threads, default 1), --batch=B (256), --micro_batches=M (4),
// --steps=S per round (4), --rounds=R (3), --activation=relu|tanh|gelu (relu).

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "bench/flags.h"
#include "compute/backend.h"
#include "compute/backend_factory.h"
#include "compute/step.h"
#include "proto/config.pb.h"

namespace rebound {
namespace compute {
namespace {

struct Flags {
  int threads = 1;
  int batch = 256;
  int micro_batches = 4;
  int steps = 4;
  int rounds = 3;
  std::string activation = "relu";
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const char* a = argv[i];
    if (bench::ParseIntFlag(a, "--threads", &flags.threads) ||
        bench::ParseIntFlag(a, "--batch", &flags.batch) ||
        bench::ParseIntFlag(a, "--micro_batches", &flags.micro_batches) ||
        bench::ParseIntFlag(a, "--steps", &flags.steps) ||
        bench::ParseIntFlag(a, "--rounds", &flags.rounds) ||
        bench::ParseTextFlag(a, "--activation", &flags.activation)) {
      continue;
    }
    bench::ExitUnknownFlag(a);
  }
  return flags;
}

struct GemmCall {
  bool ta;
  bool tb;
  int m;
  int n;
  int k;
  float beta;
};

// The GEMM calls of one micro-batch of `rows` rows through the whole model with the R-op, in
// the order compute/mlp.cc issues them (forward: a and R{a}; backward: grad W, Hz W, then
// [R{e}; e] and R{e} += delta V except below layer 0).
std::vector<GemmCall> MicroBatchGemms(const std::vector<LayerInfo>& layers, int rows) {
  std::vector<GemmCall> calls;
  for (const LayerInfo& l : layers) {
    if (l.index == 0) {
      calls.push_back({false, true, rows, l.out, l.in, 0.0f});
      calls.push_back({false, true, rows, l.out, l.in, 0.0f});
    } else {
      calls.push_back({false, true, 2 * rows, l.out, l.in, 0.0f});
      calls.push_back({false, true, rows, l.out, l.in, 1.0f});
    }
  }
  for (int i = static_cast<int>(layers.size()) - 1; i >= 0; --i) {
    const LayerInfo& l = layers[i];
    calls.push_back({true, false, l.out, l.in, rows, 0.0f});
    calls.push_back({true, false, l.out, l.in, l.index == 0 ? rows : 2 * rows, 0.0f});
    if (l.index > 0) {
      calls.push_back({false, false, 2 * rows, l.in, l.out, 0.0f});
      calls.push_back({false, false, rows, l.in, l.out, 1.0f});
    }
  }
  return calls;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

rebound::Activation ParseActivation(const std::string& name) {
  if (name == "tanh") return rebound::TANH;
  if (name == "gelu") return rebound::GELU;
  return rebound::RELU;
}

int Run(const Flags& flags) {
  ComputeConfig compute;
  compute.set_backend(CPU);
  compute.set_threads(flags.threads);
  auto backend_or = CreateBackend(compute);
  if (!backend_or.ok()) {
    std::fprintf(stderr, "backend: %s\n", backend_or.status().ToString().c_str());
    return 1;
  }
  Backend& backend = **backend_or;

  TrainerOptions options;
  options.model.set_input_dim(784);
  const rebound::Activation act = ParseActivation(flags.activation);
  for (int width : {1024, 1024}) {
    LayerSpec* l = options.model.add_layers();
    l->set_width(width);
    l->set_activation(act);
  }
  LayerSpec* out = options.model.add_layers();
  out->set_width(10);
  out->set_activation(rebound::IDENTITY);
  // A small lr keeps this random-pixel problem numerically tame over many steps (Adam-like
  // updates of ~lr per weight on 784 unnormalised inputs overshoot at the default 0.15); the
  // work per step does not depend on it.
  options.optimizer.set_lr(0.001);
  options.batch_size = flags.batch;
  options.micro_batches = flags.micro_batches;
  auto trainer_or = LocalTrainer::Create(&backend, options);
  if (!trainer_or.ok()) {
    std::fprintf(stderr, "trainer: %s\n", trainer_or.status().ToString().c_str());
    return 1;
  }
  LocalTrainer& trainer = **trainer_or;
  if (!trainer.InitParams().ok()) return 1;

  std::mt19937 gen(1);
  std::uniform_real_distribution<float> pixel(0.0f, 1.0f);
  std::uniform_int_distribution<int> label(0, 9);
  std::vector<float> images(static_cast<size_t>(flags.batch) * 784);
  std::vector<int32_t> labels(flags.batch);
  for (float& x : images) x = pixel(gen);
  for (int32_t& y : labels) y = label(gen);

  const std::vector<LayerInfo> layers = ModelLayers(options.model).value();
  const int rows = flags.batch / flags.micro_batches;
  std::vector<GemmCall> step_gemms;
  for (int m = 0; m < flags.micro_batches; ++m) {
    const std::vector<GemmCall> mb = MicroBatchGemms(layers, rows);
    step_gemms.insert(step_gemms.end(), mb.begin(), mb.end());
  }
  double flops_per_step = 0;
  for (const GemmCall& g : step_gemms) flops_per_step += 2.0 * g.m * g.n * g.k;

  // Warm-up, and the cross-check of the enumerated shapes against what the backend ran.
  int64_t t = 1;
  for (int i = 0; i < 2; ++i) {
    if (!trainer.Step(t++, images, labels).ok()) return 1;
  }
  backend.ResetCounters();
  if (!trainer.Step(t++, images, labels).ok()) return 1;
  if (backend.counters().gemm_flops != flops_per_step ||
      backend.counters().gemm_calls != static_cast<int64_t>(step_gemms.size())) {
    std::fprintf(stderr, "GEMM enumeration (%zu calls, %.0f FLOP) differs from the step (%lld, %.0f)\n",
                 step_gemms.size(), flops_per_step,
                 static_cast<long long>(backend.counters().gemm_calls),
                 backend.counters().gemm_flops);
    return 1;
  }

  // Operands for the bare sgemm baseline, large enough for every call.
  size_t max_a = 0, max_b = 0, max_c = 0;
  for (const GemmCall& g : step_gemms) {
    max_a = std::max(max_a, static_cast<size_t>(g.m) * g.k);
    max_b = std::max(max_b, static_cast<size_t>(g.k) * g.n);
    max_c = std::max(max_c, static_cast<size_t>(g.m) * g.n);
  }
  std::vector<float> ga(max_a), gb(max_b), gc(max_c, 0.0f);
  for (float& x : ga) x = pixel(gen) - 0.5f;
  for (float& x : gb) x = pixel(gen) - 0.5f;
  auto run_sgemm = [&]() {
    for (const GemmCall& g : step_gemms) {
      cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans,
                  g.tb ? CblasTrans : CblasNoTrans, g.m, g.n, g.k, 1.0f, ga.data(),
                  g.ta ? g.m : g.k, gb.data(), g.tb ? g.k : g.n, g.beta, gc.data(), g.n);
    }
  };
  run_sgemm();

  double best_step = 1e30, best_block = 1e30, best_sgemm = 1e30;
  float last_loss = 0.0f;
  for (int round = 0; round < flags.rounds; ++round) {
    auto s0 = std::chrono::steady_clock::now();
    for (int i = 0; i < flags.steps; ++i) {
      auto loss = trainer.Step(t++, images, labels);
      if (!loss.ok()) return 1;
      last_loss = *loss;
    }
    if (!backend.Synchronize().ok()) return 1;
    auto s1 = std::chrono::steady_clock::now();
    best_step = std::min(best_step, Seconds(s0, s1) / flags.steps);

    if (!trainer.LoadBatch(images, labels).ok()) return 1;
    auto b0 = std::chrono::steady_clock::now();
    for (int i = 0; i < flags.steps; ++i) {
      if (!trainer.ComputeBlock(t, {0, flags.micro_batches}).ok()) return 1;
    }
    if (!backend.Synchronize().ok()) return 1;
    auto b1 = std::chrono::steady_clock::now();
    best_block = std::min(best_block, Seconds(b0, b1) / flags.steps);

    auto g0 = std::chrono::steady_clock::now();
    for (int i = 0; i < flags.steps; ++i) run_sgemm();
    auto g1 = std::chrono::steady_clock::now();
    best_sgemm = std::min(best_sgemm, Seconds(g0, g1) / flags.steps);
  }

  const double step_gflops = flops_per_step / best_step / 1e9;
  const double block_gflops = flops_per_step / best_block / 1e9;
  const double sgemm_gflops = flops_per_step / best_sgemm / 1e9;
  std::printf("compute benchmark: MLP 784-1024-1024-10 (%s), batch %d, %d micro-batches of %d\n",
              flags.activation.c_str(), flags.batch, flags.micro_batches, rows);
  std::printf("backend: %s\n", backend.name().c_str());
  std::printf("GEMM work per step: %zu calls, %.3f GFLOP (checked against the backend's count)\n",
              step_gemms.size(), flops_per_step / 1e9);
  std::printf("full worker step (fwd+bwd+HVP, tree, D, AdaHessian): %8.2f ms  %7.2f GFLOP/s"
              "  (loss %.4f)\n",
              best_step * 1e3, step_gflops, last_loss);
  std::printf("fwd+bwd+HVP of the M micro-batches, tree-reduced:    %8.2f ms  %7.2f GFLOP/s\n",
              best_block * 1e3, block_gflops);
  std::printf("OpenBLAS sgemm on the same %zu shapes:                %8.2f ms  %7.2f GFLOP/s\n",
              step_gemms.size(), best_sgemm * 1e3, sgemm_gflops);
  std::printf("ratio full step / sgemm: %.3f   (fwd+bwd+HVP / sgemm: %.3f; target >= 0.5)\n",
              step_gflops / sgemm_gflops, block_gflops / sgemm_gflops);
  std::printf("RESULT compute: step_gflops=%.2f sgemm_gflops=%.2f ratio=%.3f\n", step_gflops,
              sgemm_gflops, step_gflops / sgemm_gflops);
  return 0;
}

}  // namespace
}  // namespace compute
}  // namespace rebound

int main(int argc, char** argv) {
  return rebound::compute::Run(rebound::compute::ParseFlags(argc, argv));
}
