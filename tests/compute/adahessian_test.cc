// AdaHessian (docs/design.md §4.3), the server's weighted apply (§4.6) and the elastic kernels
// (§4.4) against values computed here, in double, from the formulas.

#include "compute/adahessian.h"

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "compute/backend.h"
#include "tests/compute/test_util.h"

namespace rebound {
namespace compute {
namespace {

using testing::BitEqual;
using testing::UniformFloats;

struct RefState {
  std::vector<double> m, v, theta;
};

// One step of §4.3 / §4.6 in double.
void RefStep(const AdaHessianConfig& c, int t, double w, const std::vector<double>& g,
             const std::vector<double>& d, RefState* s) {
  for (size_t i = 0; i < g.size(); ++i) {
    s->m[i] = c.beta1() * s->m[i] + (1 - c.beta1()) * w * g[i];
    s->v[i] = c.beta2() * s->v[i] + (1 - c.beta2()) * w * d[i] * d[i];
    const double m_hat = s->m[i] / (1 - std::pow(c.beta1(), t));
    const double v_hat = s->v[i] / (1 - std::pow(c.beta2(), t));
    const double den = std::pow(std::sqrt(v_hat), c.hessian_power()) + c.epsilon();
    s->theta[i] -= c.lr() * (m_hat / den + c.weight_decay() * s->theta[i]);
  }
}

void CheckClose(const std::vector<float>& got, const std::vector<double>& want, double rel) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i);
    CHECK(got[i] == Approx(want[i]).epsilon(rel).margin(1e-7));
  }
}

TEST_CASE("AdaHessian steps match the formula of docs/design.md §4.3 computed in double",
          "[adahessian]") {
  struct Case {
    const char* name;
    double power;
    double wd;
    double lr;
  };
  const Case cases[] = {{"defaults (k = 1)", 1.0, 0.0, 0.15},
                        {"k = 0.5 with weight decay", 0.5, 1e-2, 0.05},
                        {"k = 0 (momentum SGD)", 0.0, 0.0, 0.01}};
  for (const Case& tc : cases) {
    INFO(tc.name);
    AdaHessianConfig config;
    config.set_hessian_power(tc.power);
    config.set_weight_decay(tc.wd);
    config.set_lr(tc.lr);
    const int n = 64;
    std::vector<float> theta = UniformFloats(n, -1, 1, 1);
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    RefState ref{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0),
                 std::vector<double>(theta.begin(), theta.end())};
    for (int t = 1; t <= 5; ++t) {
      const std::vector<float> g = UniformFloats(n, -0.5f, 0.5f, 10 + t);
      const std::vector<float> d = UniformFloats(n, -2.0f, 2.0f, 20 + t);
      REQUIRE(AdaHessianStep(config, t, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                             absl::MakeSpan(theta))
                  .ok());
      RefStep(config, t, 1.0, std::vector<double>(g.begin(), g.end()),
              std::vector<double>(d.begin(), d.end()), &ref);
      INFO("step " << t);
      CheckClose(m, ref.m, 1e-5);
      CheckClose(v, ref.v, 1e-5);
      CheckClose(theta, ref.theta, 1e-5);
    }
  }
}

TEST_CASE("the first AdaHessian step with defaults moves each weight by about lr", "[adahessian]") {
  // Hand-computed: with m0 = v0 = 0 the bias corrections cancel, m_hat = g, v_hat = d^2, so
  // theta1 = theta0 - 0.15 * g / (|d| + 1e-4).
  AdaHessianConfig config;
  std::vector<float> theta = {1.0f, -2.0f, 0.5f};
  std::vector<float> m(3, 0.0f), v(3, 0.0f);
  const std::vector<float> g = {0.2f, -0.4f, 0.0f};
  const std::vector<float> d = {0.5f, -1.0f, 3.0f};
  REQUIRE(AdaHessianStep(config, 1, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                         absl::MakeSpan(theta))
              .ok());
  CHECK(theta[0] == Approx(1.0 - 0.15 * 0.2 / (0.5 + 1e-4)).epsilon(1e-6));
  CHECK(theta[1] == Approx(-2.0 - 0.15 * -0.4 / (1.0 + 1e-4)).epsilon(1e-6));
  CHECK(theta[2] == 0.5f);
  CHECK(m[0] == Approx(0.1 * 0.2).epsilon(1e-6));
  CHECK(v[1] == Approx(0.001 * 1.0).epsilon(1e-6));
}

