#include "server/center_table.h"

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

#include "common/config.h"
#include "compute/adahessian.h"

namespace rebound::server {
namespace {

// 4 inputs, 3 hidden, 2 outputs: 4*3 + 3 + 3*2 + 2 = 23 parameters, so the blocked loops also
// run their short-tail path; the big model below runs several full blocks.
constexpr char kJob[] = R"pb(
  model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }
  topology { replicas: 2 stages: 1 }
  easgd { sync_period: 4 }
)pb";

constexpr char kBigJob[] = R"pb(
  model { input_dim: 300 layers { width: 200 } layers { width: 10 activation: IDENTITY } }
  topology { replicas: 4 stages: 1 }
)pb";

std::unique_ptr<CenterTable> MakeTable(const char* text) {
  auto job = ParseJobConfig(text, "job.pbtxt");
  REQUIRE(job.ok());
  auto table = CenterTable::Create(*job);
  REQUIRE(table.ok());
  return *std::move(table);
}

std::vector<float> Center(const CenterTable& table) {
  auto read = table.Read(0);
  REQUIRE(read.ok());
  return read->first;
}

auto Weight(double w) {
  return [w](int64_t, double) -> absl::StatusOr<double> { return w; };
}

bool SameBits(const std::vector<float>& a, absl::Span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_CASE("ElasticSync moves the center by alpha w (x - c) and pulls the worker toward c") {
  const char* text = GENERATE(kJob, kBigJob);
  std::unique_ptr<CenterTable> table = MakeTable(text);
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = c0[i] + 0.5f + 0.001f * static_cast<float>(i % 97);
  const double alpha = 0.45, w = 0.5;
  std::vector<float> after(n);
  std::vector<float> seen_before, seen_center, seen_after;
  int64_t seen_version = 0;
  double seen_norm = -1;
  auto weight = [&](int64_t version, double norm) -> absl::StatusOr<double> {
    CHECK(version == 0);
    seen_norm = norm;
    return w;
  };
  auto commit = [&](int64_t version, absl::Span<const float> center,
                    absl::Span<const float> worker_after, absl::Span<const float> before) {
    seen_version = version;
    seen_center.assign(center.begin(), center.end());
    seen_after.assign(worker_after.begin(), worker_after.end());
    seen_before.assign(before.begin(), before.end());
    return absl::OkStatus();
  };
  auto version = table->ElasticSync(0, x, alpha, weight, commit, absl::MakeSpan(after));
  REQUIRE(version.ok());
  CHECK(version->version == 1);
  CHECK(seen_version == 1);
  // ||x - c||, computed here in double the plain way.
  double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += (double(x[i]) - c0[i]) * (double(x[i]) - c0[i]);
  CHECK(seen_norm == Approx(std::sqrt(sum)).epsilon(1e-5));
  // Hand-computed values for a few elements, and the shared kernels for all of them.
  for (size_t i : {size_t{0}, n / 2, n - 1}) {
    CHECK(seen_center[i] == Approx(c0[i] + alpha * w * (x[i] - c0[i])).epsilon(1e-6));
    CHECK(after[i] == Approx(x[i] - alpha * (x[i] - c0[i])).epsilon(1e-6));
  }
  std::vector<float> kernel_center = c0, kernel_after = x;
  REQUIRE(compute::ElasticMoveCenter(alpha, w, x, absl::MakeSpan(kernel_center)).ok());
  REQUIRE(compute::ElasticPullWorker(alpha, c0, absl::MakeSpan(kernel_after)).ok());
  CHECK(SameBits(kernel_center, Center(*table)));
  CHECK(SameBits(kernel_center, seen_center));
  CHECK(SameBits(kernel_after, after));
  CHECK(SameBits(kernel_after, seen_after));
  CHECK(SameBits(c0, seen_before));
  CHECK(table->version(0) == 1);
}

TEST_CASE("a failed elastic commit leaves the center and its version as they were") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  const std::vector<float> c0 = Center(*table);
  std::vector<float> x(c0.size(), 1.0f), after(c0.size());
  auto failing = [](int64_t, absl::Span<const float>, absl::Span<const float>,
                    absl::Span<const float>) { return absl::UnavailableError("disk on fire"); };
  auto result = table->ElasticSync(0, x, 0.5, Weight(1.0), failing, absl::MakeSpan(after));
  CHECK(result.status().code() == absl::StatusCode::kUnavailable);
  CHECK(SameBits(c0, Center(*table)));
  CHECK(table->version(0) == 0);
  // A refusing weight changes nothing either, and the table goes on.
  auto duplicate = [](int64_t, double) -> absl::StatusOr<double> {
    return absl::AlreadyExistsError("seen");
  };
  auto ok = [](int64_t, absl::Span<const float>, absl::Span<const float>,
               absl::Span<const float>) { return absl::OkStatus(); };
  CHECK(table->ElasticSync(0, x, 0.5, duplicate, ok, absl::MakeSpan(after)).status().code() ==
        absl::StatusCode::kAlreadyExists);
  CHECK(SameBits(c0, Center(*table)));
  auto version = table->ElasticSync(0, x, 0.5, Weight(1.0), ok, absl::MakeSpan(after));
  REQUIRE(version.ok());
  CHECK(version->version == 1);
  CHECK_FALSE(version->declined);
  CHECK_FALSE(SameBits(c0, Center(*table)));
}

