// Server-apply benchmark (docs/design.md §9: "server elastic / AdaHessian apply >= 0.5x a
// memory-bandwidth copy of the same bytes").
//
// Measures, in one run, on one thread, over the center of one stage of MLP 784-2048-1256-10
// (4,193,794 float32 = 16,775,176 bytes = S; the shard of //bench:transport):
//   * elastic kernel: compute::ElasticMoveCenter(alpha, w, x, c), c <- c + alpha w (x - c);
//   * ElasticSync: server::CenterTable::ElasticSync with a weight function returning 1 and a
//     commit that does nothing, i.e. everything the table does per Sync besides the durable
//     write (||x - c||, then one pass in cache-sized blocks writing c_before, the worker's
//     post-sync state x - alpha (x - c_before) and the moved center);
//   * AdaHessian kernel: compute::ServerAdaHessianApply(config, w, t, g, D, m, v, theta);
//   * ApplyAdaHessian: server::CenterTable::ApplyAdaHessian with a no-op commit (||g||, then
//     one blocked pass computing the next c, m, v beside the current ones, swapped in after
//     the commit);
//   * memcpy of the same number of bytes each kernel touches.
//
// Bytes are counted as what the update must read and write, each array once:
//   elastic kernel:   read x, c; write c                                    = 3 S
//   ElasticSync:      read x, c; write c, c_before (the reply) and the worker's
//                     post-sync state (the snapshot): the outputs §4.4 requires = 5 S
//   AdaHessian:       read g, D, m, v, theta; write m, v, theta              = 8 S
//   memcpy of B bytes: read B, write B = 2 B, with B = 2.5 S (the ElasticSync's 5 S) and
//                     B = 4 S (the AdaHessian's 8 S)
// Work beyond that (the ||x - c|| and ||g|| passes of the weighting, cache misses, copies) is
// what the ratio measures. GB = 1e9 bytes. Every measurement runs --calls calls
// per round, the six measurements interleaved, over --rounds rounds; each figure is the median
// of the per-round rates. RESULT uses the CenterTable calls (what the server does per update)
// and the faster of the two memcpy figures:
//   RESULT apply: elastic_gb_s=<x> adahessian_gb_s=<y> memcpy_gb_s=<z> ratio=<min(x,y)/z>
//
// Flags: --calls=N (per round, 5), --rounds=R (7).

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "bench/figures.h"
#include "bench/flags.h"
#include "common/config.h"
#include "compute/adahessian.h"
#include "proto/config.pb.h"
#include "server/center_table.h"

