#include "worker/job_thread.h"

#include <utility>

namespace rebound::worker {

JobThread::JobThread() : thread_([this] { Loop(); }) {}

JobThread::~JobThread() {
  {
    absl::MutexLock lock(&mu_);
    quit_ = true;
  }
  thread_.join();
}

void JobThread::Start(std::function<absl::Status()> job) {
  absl::MutexLock lock(&mu_);
  job_ = std::move(job);
  running_ = true;
  started_ = true;
  result_.reset();
}

absl::Status JobThread::Wait() {
  absl::MutexLock lock(&mu_);
  if (!started_) return absl::FailedPreconditionError("no job was started");
  mu_.Await(absl::Condition(
      +[](JobThread* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) { return !self->running_; },
      this));
  started_ = false;
  return *std::move(result_);
}

void JobThread::Loop() {
  while (true) {
    std::function<absl::Status()> job;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](JobThread* self) ABSL_EXCLUSIVE_LOCKS_REQUIRED(self->mu_) {
            return self->quit_ || self->job_ != nullptr;
          },
          this));
      // A job handed over before the quit still runs (the destructor's caller may wait on it).
      if (job_ == nullptr) return;
      job = std::move(job_);
      job_ = nullptr;
    }
    absl::Status status = job();
    job = nullptr;  // destroyed here, before the owner learns the job is done
    absl::MutexLock lock(&mu_);
    result_ = std::move(status);
    running_ = false;
  }
}

}  // namespace rebound::worker
