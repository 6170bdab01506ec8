#pragma once

// JobThread: one long-lived thread that runs one job at a time for its owner, so that a loop that
// overlaps work with a blocking call (a parallel replay sends its partial sums while it prepares
// the next step) does not start a thread per iteration. The thread starts with the JobThread and
// is joined by its destructor.
//
//   JobThread sender;
//   for (...) {
//     sender.Start([&] { return Send(...); });
//     ...other work...
//     absl::Status sent = sender.Wait();
//   }
//
// Thread-safety: Start and Wait are called by the owner's thread only (one job in flight at a
// time); the job runs on the JobThread's thread. Ownership: the job is moved in and destroyed on
// the JobThread's thread once it has run; whatever it references must live until Wait returns.
// Status codes: Wait returns the job's status; FAILED_PRECONDITION if no job was started.

#include <functional>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"

namespace rebound::worker {

class JobThread {
 public:
  JobThread();
  // Waits for a running job, then stops and joins the thread.
  ~JobThread();

  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  // Hands `job` to the thread. REQUIRES: the previous job (if any) was waited for.
  void Start(std::function<absl::Status()> job);
  // Waits for the started job to finish and returns its status.
  absl::Status Wait();

  // The id of the thread that runs the jobs (the same for the JobThread's whole life).
  std::thread::id thread_id() const { return thread_.get_id(); }

 private:
  void Loop();

  absl::Mutex mu_;
  std::function<absl::Status()> job_ ABSL_GUARDED_BY(mu_);  // empty: none waiting to run
  bool running_ ABSL_GUARDED_BY(mu_) = false;  // started and not yet finished
  bool started_ ABSL_GUARDED_BY(mu_) = false;  // started and not yet waited for
  std::optional<absl::Status> result_ ABSL_GUARDED_BY(mu_);
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the fields above exist
};

}  // namespace rebound::worker
