// kernel_oracle: the C++ engine's RNG, checksum and optimizer kernels behind a text protocol, so
// that tests/python/test_kernels.py can check the Python client (python/rebound) against the real
// C++ code bit for bit.
//
// Protocol: whitespace-separated tokens on stdin, one result line on stdout per command. Floats
// travel as bit patterns: float32 as 8 hex digits (uint32), double as 16 hex digits (uint64);
// input doubles of the config may also be given as C99 hex floats ("0x1.8p-3", strtod).
//   config <lr beta1 beta2 epsilon hessian_power weight_decay (doubles)> <hessian_every
//          block_size warmup_steps lr_decay decay_steps (ints)> <final_lr_fraction (double)>
//          <step_every (int)> <step_gamma (double)>      -> "ok"; sets the current config
//   words seed replica step tensor_id purpose start n    -> n RngWord values (hex u32)
//   rademacher seed replica step tensor_id purpose n     -> n RngRademacher bit patterns
//   uniform seed replica step tensor_id purpose n        -> n RngUniform bit patterns
//   lr t                                                  -> LearningRate bits (hex u64)
//   due t k                                               -> HessianDue(t, k) as 0/1
//   scalars t weight(double)   -> lr beta1 beta2 m_coeff v_coeff bias1 bias2 epsilon
//                                 weight_decay half_power (hex u32) power_mode (int)
//   adahessian t weight n g[n] d[n] m[n] v[n] theta[n]    -> m[n] v[n] theta[n] after
//                                                            AdaHessianUpdate(scalars of t, w)
//   elastic_pull alpha(double) n x[n] c[n]                -> x after ElasticPullWorker
//   elastic_center alpha weight n c[n] x[n]               -> c after ElasticMoveCenter
//   block_average rows cols b d[rows*cols]                -> d after BlockAverageRows
//   checksum_floats n v[n]                                -> ChecksumFloats (hex u64)
//   checksum_bundle k, then per tensor: id dtype ndim dims... nbytes hexbytes ("-" if empty)
//                                                         -> ChecksumBundle (hex u64)
// A malformed command or a non-OK status prints "error <message>" and exits with status 1.
// Single-threaded; exit status 0 at end of input.

#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "common/checksum.h"
#include "common/rng.h"
#include "compute/adahessian.h"
#include "proto/config.pb.h"
#include "proto/tensor.pb.h"

namespace rebound {
namespace {

[[noreturn]] void Fail(const std::string& message) {
  std::printf("error %s\n", message.c_str());
  std::fflush(stdout);
  std::exit(1);
}

std::string Token() {
  std::string token;
  if (!(std::cin >> token)) Fail("unexpected end of input");
  return token;
}

int64_t Int() {
  const std::string s = Token();
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 0);
  if (end == s.c_str() || *end != '\0') Fail("bad integer " + s);
  return v;
}

uint64_t UInt() {
  const std::string s = Token();
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 0);
  if (end == s.c_str() || *end != '\0') Fail("bad unsigned integer " + s);
  return v;
}

double Double() {
  const std::string s = Token();
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0') Fail("bad double " + s);
  return v;
}

float FloatBits() {
  const std::string s = Token();
  char* end = nullptr;
  const unsigned long bits = std::strtoul(s.c_str(), &end, 16);
  if (end == s.c_str() || *end != '\0') Fail("bad float bits " + s);
  const uint32_t u = static_cast<uint32_t>(bits);
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

std::vector<float> Floats(int64_t n) {
  if (n < 0) Fail("negative count");
  std::vector<float> out(static_cast<size_t>(n));
  for (float& f : out) f = FloatBits();
  return out;
}

void PrintFloat(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  std::printf("%08" PRIx32 " ", u);
}

void PrintFloats(const std::vector<float>& values) {
  for (float f : values) PrintFloat(f);
}

void PrintDouble(double d) {
  uint64_t u;
  std::memcpy(&u, &d, sizeof(u));
  std::printf("%016" PRIx64, u);
}

RngStream Stream() {
  RngStream s;
  s.seed = UInt();
  s.replica = static_cast<uint32_t>(UInt());
  s.step = UInt();
  s.tensor_id = static_cast<uint32_t>(UInt());
  s.purpose = static_cast<uint32_t>(UInt());
  return s;
}

void Check(const absl::Status& status) {
  if (!status.ok()) Fail(std::string(status.ToString()));
}

std::string HexBytes(const std::string& hex) {
  if (hex == "-") return "";
  if (hex.size() % 2 != 0) Fail("odd hex byte string");
  std::string out;
  for (size_t i = 0; i < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::strtoul(hex.substr(i, 2).c_str(), nullptr, 16)));
  }
  return out;
}