// A staged sync whose three steps record their order in `events` ("prepare 1", "write 1", ...)
// and may be held at prepare or made to fail at write.
struct StagedProbe {
  absl::Mutex mu;
  std::vector<std::string> events ABSL_GUARDED_BY(mu);
  void Add(std::string event) {
    absl::MutexLock lock(&mu);
    events.push_back(std::move(event));
  }
  std::vector<std::string> Events() {
    absl::MutexLock lock(&mu);
    return events;
  }
  // Waits (at most a minute: the test fails rather than hangs) until `event` was recorded.
  void AwaitEvent(const std::string& event) {
    absl::MutexLock lock(&mu);
    auto seen = [this, &event]() ABSL_SHARED_LOCKS_REQUIRED(mu) {
      return std::find(events.begin(), events.end(), event) != events.end();
    };
    REQUIRE(mu.AwaitWithTimeout(absl::Condition(&seen), absl::Minutes(1)));
  }
  CenterTable::DecideFn Decide(absl::Notification* hold = nullptr, bool fail_write = false,
                               std::vector<float>* committed_center = nullptr) {
    return [=](int64_t version, absl::Span<const float> center, absl::Span<const float>,
               absl::Span<const float>) -> absl::StatusOr<CenterTable::StagedWrite> {
      Add(absl::StrCat("decide ", version));
      CenterTable::StagedWrite staged;
      staged.prepare = [=]() {
        if (hold != nullptr) hold->WaitForNotification();
        // The center given to decide is still intact here, outside the lock.
        if (committed_center != nullptr) committed_center->assign(center.begin(), center.end());
        Add(absl::StrCat("prepare ", version));
        return absl::OkStatus();
      };
      staged.write = [=]() {
        Add(absl::StrCat("write ", version));
        return fail_write ? absl::UnavailableError("disk on fire") : absl::OkStatus();
      };
      staged.await = [=]() {
        Add(absl::StrCat("await ", version));
        return absl::OkStatus();
      };
      return staged;
    };
  }
};

TEST_CASE("a staged sync gives ElasticSync's bits; prepare, write and await run in that order") {
  std::unique_ptr<CenterTable> plain = MakeTable(kBigJob), staged = MakeTable(kBigJob);
  const std::vector<float> c0 = Center(*plain);
  const size_t n = c0.size();
  auto ok = [](int64_t, absl::Span<const float>, absl::Span<const float>,
               absl::Span<const float>) { return absl::OkStatus(); };
  StagedProbe probe;
  std::vector<float> committed;
  for (int i = 0; i < 3; ++i) {
    std::vector<float> x(n);
    for (size_t j = 0; j < n; ++j) x[j] = c0[j] + 0.25f * (i + 1) + 0.001f * (j % 31);
    std::vector<float> after_plain(n), after_staged(n);
    REQUIRE(plain->ElasticSync(0, x, 0.45, Weight(0.5), ok, absl::MakeSpan(after_plain)).ok());
    auto version = staged->ElasticSyncStaged(0, x, 0.45, Weight(0.5),
                                             probe.Decide(nullptr, false, &committed),
                                             absl::MakeSpan(after_staged));
    REQUIRE(version.ok());
    CHECK(version->version == i + 1);
    CHECK(SameBits(after_plain, after_staged));
    CHECK(SameBits(Center(*plain), Center(*staged)));
    CHECK(SameBits(committed, Center(*staged)));
    CHECK(staged->version(0) == i + 1);
  }
  CHECK(probe.Events() == std::vector<std::string>{"decide 1", "prepare 1", "write 1", "await 1",
                                                   "decide 2", "prepare 2", "write 2", "await 2",
                                                   "decide 3", "prepare 3", "write 3",
                                                   "await 3"});
}