namespace rebound {
namespace bench {
namespace {

struct Flags {
  int calls = 5;
  int rounds = 7;
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    if (ParseIntFlag(argv[i], "--calls", &flags.calls) ||
        ParseIntFlag(argv[i], "--rounds", &flags.rounds)) {
      continue;
    }
    ExitUnknownFlag(argv[i]);
  }
  if (flags.calls < 1 || flags.rounds < 1) ExitBadFlags("--calls and --rounds must be >= 1");
  return flags;
}

// The job of //bench:transport; 4 replicas, so alpha = 0.9 / 4.
constexpr char kJob[] = R"pb(
  job_id: "bench-apply"
  model {
    input_dim: 784
    layers { width: 2048 activation: RELU }
    layers { width: 1256 activation: RELU }
    layers { width: 10 activation: IDENTITY }
    init_seed: 1
  }
  topology { replicas: 4 stages: 1 }
  easgd { mode: EASGD sync_period: 8 }
)pb";
constexpr char kModelName[] = "784-2048-1256-10";

struct Measurement {
  std::string name;
  double bytes_per_call;               // counted bytes (see the header)
  std::function<bool(int call)> call;  // false on error
  std::vector<double> gb_s;            // per round
  double Median() const { return bench::Median(gb_s); }
};

// Deterministic values in [lo, hi).
std::vector<float> Filled(size_t n, uint32_t seed, float lo, float hi) {
  std::vector<float> out(n);
  uint32_t state = seed * 2654435761u + 1;
  for (float& x : out) {
    state = state * 1664525u + 1013904223u;
    x = lo + (hi - lo) * static_cast<float>(state >> 8) / 16777216.0f;
  }
  return out;
}

int Run(const Flags& flags) {
  auto job_or = ParseJobConfig(kJob, "bench-apply.pbtxt");
  if (!job_or.ok()) {
    std::fprintf(stderr, "job: %s\n", job_or.status().ToString().c_str());
    return 1;
  }
  const JobConfig job = *std::move(job_or);
  auto table_or = server::CenterTable::Create(job);
  if (!table_or.ok()) {
    std::fprintf(stderr, "centers: %s\n", table_or.status().ToString().c_str());
    return 1;
  }
  server::CenterTable& table = **table_or;
  const std::vector<float> c0 = table.Read(0)->first;
  const size_t n = c0.size();
  const double S = static_cast<double>(n * sizeof(float));
  const double alpha = EffectiveMovingRate(job);
  const double weight = 1.0;
  const AdaHessianConfig& ada = job.adahessian();

  // Two worker parameter vectors around the center, alternated so the center keeps moving.
  std::vector<float> x_plus(c0), x_minus(c0);
  for (float& v : x_plus) v += 1e-3f;
  for (float& v : x_minus) v -= 1e-3f;
  const std::vector<float>* xs[2] = {&x_plus, &x_minus};

  // Kernel operands of their own (pre-faulted), so the kernels and the table do not share state.
  std::vector<float> kernel_center(c0);
  std::vector<float> theta(c0);
  std::vector<float> m(n, 0.0f), v(n, 0.0f);
  const std::vector<float> g = Filled(n, 1, -1e-2f, 1e-2f);
  const std::vector<float> d = Filled(n, 2, -1e-3f, 1e-3f);
  int64_t kernel_t = 0;

  // memcpy buffers: 2.5 S and 4 S bytes.
  const size_t copy_elastic = static_cast<size_t>(2.5 * S);
  const size_t copy_ada = static_cast<size_t>(4 * S);
  std::vector<char> src(copy_ada, 1), dst(copy_ada, 2);

  auto one = [weight](int64_t, double) -> absl::StatusOr<double> { return weight; };
  int64_t syncs = 0, pushes = 0;
  const server::CenterTable::CommitFn no_commit =
      [](int64_t, absl::Span<const float>, absl::Span<const float>, absl::Span<const float>) {
        return absl::OkStatus();
      };
  const server::CenterTable::OptCommitFn no_opt_commit =
      [](int64_t, absl::Span<const float>, int64_t, absl::Span<const float>,
         absl::Span<const float>) { return absl::OkStatus(); };
  // The caller's snapshot buffer (rebound_server allocates it per sync from a heap tuned by
  // TuneAllocatorForLargeBuffers; here once).
  std::vector<float> worker_after(n);

  std::vector<Measurement> ms;
  ms.push_back({"elastic kernel (ElasticMoveCenter)", 3 * S, [&](int i) {
                  return compute::ElasticMoveCenter(alpha, weight, *xs[i % 2],
                                                    absl::MakeSpan(kernel_center))
                      .ok();
                }});
  ms.push_back({"CenterTable::ElasticSync, no-op commit", 5 * S, [&](int i) {
                  auto r = table.ElasticSync(0, *xs[i % 2], alpha, one, no_commit,
                                             absl::MakeSpan(worker_after));
                  if (!r.ok()) return false;
                  ++syncs;
                  return true;
                }});
  ms.push_back({"AdaHessian kernel (ServerAdaHessianApply)", 8 * S, [&](int) {
                  return compute::ServerAdaHessianApply(ada, weight, ++kernel_t, g, d,
                                                        absl::MakeSpan(m), absl::MakeSpan(v),
                                                        absl::MakeSpan(theta))
                      .ok();
                }});
  ms.push_back({"CenterTable::ApplyAdaHessian, no-op commit", 8 * S, [&](int) {
                  auto r = table.ApplyAdaHessian(0, g, d, ada, one, no_opt_commit);
                  if (!r.ok()) return false;
                  ++pushes;
                  return true;
                }});
  ms.push_back({"memcpy of 2.5 S (= the ElasticSync's 5 S)", 2.0 * copy_elastic, [&](int) {
                  std::memcpy(dst.data(), src.data(), copy_elastic);
                  return true;
                }});
  ms.push_back({"memcpy of 4 S (= the AdaHessian's 8 S)", 2.0 * copy_ada, [&](int) {
                  std::memcpy(dst.data(), src.data(), copy_ada);
                  return true;
                }});

  // Warm-up: one call of each (the table allocates m and v at its first push).
  for (Measurement& meas : ms) {
    if (!meas.call(0)) {
      std::fprintf(stderr, "%s failed\n", meas.name.c_str());
      return 1;
    }
  }
  for (int round = 0; round < flags.rounds; ++round) {
    for (Measurement& meas : ms) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < flags.calls; ++i) {
        if (!meas.call(i)) {
          std::fprintf(stderr, "%s failed\n", meas.name.c_str());
          return 1;
        }
      }
      const auto t1 = std::chrono::steady_clock::now();
      const double seconds = std::chrono::duration<double>(t1 - t0).count();
      meas.gb_s.push_back(meas.bytes_per_call * flags.calls / seconds / 1e9);
    }
  }
  // The results stayed finite and the table counted every update.
  double checksum = 0;
  for (size_t i = 0; i < n; i += 4099) checksum += kernel_center[i] + theta[i];
  const auto [center, version] = *table.Read(0);
  for (size_t i = 0; i < n; i += 4099) checksum += center[i];
  if (!std::isfinite(checksum) || version != syncs + pushes) {
    std::fprintf(stderr, "inconsistent results (checksum %g, version %lld, %lld updates)\n",
                 checksum, static_cast<long long>(version),
                 static_cast<long long>(syncs + pushes));
    return 1;
  }

  const double elastic_kernel = ms[0].Median();
  const double elastic_table = ms[1].Median();
  const double ada_kernel = ms[2].Median();
  const double ada_table = ms[3].Median();
  const double copy_e = ms[4].Median();
  const double copy_a = ms[5].Median();
  const double copy = std::max(copy_e, copy_a);

  std::printf("apply benchmark: the center of one stage of MLP %s, %zu float32 = S = %.0f bytes"
              " (%.3f MiB), 1 thread\n",
              kModelName, n, S, S / 1048576.0);
  std::printf("alpha %.3f, w %.1f; AdaHessian lr %g, beta1 %g, beta2 %g, eps %g, power %g\n",
              alpha, weight, ada.lr(), ada.beta1(), ada.beta2(), ada.epsilon(),
              ada.hessian_power());
  std::printf("counted bytes: elastic kernel 3 S (read x, c; write c), ElasticSync 5 S (also"
              " write c_before, worker_after), AdaHessian 8 S (read g, D, m, v, theta; write m, v,"
              " theta), memcpy 2 B; GB = 1e9 bytes\n");
  std::printf("%d rounds of %d calls each, interleaved; median (min..max) over rounds\n",
              flags.rounds, flags.calls);
  for (const Measurement& meas : ms) {
    const auto [lo, hi] = std::minmax_element(meas.gb_s.begin(), meas.gb_s.end());
    std::printf("  %-44s %7.2f ms/call  %6.2f GB/s  (%.2f..%.2f)\n", meas.name.c_str(),
                meas.bytes_per_call / (meas.Median() * 1e9) * 1e3, meas.Median(), *lo, *hi);
  }
  std::printf("  (beyond the counted bytes, ElasticSync reads x and c once more for ||x - c||,"
              " ApplyAdaHessian g for ||g||)\n");
  std::printf("kernels alone vs memcpy: elastic %.3f, AdaHessian %.3f\n",
              elastic_kernel / copy_e, ada_kernel / copy_a);
  std::printf("CenterTable calls vs memcpy of the same bytes: ElasticSync %.3f, ApplyAdaHessian"
              " %.3f\n",
              elastic_table / copy_e, ada_table / copy_a);
  const double ratio = std::min(elastic_table, ada_table) / copy;
  std::printf("ratio min(ElasticSync, ApplyAdaHessian) / max(memcpy): %.3f   (target >= 0.5)\n",
              ratio);
  std::printf("RESULT apply: elastic_gb_s=%.2f adahessian_gb_s=%.2f memcpy_gb_s=%.2f ratio=%.3f\n",
              elastic_table, ada_table, copy, ratio);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace rebound

int main(int argc, char** argv) {
  return rebound::bench::Run(rebound::bench::ParseFlags(argc, argv));
}