int Run() {
  AdaHessianConfig config;
  std::string command;
  while (std::cin >> command) {
    if (command == "config") {
      config.set_lr(Double());
      config.set_beta1(Double());
      config.set_beta2(Double());
      config.set_epsilon(Double());
      config.set_hessian_power(Double());
      config.set_weight_decay(Double());
      config.set_hessian_every(static_cast<int32_t>(Int()));
      config.set_block_size(static_cast<int32_t>(Int()));
      config.set_warmup_steps(Int());
      config.set_lr_decay(static_cast<LrDecay>(Int()));
      config.set_decay_steps(Int());
      config.set_final_lr_fraction(Double());
      config.set_step_every(Int());
      config.set_step_gamma(Double());
      std::printf("ok");
    } else if (command == "words") {
      const RngStream s = Stream();
      const uint64_t start = UInt();
      const int64_t n = Int();
      for (int64_t i = 0; i < n; ++i) std::printf("%08" PRIx32 " ", RngWord(s, start + i));
    } else if (command == "rademacher" || command == "uniform") {
      const RngStream s = Stream();
      const int64_t n = Int();
      for (int64_t i = 0; i < n; ++i) {
        PrintFloat(command == "uniform" ? RngUniform(s, i) : RngRademacher(s, i));
      }
    } else if (command == "lr") {
      PrintDouble(compute::LearningRate(config, Int()));
    } else if (command == "due") {
      const int64_t t = Int();
      std::printf("%d", compute::HessianDue(t, static_cast<int>(Int())) ? 1 : 0);
    } else if (command == "scalars") {
      const int64_t t = Int();
      const compute::AdaHessianScalars s = compute::MakeAdaHessianScalars(config, t, Double());
      for (float f : {s.lr, s.beta1, s.beta2, s.m_coeff, s.v_coeff, s.bias1, s.bias2, s.epsilon,
                      s.weight_decay, s.half_power}) {
        PrintFloat(f);
      }
      std::printf("%d", s.power_mode);
    } else if (command == "adahessian") {
      const int64_t t = Int();
      const double weight = Double();
      const int64_t n = Int();
      const std::vector<float> g = Floats(n), d = Floats(n);
      std::vector<float> m = Floats(n), v = Floats(n), theta = Floats(n);
      Check(compute::AdaHessianUpdate(compute::MakeAdaHessianScalars(config, t, weight), g, d,
                                      absl::MakeSpan(m), absl::MakeSpan(v),
                                      absl::MakeSpan(theta)));
      PrintFloats(m);
      PrintFloats(v);
      PrintFloats(theta);
    } else if (command == "elastic_pull") {
      const double alpha = Double();
      const int64_t n = Int();
      std::vector<float> x = Floats(n);
      const std::vector<float> c = Floats(n);
      Check(compute::ElasticPullWorker(alpha, c, absl::MakeSpan(x)));
      PrintFloats(x);
    } else if (command == "elastic_center") {
      const double alpha = Double();
      const double weight = Double();
      const int64_t n = Int();
      std::vector<float> c = Floats(n);
      const std::vector<float> x = Floats(n);
      Check(compute::ElasticMoveCenter(alpha, weight, x, absl::MakeSpan(c)));
      PrintFloats(c);
    } else if (command == "block_average") {
      const int64_t rows = Int();
      const int64_t cols = Int();
      const int64_t b = Int();
      std::vector<float> d = Floats(rows * cols);
      Check(compute::BlockAverageRows(static_cast<int>(rows), static_cast<int>(cols),
                                      static_cast<int>(b), absl::MakeSpan(d)));
      PrintFloats(d);
    } else if (command == "checksum_floats") {
      const std::vector<float> values = Floats(Int());
      std::printf("%016" PRIx64, ChecksumFloats(values));
    } else if (command == "checksum_bundle") {
      const int64_t k = Int();
      TensorBundle header;
      std::vector<std::string> bytes;
      for (int64_t i = 0; i < k; ++i) {
        Tensor* tensor = header.add_tensors();
        tensor->set_id(static_cast<uint32_t>(UInt()));
        tensor->set_dtype(static_cast<DType>(Int()));
        const int64_t ndim = Int();
        for (int64_t j = 0; j < ndim; ++j) tensor->add_shape(Int());
        const int64_t nbytes = Int();
        bytes.push_back(HexBytes(Token()));
        if (static_cast<int64_t>(bytes.back().size()) != nbytes) Fail("byte count mismatch");
      }
      std::vector<absl::string_view> data(bytes.begin(), bytes.end());
      std::printf("%016" PRIx64, ChecksumBundle(header, data));
    } else {
      Fail("unknown command " + command);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace rebound

int main() { return rebound::Run(); }