TEST_CASE("the server's weighted apply matches docs/design.md §4.6 and equals the local step at w = 1",
          "[adahessian]") {
  AdaHessianConfig config;
  config.set_lr(0.1);
  const int n = 40;
  const std::vector<float> theta0 = UniformFloats(n, -1, 1, 3);
  std::vector<float> theta = theta0, m(n, 0.0f), v(n, 0.0f);
  RefState ref{std::vector<double>(n, 0.0), std::vector<double>(n, 0.0),
               std::vector<double>(theta0.begin(), theta0.end())};
  const double weights[] = {0.7, 0.05, 1.0};
  for (int t = 1; t <= 3; ++t) {
    const std::vector<float> g = UniformFloats(n, -1, 1, 50 + t);
    const std::vector<float> d = UniformFloats(n, -1, 1, 60 + t);
    REQUIRE(ServerAdaHessianApply(config, weights[t - 1], t, g, d, absl::MakeSpan(m),
                                  absl::MakeSpan(v), absl::MakeSpan(theta))
                .ok());
    RefStep(config, t, weights[t - 1], std::vector<double>(g.begin(), g.end()),
            std::vector<double>(d.begin(), d.end()), &ref);
    CheckClose(m, ref.m, 1e-5);
    CheckClose(v, ref.v, 1e-5);
    CheckClose(theta, ref.theta, 1e-5);
  }

  // w = 1: bit-identical to the trainer's local step.
  const std::vector<float> g = UniformFloats(n, -1, 1, 70);
  const std::vector<float> d = UniformFloats(n, -1, 1, 71);
  std::vector<float> t1 = theta0, m1(n, 0.1f), v1(n, 0.2f);
  std::vector<float> t2 = theta0, m2(n, 0.1f), v2(n, 0.2f);
  REQUIRE(AdaHessianStep(config, 4, g, d, absl::MakeSpan(m1), absl::MakeSpan(v1),
                         absl::MakeSpan(t1))
              .ok());
  REQUIRE(ServerAdaHessianApply(config, 1.0, 4, g, d, absl::MakeSpan(m2), absl::MakeSpan(v2),
                                absl::MakeSpan(t2))
              .ok());
  CHECK(BitEqual(t1, t2));
  CHECK(BitEqual(m1, m2));
  CHECK(BitEqual(v1, v2));

  CHECK(ServerAdaHessianApply(config, 1.5, 1, g, d, absl::MakeSpan(m2), absl::MakeSpan(v2),
                              absl::MakeSpan(t2))
            .code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the Hessian is recomputed every hessian_every steps starting at step 1",
          "[adahessian]") {
  CHECK(HessianDue(1, 1));
  CHECK(HessianDue(7, 1));
  CHECK(HessianDue(1, 3));
  CHECK_FALSE(HessianDue(2, 3));
  CHECK_FALSE(HessianDue(3, 3));
  CHECK(HessianDue(4, 3));
  CHECK(HessianDue(7, 3));
}

TEST_CASE("block averaging replaces each block of a row by its mean", "[adahessian]") {
  // Two rows of 5 with blocks of 2: the last block of each row has one element.
  std::vector<float> d = {1, 3, 5, 9, 7, -2, 2, 10, 20, 4};
  REQUIRE(BlockAverageRows(2, 5, 2, absl::MakeSpan(d)).ok());
  const std::vector<float> want = {2, 2, 7, 7, 7, 0, 0, 15, 15, 4};
  CHECK(d == want);
  std::vector<float> same = {1, 2, 3};
  REQUIRE(BlockAverageRows(1, 3, 0, absl::MakeSpan(same)).ok());
  CHECK(same == std::vector<float>{1, 2, 3});
  CHECK(BlockAverageRows(2, 2, 2, absl::MakeSpan(same)).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the elastic kernel moves the center toward the worker by alpha times its weight",
          "[elastic]") {
  const std::vector<float> x = {1.0f, -3.0f, 0.25f, 8.0f};
  const std::vector<float> c0 = {0.0f, 1.0f, 0.25f, -8.0f};
  const double alpha = 0.45;
  const double w = 0.6;
  std::vector<float> c = c0;
  REQUIRE(ElasticMoveCenter(alpha, w, x, absl::MakeSpan(c)).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    CHECK(c[i] == Approx(c0[i] + alpha * w * (x[i] - c0[i])).epsilon(1e-6));
  }
  CHECK(c[2] == 0.25f);  // x == c: no move

  // Worker side: x <- x - alpha (x - c_before), written here with the worker's own expression.
  std::vector<float> xw = x;
  REQUIRE(ElasticPullWorker(alpha, c0, absl::MakeSpan(xw)).ok());
  const float a = static_cast<float>(alpha);
  for (size_t i = 0; i < x.size(); ++i) {
    const float expected = x[i] - a * (x[i] - c0[i]);
    CHECK(std::memcmp(&xw[i], &expected, sizeof(float)) == 0);
  }

  // The server computes the worker's post-sync state with the same kernel: identical bits.
  std::vector<float> server_copy = x;
  REQUIRE(ElasticMove(static_cast<float>(alpha), c0, absl::MakeSpan(server_copy)).ok());
  CHECK(BitEqual(server_copy, xw));

  std::vector<float> short_y(3);
  CHECK(ElasticMove(0.5f, x, absl::MakeSpan(short_y)).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("elastic pulls on random data are bit-identical to the written-out formula",
          "[elastic]") {
  const std::vector<float> x = UniformFloats(1000, -10, 10, 5);
  const std::vector<float> c = UniformFloats(1000, -10, 10, 6);
  std::vector<float> y = x;
  REQUIRE(ElasticPullWorker(0.3, c, absl::MakeSpan(y)).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    const float expected = x[i] - 0.3f * (x[i] - c[i]);
    REQUIRE(std::memcmp(&y[i], &expected, sizeof(float)) == 0);
  }
}

TEST_CASE("the default schedule is the constant lr at every step", "[schedule]") {
  AdaHessianConfig config;
  config.set_lr(0.01);
  for (int64_t t : {0, 1, 2, 1000, 1000000000}) CHECK(LearningRate(config, t) == 0.01);
}

TEST_CASE("warm-up then cosine decay: hand-computed values", "[schedule]") {
  // lr 0.1, W = 10, cosine to f = 0.2 at t = 110 (span 100).
  AdaHessianConfig config;
  config.set_lr(0.1);
  config.set_warmup_steps(10);
  config.set_lr_decay(LR_COSINE);
  config.set_decay_steps(110);
  config.set_final_lr_fraction(0.2);
  REQUIRE(ValidateAdaHessianConfig(config).ok());
  CHECK(LearningRate(config, 0) == 0.0);
  CHECK(LearningRate(config, 1) == Approx(0.01).epsilon(1e-15));    // 0.1 * 1 / 10
  CHECK(LearningRate(config, 5) == Approx(0.05).epsilon(1e-15));
  CHECK(LearningRate(config, 10) == Approx(0.1).epsilon(1e-15));    // warm-up end: lr
  // p = 0.5: cos = 0, 0.1 * (0.2 + 0.8 * 0.5) = 0.06.
  CHECK(LearningRate(config, 60) == Approx(0.06).epsilon(1e-12));
  // p = 0.25: 0.1 * (0.2 + 0.8 * (1 + sqrt(2)/2) / 2) = 0.0882842712...
  CHECK(LearningRate(config, 35) == Approx(0.08828427124746191).epsilon(1e-12));
  CHECK(LearningRate(config, 110) == Approx(0.02).epsilon(1e-12));  // end: f * lr
  CHECK(LearningRate(config, 111) == Approx(0.02).epsilon(1e-12));  // past the end: stays
  CHECK(LearningRate(config, 100000) == Approx(0.02).epsilon(1e-12));
}

TEST_CASE("linear and step decays: hand-computed values", "[schedule]") {
  AdaHessianConfig linear;
  linear.set_lr(0.2);
  linear.set_lr_decay(LR_LINEAR);
  linear.set_decay_steps(100);  // no warm-up: p = t / 100
  REQUIRE(ValidateAdaHessianConfig(linear).ok());
  CHECK(LearningRate(linear, 1) == Approx(0.198).epsilon(1e-12));
  CHECK(LearningRate(linear, 50) == Approx(0.1).epsilon(1e-12));
  CHECK(LearningRate(linear, 100) == 0.0);
  CHECK(LearningRate(linear, 150) == 0.0);

  AdaHessianConfig step;
  step.set_lr(1.0);
  step.set_warmup_steps(4);
  step.set_lr_decay(LR_STEP);
  step.set_step_every(10);
  step.set_step_gamma(0.5);
  step.set_final_lr_fraction(0.2);
  REQUIRE(ValidateAdaHessianConfig(step).ok());
  CHECK(LearningRate(step, 2) == 0.5);    // warm-up
  CHECK(LearningRate(step, 4) == 1.0);    // warm-up end
  CHECK(LearningRate(step, 13) == 1.0);   // u = 9
  CHECK(LearningRate(step, 14) == 0.5);   // u = 10: first drop
  CHECK(LearningRate(step, 24) == 0.25);  // u = 20
  CHECK(LearningRate(step, 34) == 0.2);   // 0.125 is below the floor f = 0.2
  CHECK(LearningRate(step, 10000) == 0.2);
}

TEST_CASE("an AdaHessian step applies the schedule's lr of its own step", "[schedule]") {
  // W = 4: step 2 uses lr 0.1 * 2 / 4 = 0.05. Hand-computed with m = v = 0 before the step:
  // m = 0.1 g, v = 0.001 d^2, m_hat = m / (1 - 0.9^2) = 0.1 g / 0.19,
  // v_hat = v / (1 - 0.999^2) = 0.001 d^2 / 0.001999, theta -= 0.05 m_hat / (sqrt(v_hat) + eps).
  AdaHessianConfig config;
  config.set_lr(0.1);
  config.set_warmup_steps(4);
  config.set_lr_decay(LR_COSINE);
  config.set_decay_steps(8);
  std::vector<float> theta = {1.0f, -2.0f};
  std::vector<float> m(2, 0.0f), v(2, 0.0f);
  const std::vector<float> g = {0.2f, -0.4f};
  const std::vector<float> d = {0.5f, -1.0f};
  REQUIRE(AdaHessianStep(config, 2, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                         absl::MakeSpan(theta))
              .ok());
  for (int i = 0; i < 2; ++i) {
    const double m_hat = 0.1 * g[i] / 0.19;
    const double v_hat = 0.001 * d[i] * d[i] / 0.001999;
    const double want = (i == 0 ? 1.0 : -2.0) - 0.05 * m_hat / (std::sqrt(v_hat) + 1e-4);
    CHECK(theta[i] == Approx(want).epsilon(1e-6));
  }
  // The scalars carry float(LearningRate(config, t)), rounded once.
  CHECK(MakeAdaHessianScalars(config, 2).lr == static_cast<float>(0.05));
  CHECK(MakeAdaHessianScalars(config, 6).lr == static_cast<float>(LearningRate(config, 6)));
  CHECK(MakeAdaHessianScalars(config, 6).lr == static_cast<float>(0.05));  // p = 0.5: lr / 2
  // The server's apply at its own step t uses the same lr: bit-identical at w = 1.
  std::vector<float> t1 = {1.0f, -2.0f}, m1(2, 0.0f), v1(2, 0.0f);
  std::vector<float> t2 = t1, m2 = m1, v2 = v1;
  REQUIRE(AdaHessianStep(config, 7, g, d, absl::MakeSpan(m1), absl::MakeSpan(v1),
                         absl::MakeSpan(t1))
              .ok());
  REQUIRE(ServerAdaHessianApply(config, 1.0, 7, g, d, absl::MakeSpan(m2), absl::MakeSpan(v2),
                                absl::MakeSpan(t2))
              .ok());
  CHECK(BitEqual(t1, t2));
}

TEST_CASE("bad schedules are rejected naming the field", "[schedule]") {
  AdaHessianConfig config;
  config.set_warmup_steps(-1);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("warmup_steps"));
  config.set_warmup_steps(100);
  config.set_lr_decay(LR_COSINE);
  config.set_decay_steps(100);  // must be > warmup_steps
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("decay_steps"));
  config.set_decay_steps(101);
  CHECK(ValidateAdaHessianConfig(config).ok());
  config.set_final_lr_fraction(1.5);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("final_lr_fraction"));
  config.set_final_lr_fraction(0.0);
  config.set_lr_decay(LR_STEP);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("step_every"));
  config.set_step_every(10);
  config.set_step_gamma(0.0);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("step_gamma"));
  config.set_step_gamma(0.5);
  CHECK(ValidateAdaHessianConfig(config).ok());
  config.set_lr_decay(LR_DECAY_UNSPECIFIED);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("lr_decay"));
}