TEST_CASE("a staged sync is decided while another's bytes are written; writes keep version order") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> x1(n, 1.0f), x2(n, -1.0f), after1(n), after2(n);
  StagedProbe probe;
  absl::Notification release_first, second_prepared;
  std::vector<float> center1, center2;
  absl::StatusOr<CenterTable::Update> first = absl::UnknownError("not run"), second = first;
  std::thread one([&] {
    first = table->ElasticSyncStaged(0, x1, 0.5, Weight(1.0),
                                     probe.Decide(&release_first, false, &center1),
                                     absl::MakeSpan(after1));
  });
  // The second is decided (the first holds no lock in its prepare) and prepared, but its
  // write waits for the first's.
  probe.AwaitEvent("decide 1");
  std::thread two([&] {
    second = table->ElasticSyncStaged(0, x2, 0.5, Weight(1.0),
                                      probe.Decide(nullptr, false, &center2),
                                      absl::MakeSpan(after2));
  });
  probe.AwaitEvent("prepare 2");
  // Nothing is durable yet: readers see version 0 and c0.
  CHECK(table->version(0) == 0);
  CHECK(SameBits(c0, Center(*table)));
  CHECK(probe.Events() == std::vector<std::string>{"decide 1", "decide 2", "prepare 2"});
  release_first.Notify();
  one.join();
  two.join();
  REQUIRE(first.ok());
  REQUIRE(second.ok());
  CHECK(first->version == 1);
  CHECK(second->version == 2);
  const std::vector<std::string> events = probe.Events();
  const auto at = [&](const std::string& e) {
    return std::find(events.begin(), events.end(), e) - events.begin();
  };
  CHECK(at("write 1") < at("write 2"));
  CHECK(at("prepare 1") < at("write 1"));
  // The second moved from the first's center, and each wrote the center it decided.
  std::vector<float> expect1 = c0, expect2;
  REQUIRE(compute::ElasticMoveCenter(0.5, 1.0, x1, absl::MakeSpan(expect1)).ok());
  expect2 = expect1;
  REQUIRE(compute::ElasticMoveCenter(0.5, 1.0, x2, absl::MakeSpan(expect2)).ok());
  CHECK(SameBits(expect1, center1));
  CHECK(SameBits(expect2, center2));
  CHECK(SameBits(expect2, Center(*table)));
  CHECK(table->version(0) == 2);
}

TEST_CASE("a failed staged write loses the stage; a sync decided after it is never written") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> x(n, 1.0f), after1(n), after2(n);
  StagedProbe probe;
  absl::Notification release_first;
  absl::StatusOr<CenterTable::Update> first = absl::UnknownError("not run"), second = first;
  std::thread one([&] {
    first = table->ElasticSyncStaged(0, x, 0.5, Weight(1.0), probe.Decide(&release_first, true),
                                     absl::MakeSpan(after1));
  });
  probe.AwaitEvent("decide 1");
  std::thread two([&] {
    second = table->ElasticSyncStaged(0, x, 0.5, Weight(1.0), probe.Decide(),
                                      absl::MakeSpan(after2));
  });
  probe.AwaitEvent("prepare 2");
  release_first.Notify();
  one.join();
  two.join();
  CHECK(first.status().message() == "disk on fire");
  CHECK(second.status().code() == absl::StatusCode::kUnavailable);
  CHECK(absl::StrContains(second.status().message(), "could not commit version 1"));
  const std::vector<std::string> events = probe.Events();
  CHECK(std::count(events.begin(), events.end(), "write 2") == 0);
  CHECK(std::count(events.begin(), events.end(), "await 1") == 0);
  // Readers see neither update; the stage refuses work until Restore, which does not wait for
  // the two failed syncs.
  CHECK(table->version(0) == 0);
  CHECK(table->Read(0).status().code() == absl::StatusCode::kUnavailable);
  CHECK(table->Health().code() == absl::StatusCode::kUnavailable);
  CHECK(table->ElasticSyncStaged(0, x, 0.5, Weight(1.0), probe.Decide(), absl::MakeSpan(after1))
            .status()
            .code() == absl::StatusCode::kUnavailable);
  table->AwaitWrites(0);  // returns: the stage is lost
  CenterRecord record;
  record.set_stage(0);
  record.set_version(0);
  *record.mutable_params() = table->Bundle(0, c0);
  REQUIRE(table->Restore(record, nullptr).ok());
  CHECK(table->Health().ok());
  CHECK(SameBits(c0, Center(*table)));
  auto again = table->ElasticSyncStaged(0, x, 0.5, Weight(1.0), probe.Decide(),
                                        absl::MakeSpan(after1));
  REQUIRE(again.ok());
  CHECK(again->version == 1);
}

