// The termination-signal hand-off of common/process.h: a SIGTERM sent to the process reaches
// WaitForTerminationSignal() promptly, also under ThreadSanitizer, which runs a signal handler
// late unless the receiving thread is in a call it knows to block (an idle rebound_server under
// --config=tsan ignored SIGTERM for good while its main thread sat in read() on the pipe).

#include <catch2/catch.hpp>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "common/process.h"

namespace rebound {
namespace {

TEST_CASE("a SIGTERM sent to the process ends WaitForTerminationSignal within seconds") {
  InstallTerminationHandlers();
  std::atomic<bool> returned{false};
  // A hang would otherwise last until Bazel's timeout: fail fast and say why.
  std::thread watchdog([&returned] {
    for (int i = 0; i < 300 && !returned.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (!returned.load()) {
      std::fprintf(stderr, "WaitForTerminationSignal did not return 30 s after SIGTERM\n");
      _exit(1);
    }
  });
  std::thread sender([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the main thread is waiting
    kill(getpid(), SIGTERM);
  });
  const int received = WaitForTerminationSignal();
  returned.store(true);
  sender.join();
  watchdog.join();
  CHECK(received == SIGTERM);
}

}  // namespace
}  // namespace rebound