TEST_CASE("out-of-range AdaHessian configs are rejected naming the field", "[adahessian]") {
  AdaHessianConfig config;
  CHECK(ValidateAdaHessianConfig(config).ok());
  config.set_hessian_power(1.5);
  absl::Status s = ValidateAdaHessianConfig(config);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()), Catch::Contains("hessian_power"));
  config.set_hessian_power(1.0);
  config.set_beta2(1.0);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()), Catch::Contains("beta2"));
  config.set_beta2(0.999);
  config.set_hessian_every(0);
  CHECK_THAT(std::string(ValidateAdaHessianConfig(config).message()),
             Catch::Contains("hessian_every"));
}

TEST_CASE("the CPU backend's optimizer kernels are the host functions", "[adahessian]") {
  auto backend = testing::CpuBackend();
  AdaHessianConfig config;
  config.set_hessian_power(0.7);
  const int n = 101;
  const std::vector<float> g = UniformFloats(n, -1, 1, 80);
  const std::vector<float> d = UniformFloats(n, -1, 1, 81);
  std::vector<float> theta = UniformFloats(n, -1, 1, 82), m(n, 0.01f), v(n, 0.02f);
  std::vector<float> theta2 = theta, m2 = m, v2 = v;
  REQUIRE(AdaHessianStep(config, 3, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                         absl::MakeSpan(theta))
              .ok());
  // The CPU backend addresses host memory: wrap the vectors directly.
  REQUIRE(backend
              ->AdaHessianUpdate(MakeAdaHessianScalars(config, 3), ConstDSpan(g.data(), n),
                                 ConstDSpan(d.data(), n), DSpan{m2.data(), n},
                                 DSpan{v2.data(), n}, DSpan{theta2.data(), n})
              .ok());
  CHECK(BitEqual(theta, theta2));
  CHECK(BitEqual(m, m2));
  CHECK(BitEqual(v, v2));
}

}  // namespace
}  // namespace compute
}  // namespace rebound