TEST_CASE("a declined update changes nothing, commits nothing, and says so with the version") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  const size_t n = Center(*table).size();
  std::vector<float> x(n, 1.0f), after(n), g(n, 0.5f), d(n, 0.25f);
  auto ok = [](int64_t, absl::Span<const float>, absl::Span<const float>,
               absl::Span<const float>) { return absl::OkStatus(); };
  REQUIRE(table->ElasticSync(0, x, 0.5, Weight(1.0), ok, absl::MakeSpan(after)).ok());
  const std::vector<float> c1 = Center(*table);
  auto decline = [](int64_t, double) -> absl::StatusOr<CenterTable::WeightDecision> {
    return CenterTable::WeightDecision::Decline();
  };
  int commits = 0;
  auto counted = [&](int64_t, absl::Span<const float>, absl::Span<const float>,
                     absl::Span<const float>) {
    ++commits;
    return absl::OkStatus();
  };
  auto elastic = table->ElasticSync(0, x, 0.5, decline, counted, absl::MakeSpan(after));
  REQUIRE(elastic.ok());
  CHECK(elastic->declined);
  CHECK(elastic->version == 1);  // the version it was declined at
  StagedProbe probe;
  auto staged = table->ElasticSyncStaged(0, x, 0.5, decline, probe.Decide(),
                                         absl::MakeSpan(after));
  REQUIRE(staged.ok());
  CHECK(staged->declined);
  CHECK(staged->version == 1);
  CHECK(probe.Events().empty());  // not decided, nothing written
  auto opt_commit = [&](int64_t, absl::Span<const float>, int64_t, absl::Span<const float>,
                        absl::Span<const float>) {
    ++commits;
    return absl::OkStatus();
  };
  auto pushed = table->ApplyAdaHessian(0, g, d, AdaHessianConfig(), decline, opt_commit);
  REQUIRE(pushed.ok());
  CHECK(pushed->declined);
  CHECK(pushed->version == 1);
  CHECK(commits == 0);
  CHECK(SameBits(c1, Center(*table)));
  CHECK(table->version(0) == 1);
}

TEST_CASE("ApplyAdaHessian is the weighted server kernel; a failed commit fences the stage") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  auto job = ParseJobConfig(kBigJob, "job.pbtxt");
  REQUIRE(job.ok());
  const AdaHessianConfig& ada = job->adahessian();
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> g(n), d(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = 0.01f * static_cast<float>(static_cast<int>(i % 13) - 6);
    d[i] = 0.002f * static_cast<float>(i % 7);
  }
  CHECK(table->Health().ok());
  std::vector<float> committed_m;
  int64_t committed_step = 0;
  auto commit = [&](int64_t, absl::Span<const float>, int64_t step, absl::Span<const float> m,
                    absl::Span<const float>) {
    committed_step = step;
    committed_m.assign(m.begin(), m.end());
    return absl::OkStatus();
  };
  std::vector<float> theta = c0, m(n, 0.0f), v(n, 0.0f);
  for (int64_t t = 1; t <= 2; ++t) {
    auto version = table->ApplyAdaHessian(0, g, d, ada, Weight(0.75), commit);
    REQUIRE(version.ok());
    CHECK(version->version == t);
    CHECK(committed_step == t);
    REQUIRE(compute::ServerAdaHessianApply(ada, 0.75, t, g, d, absl::MakeSpan(m),
                                           absl::MakeSpan(v), absl::MakeSpan(theta))
                .ok());
    CHECK(SameBits(theta, Center(*table)));
    CHECK(SameBits(m, committed_m));
  }

  auto failing = [](int64_t, absl::Span<const float>, int64_t, absl::Span<const float>,
                    absl::Span<const float>) { return absl::ResourceExhaustedError("disk full"); };
  CHECK(table->ApplyAdaHessian(0, g, d, ada, Weight(1.0), failing).status().code() ==
        absl::StatusCode::kResourceExhausted);
  // The store failed: the stage refuses everything until its durable state is reloaded.
  std::vector<float> after(n);
  auto ok = [](int64_t, absl::Span<const float>, absl::Span<const float>,
               absl::Span<const float>) { return absl::OkStatus(); };
  for (const absl::Status& status :
       {table->ApplyAdaHessian(0, g, d, ada, Weight(1.0), commit).status(),
        table->ElasticSync(0, g, 0.5, Weight(1.0), ok, absl::MakeSpan(after)).status(),
        table->Read(0).status()}) {
    CHECK(status.code() == absl::StatusCode::kUnavailable);
    CHECK_THAT(std::string(status.message()),
               Catch::Contains("refuses work until the server restarts"));
  }
  CHECK(table->version(0) == 2);
  CHECK(table->Health().code() == absl::StatusCode::kUnavailable);

  // Restoring the durable state (what a restarted server does) brings it back.
  CenterRecord record;
  record.set_stage(0);
  record.set_version(2);
  *record.mutable_params() = table->Bundle(0, theta);
  REQUIRE(table->Restore(record, nullptr).ok());
  CHECK(SameBits(theta, Center(*table)));
  CHECK(table->Health().ok());
  CHECK(table->ApplyAdaHessian(0, g, d, ada, Weight(1.0), commit).ok());
}

