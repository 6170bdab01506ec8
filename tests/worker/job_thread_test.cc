// JobThread (worker/job_thread.h): the replay engine's one long-lived sender thread. Every job
// runs on the same thread, however many are started (a parallel replay used to start a thread
// per replayed step), overlapping the caller's own work, and Wait returns each job's status.

#include <catch2/catch.hpp>

#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "worker/job_thread.h"

namespace rebound::worker {
namespace {

TEST_CASE("a job thread runs N jobs on one thread, in order, with the same result as running "
          "them inline") {
  constexpr int kJobs = 200;
  JobThread thread;
  std::set<std::thread::id> ran_on;
  std::vector<int> order;
  int64_t sum_threaded = 0;
  for (int i = 0; i < kJobs; ++i) {
    thread.Start([&, i] {
      ran_on.insert(std::this_thread::get_id());
      order.push_back(i);
      sum_threaded += static_cast<int64_t>(i) * i;
      return absl::OkStatus();
    });
    REQUIRE(thread.Wait().ok());
  }
  int64_t sum_inline = 0;
  for (int i = 0; i < kJobs; ++i) sum_inline += static_cast<int64_t>(i) * i;
  CHECK(sum_threaded == sum_inline);
  REQUIRE(ran_on.size() == 1);  // bounded: one thread for every job
  CHECK(*ran_on.begin() == thread.thread_id());
  CHECK(*ran_on.begin() != std::this_thread::get_id());
  REQUIRE(order.size() == kJobs);
  for (int i = 0; i < kJobs; ++i) CHECK(order[i] == i);
}

TEST_CASE("a job runs while its starter works, and Wait returns the job's status") {
  JobThread thread;
  absl::Notification started_work;
  absl::Notification job_may_end;
  thread.Start([&] {
    started_work.WaitForNotification();  // the caller is working now
    job_may_end.WaitForNotification();
    return absl::DeadlineExceededError("peer 2 did not answer");
  });
  started_work.Notify();  // the caller's own work, concurrent with the job
  job_may_end.Notify();
  const absl::Status status = thread.Wait();
  CHECK(status.code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(status.message() == "peer 2 did not answer");

  thread.Start([] { return absl::OkStatus(); });
  CHECK(thread.Wait().ok());
}

TEST_CASE("Wait without a started job is FAILED_PRECONDITION") {
  JobThread thread;
  CHECK(thread.Wait().code() == absl::StatusCode::kFailedPrecondition);
  thread.Start([] { return absl::OkStatus(); });
  CHECK(thread.Wait().ok());
  CHECK(thread.Wait().code() == absl::StatusCode::kFailedPrecondition);
}

TEST_CASE("destroying a job thread lets a started job finish first") {
  std::atomic<bool> ran{false};
  {
    JobThread thread;
    thread.Start([&] {
      ran.store(true);
      return absl::OkStatus();
    });
  }
  CHECK(ran.load());
}

}  // namespace
}  // namespace rebound::worker