// Issue R9, center integrity: the poisoned updates of a byzantine or diverged trainer.

constexpr char kUnboundedJob[] = R"pb(
  model { input_dim: 4 layers { width: 3 } layers { width: 2 activation: IDENTITY } }
  topology { replicas: 2 stages: 1 }
  weighting { max_abs_value: 0 }
)pb";

// +v, -v, +v, ... over n elements.
std::vector<float> Alternating(size_t n, float v) {
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) x[i] = i % 2 == 0 ? v : -v;
  return x;
}

struct CommitCounter {
  int calls = 0;
  CenterTable::CommitFn Fn() {
    return [this](int64_t, absl::Span<const float>, absl::Span<const float>,
                  absl::Span<const float>) {
      ++calls;
      return absl::OkStatus();
    };
  }
};

TEST_CASE("a sync of +-3.4e38 is refused by the default bound, naming tensor and element") {
  std::unique_ptr<CenterTable> table = MakeTable(kJob);
  const std::vector<float> c0 = Center(*table);
  const std::vector<float> x = Alternating(c0.size(), 3.4e38f);
  std::vector<float> after(c0.size(), 7.0f);
  CommitCounter commits;
  auto result = table->ElasticSync(0, x, 0.45, Weight(1.0), commits.Fn(), absl::MakeSpan(after));
  REQUIRE(result.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string message(result.status().message());
  CHECK_THAT(message, Catch::Contains("the center of stage 0 hold 1.53e+38"));
  CHECK_THAT(message, Catch::Contains("at tensor id 0 (layer0.weight) element 0"));
  CHECK_THAT(message, Catch::Contains("x = 3.4e+38"));
  CHECK_THAT(message, Catch::Contains("|value| <= 1e+06 (weighting.max_abs_value)"));
  CHECK(commits.calls == 0);
  CHECK(table->version(0) == 0);
  CHECK(SameBits(c0, Center(*table)));
  CHECK(table->max_abs_seen(0) == 0.0f);
}

TEST_CASE("alternating huge syncs that would overflow the center are refused before the commit") {
  // Finite-only (max_abs_value 0): the first +-3.4e38 sync is finite and accepted; the next
  // with the signs swapped would make x - c overflow to infinity and is refused.
  std::unique_ptr<CenterTable> table = MakeTable(kUnboundedJob);
  const size_t n = Center(*table).size();
  std::vector<float> after(n);
  CommitCounter commits;
  auto first = table->ElasticSync(0, Alternating(n, 3.4e38f), 0.45, Weight(1.0), commits.Fn(),
                                  absl::MakeSpan(after));
  REQUIRE(first.ok());
  CHECK(first->version == 1);
  CHECK(table->max_abs_seen(0) > 1.0e38f);
  const std::vector<float> c1 = Center(*table);
  auto second = table->ElasticSync(0, Alternating(n, -3.4e38f), 0.45, Weight(1.0), commits.Fn(),
                                   absl::MakeSpan(after));
  REQUIRE(second.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(second.status().message()),
             Catch::Contains("hold -inf at tensor id 0 (layer0.weight) element 0"));
  CHECK_THAT(std::string(second.status().message()), Catch::Contains("must be finite;"));
  CHECK(commits.calls == 1);
  CHECK(table->version(0) == 1);
  CHECK(SameBits(c1, Center(*table)));
}

TEST_CASE("a sync whose snapshot would be just over max_abs_value is refused, just under accepted") {
  // alpha 0.5, w 1: the snapshot is x - 0.5 (x - c) and the center c + 0.5 (x - c), both near
  // x / 2 for a large x; the bound is 1e6.
  std::unique_ptr<CenterTable> table = MakeTable(kJob);
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> after(n);
  CommitCounter commits;
  std::vector<float> over = c0;
  over[n - 1] = 2.0e6f + 100.0f;  // the last bias: tensor id 3, element 1
  auto refused = table->ElasticSync(0, over, 0.5, Weight(1.0), commits.Fn(), absl::MakeSpan(after));
  REQUIRE(refused.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(refused.status().message()),
             Catch::Contains("at tensor id 3 (layer1.bias) element 1"));
  CHECK(commits.calls == 0);
  CHECK(SameBits(c0, Center(*table)));

  std::vector<float> under = c0;
  under[n - 1] = 2.0e6f - 100.0f;
  auto accepted = table->ElasticSync(0, under, 0.5, Weight(1.0), commits.Fn(), absl::MakeSpan(after));
  REQUIRE(accepted.ok());
  CHECK(commits.calls == 1);
  CHECK(table->max_abs_seen(0) > 0.99e6f);
  CHECK(table->max_abs_seen(0) <= 1.0e6f);
}

TEST_CASE("a push whose result would overflow m, v or the center is refused and changes nothing") {
  std::unique_ptr<CenterTable> table = MakeTable(kBigJob);
  auto job = ParseJobConfig(kBigJob, "job.pbtxt");
  REQUIRE(job.ok());
  const AdaHessianConfig& ada = job->adahessian();
  const std::vector<float> c0 = Center(*table);
  const size_t n = c0.size();
  std::vector<float> g(n, 0.01f), d(n, 0.002f);
  int commits = 0;
  auto commit = [&](int64_t, absl::Span<const float>, int64_t, absl::Span<const float>,
                    absl::Span<const float>) {
    ++commits;
    return absl::OkStatus();
  };
  SECTION("a huge D overflows v = beta2 v + (1 - beta2) w D^2") {
    std::vector<float> huge_d = d;
    // layer0.weight holds 60000 elements, then layer0.bias (tensor id 1) 200: 60005 is its
    // element 5, the first refused; 61000 lies in layer1.weight.
    huge_d[61000] = 3.0e38f;
    huge_d[60005] = 3.0e38f;
    auto result = table->ApplyAdaHessian(0, g, huge_d, ada, Weight(1.0), commit);
    REQUIRE(result.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(result.status().message()),
               Catch::Contains("the center's AdaHessian v of stage 0 hold inf at tensor id 1 "
                               "(layer0.bias) element 5"));
  }
  SECTION("a huge g moves the center beyond max_abs_value") {
    std::vector<float> huge_g = Alternating(n, 3.0e38f);
    auto result = table->ApplyAdaHessian(0, huge_g, d, ada, Weight(1.0), commit);
    REQUIRE(result.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(result.status().message()),
               Catch::Contains("the center of stage 0 hold"));
    CHECK_THAT(std::string(result.status().message()),
               Catch::Contains("at tensor id 0 (layer0.weight) element 0 (g = 3e+38"));
  }
  CHECK(commits == 0);
  CHECK(table->version(0) == 0);
  CHECK(SameBits(c0, Center(*table)));
  CHECK(table->Health().ok());
  // m, v and the optimizer step are untouched too: the next honest push is step t = 1 on zero
  // state, bit for bit.
  auto version = table->ApplyAdaHessian(0, g, d, ada, Weight(1.0), commit);
  REQUIRE(version.ok());
  CHECK(version->version == 1);
  std::vector<float> theta = c0, m(n, 0.0f), v(n, 0.0f);
  REQUIRE(compute::ServerAdaHessianApply(ada, 1.0, 1, g, d, absl::MakeSpan(m), absl::MakeSpan(v),
                                         absl::MakeSpan(theta))
              .ok());
  CHECK(SameBits(theta, Center(*table)));
}

}  // namespace
}  // namespace rebound::server

namespace rebound::server {
namespace {

constexpr char kDeclaredJob[] = R"pb(
  model { declared_by_worker: true }
  topology { replicas: 2 stages: 1 }
)pb";

// A conv-net-like declaration: a 4-d weight, a bias, a 2-d weight.
TensorBundle DeclaredModel(float first_value) {
  TensorBundle model;
  const std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"conv.weight", {2, 1, 3, 3}}, {"conv.bias", {2}}, {"fc.weight", {3, 8}}};
  float value = first_value;
  for (size_t i = 0; i < tensors.size(); ++i) {
    Tensor* t = model.add_tensors();
    t->set_id(static_cast<uint32_t>(i));
    t->set_name(tensors[i].first);
    t->set_dtype(FLOAT32);
    int64_t n = 1;
    for (int64_t d : tensors[i].second) {
      t->add_shape(d);
      n *= d;
    }
    std::vector<float> values(n);
    for (float& v : values) v = (value += 0.25f);
    t->set_data(std::string(reinterpret_cast<const char*>(values.data()), n * sizeof(float)));
  }
  return model;
}

TEST_CASE("a declared model has no stage until declared, then its shapes and initial values") {
  auto table = MakeTable(kDeclaredJob);
  CHECK(table->num_stages() == 0);
  const TensorBundle model = DeclaredModel(1.0f);
  REQUIRE(table->Declare(model).ok());
  REQUIRE(table->num_stages() == 1);
  CHECK(table->layout(0).packed_size() == 18 + 2 + 24);
  const std::vector<float> center = Center(*table);
  REQUIRE(center.size() == 44u);
  CHECK(center[0] == 1.25f);
  CHECK(center[43] == 1.0f + 44 * 0.25f);
  // The bundle the server sends back has the declared shapes.
  const TensorBundle bundle = table->Bundle(0, center);
  REQUIRE(bundle.tensors_size() == 3);
  CHECK(bundle.tensors(0).shape_size() == 4);
  CHECK(bundle.tensors(0).shape(3) == 3);
  CHECK(table->ValidateBundle(0, model, "params").ok());
  // Declared once only.
  CHECK(table->Declare(model).code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("CheckModel names the first tensor that differs from the declared layout") {
  auto table = MakeTable(kDeclaredJob);
  REQUIRE(table->Declare(DeclaredModel(0.0f)).ok());
  // Other values, same layout: accepted (data is not compared).
  CHECK(table->CheckModel(DeclaredModel(7.0f), "w1").ok());

  TensorBundle other_shape = DeclaredModel(0.0f);
  other_shape.mutable_tensors(2)->set_shape(1, 9);
  absl::Status refused = table->CheckModel(other_shape, "the first registration, of 'w1'");
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(refused.message()),
             Catch::Contains("at tensor 2") && Catch::Contains("'fc.weight' of shape [3, 9]") &&
                 Catch::Contains("[3, 8]") && Catch::Contains("of 'w1'"));

  TensorBundle renamed = DeclaredModel(0.0f);
  renamed.mutable_tensors(1)->set_name("conv.b");
  CHECK_THAT(std::string(table->CheckModel(renamed, "x").message()),
             Catch::Contains("at tensor 1") && Catch::Contains("'conv.b'"));

  TensorBundle shorter = DeclaredModel(0.0f);
  shorter.mutable_tensors()->RemoveLast();
  CHECK_THAT(std::string(table->CheckModel(shorter, "x").message()),
             Catch::Contains("ends after 2 tensors"));

  TensorBundle longer = DeclaredModel(0.0f);
  *longer.add_tensors() = longer.tensors(1);
  longer.mutable_tensors(3)->set_id(3);
  longer.mutable_tensors(3)->set_name("extra");
  CHECK_THAT(std::string(table->CheckModel(longer, "x").message()),
             Catch::Contains("declares 4 tensors, the job has 3") && Catch::Contains("'extra'"));
}

TEST_CASE("a malformed declaration is refused and declares nothing") {
  auto table = MakeTable(kDeclaredJob);
  TensorBundle nan = DeclaredModel(0.0f);
  float bad = std::nanf("");
  std::string* data = nan.mutable_tensors(1)->mutable_data();
  std::memcpy(data->data(), &bad, sizeof(bad));
  CHECK(table->Declare(nan).code() == absl::StatusCode::kInvalidArgument);

  TensorBundle wrong_ids = DeclaredModel(0.0f);
  wrong_ids.mutable_tensors(1)->set_id(5);
  CHECK(table->Declare(wrong_ids).code() == absl::StatusCode::kInvalidArgument);

  TensorBundle short_data = DeclaredModel(0.0f);
  short_data.mutable_tensors(0)->mutable_data()->resize(8);
  CHECK(table->Declare(short_data).code() == absl::StatusCode::kInvalidArgument);

  TensorBundle twice = DeclaredModel(0.0f);
  twice.mutable_tensors(2)->set_name("conv.weight");
  CHECK(table->Declare(twice).code() == absl::StatusCode::kInvalidArgument);
  CHECK(table->num_stages() == 0);
  REQUIRE(table->Declare(DeclaredModel(0.0f)).ok());
}

TEST_CASE("an MLP job refuses a declaration and checks one against its spec's layout") {
  auto table = MakeTable(kJob);
  CHECK(table->Declare(DeclaredModel(0.0f)).code() == absl::StatusCode::kFailedPrecondition);
  TensorBundle mlp = table->Bundle(0, Center(*table));
  CHECK(table->CheckModel(mlp, "the job's model spec").ok());
  mlp.mutable_tensors(0)->set_shape(0, 4);
  CHECK_THAT(std::string(table->CheckModel(mlp, "the job's model spec").message()),
             Catch::Contains("'layer0.weight' of shape [4, 4]") &&
                 Catch::Contains("the job's model spec"));
}

TEST_CASE("Restore of a declared-model job declares the model from the stored center") {
  auto table = MakeTable(kDeclaredJob);
  CenterRecord record;
  record.set_stage(0);
  record.set_version(12);
  *record.mutable_params() = DeclaredModel(3.0f);
  REQUIRE(table->Restore(record, nullptr).ok());
  REQUIRE(table->num_stages() == 1);
  CHECK(table->version(0) == 12);
  CHECK(Center(*table)[0] == 3.25f);
}

TEST_CASE("a sharded declared model: each group's table holds its slice, checks the whole "
          "layout and gives the declaration back") {
  auto job = ParseJobConfig(std::string(kDeclaredJob) + "sharding { groups: 3 }\n", "job.pbtxt");
  REQUIRE(job.ok());
  const TensorBundle model = DeclaredModel(1.0f);  // 44 parameters: ranges of 14, 15 and 15
  std::vector<float> joined;
  for (int range = 0; range < 3; ++range) {
    auto table = CenterTable::Create(*job, range);
    REQUIRE(table.ok());
    CHECK((*table)->Declaration().status().code() == absl::StatusCode::kFailedPrecondition);
    REQUIRE((*table)->Declare(model).ok());
    REQUIRE((*table)->num_stages() == 1);
    CHECK((*table)->StageParameters(0) == 44);
    CHECK((*table)->layout(0).packed_size() == (range == 0 ? 14 : 15));
    const std::vector<float> slice = Center(**table);
    joined.insert(joined.end(), slice.begin(), slice.end());
    // Another worker's declaration is checked against the whole model, not the range.
    CHECK((*table)->CheckModel(DeclaredModel(5.0f), "w1").ok());
    TensorBundle other = DeclaredModel(1.0f);
    other.mutable_tensors(2)->set_shape(1, 9);
    CHECK((*table)->CheckModel(other, "w1").code() == absl::StatusCode::kFailedPrecondition);
    auto declaration = (*table)->Declaration();
    REQUIRE(declaration.ok());
    CHECK(declaration->SerializeAsString() == model.SerializeAsString());
    // A stored range center is restored only after the declaration (a range bundle does not
    // declare the model).
    auto restarted = CenterTable::Create(*job, range);
    REQUIRE(restarted.ok());
    CenterRecord range_record;
    range_record.set_stage(0);
    range_record.set_version(4);
    *range_record.mutable_params() = (*table)->Bundle(0, slice);
    CHECK_FALSE((*restarted)->Restore(range_record, nullptr).ok());
    REQUIRE((*restarted)->Declare(model).ok());
    REQUIRE((*restarted)->Restore(range_record, nullptr).ok());
    CHECK((*restarted)->version(0) == 4);
  }
  // The three slices are the declared values, in order.
  REQUIRE(joined.size() == 44u);
  for (size_t i = 0; i < joined.size(); ++i) {
    INFO("element " << i);
    CHECK(joined[i] == 1.0f + (i + 1) * 0.25f);
  }
  // A range outside the job's groups is refused.
  CHECK(CenterTable::Create(*job, 3).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace rebound::server
