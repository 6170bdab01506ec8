// Hands a plain (non-atomic) value from one thread to another through one absl primitive,
// named by argv[1]. Under --config=tsan with the interposer TSan must see the hand-off and stay
// silent; with REBOUND_TSAN_INTERPOSER=off it cannot see it and must report a race
// (interposer_test.sh checks both).

#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace {

constexpr int kRounds = 200;

int MutexCase() {
  absl::Mutex mu;
  int counter = 0;  // guarded by mu
  auto add = [&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      ++counter;
    }
  };
  std::thread a(add), b(add);
  a.join();
  b.join();
  return counter == 2 * kRounds ? 0 : 1;
}

int ReaderLockCase() {
  absl::Mutex mu;
  int value = 0;  // guarded by mu
  std::thread writer([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      ++value;
    }
  });
  int seen = 0;
  std::thread reader([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::ReaderMutexLock lock(&mu);
      seen = value;
    }
  });
  writer.join();
  reader.join();
  return seen <= kRounds ? 0 : 1;
}

int TryLockCase() {
  absl::Mutex mu;
  int counter = 0;  // guarded by mu
  auto add = [&] {
    for (int i = 0; i < kRounds;) {
      if (mu.TryLock()) {
        ++counter;
        mu.Unlock();
        ++i;
      }
    }
  };
  std::thread a(add), b(add);
  a.join();
  b.join();
  return counter == 2 * kRounds ? 0 : 1;
}

int CondVarCase() {
  absl::Mutex mu;
  absl::CondVar cv;
  bool ready = false;  // guarded by mu
  int value = 0;       // written before ready, read after
  std::thread consumer([&] {
    absl::MutexLock lock(&mu);
    while (!ready) cv.WaitWithTimeout(&mu, absl::Milliseconds(1));
    value += 1;
  });
  std::thread producer([&] {
    absl::MutexLock lock(&mu);
    value = 41;
    ready = true;
    cv.Signal();
  });
  producer.join();
  consumer.join();
  return value == 42 ? 0 : 1;
}

int AwaitCase() {
  absl::Mutex mu;
  bool ready = false;  // guarded by mu
  int value = 0;
  std::thread consumer([&] {
    mu.LockWhen(absl::Condition(&ready));
    value += 1;
    mu.Unlock();
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&ready));
    value += 1;
  });
  std::thread producer([&] {
    absl::MutexLock lock(&mu);
    value = 40;
    ready = true;
  });
  producer.join();
  consumer.join();
  return value == 42 ? 0 : 1;
}

// The Condition of Await and AwaitWithTimeout reads guarded state when the waiter wakes, inside
// the library, while another thread keeps writing it under the mutex.
int AwaitConditionCase() {
  absl::Mutex mu;
  int counter = 0;  // guarded by mu
  auto reached = [&counter] { return counter >= kRounds; };
  std::thread waiter([&] {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&reached));
    while (!mu.AwaitWithTimeout(absl::Condition(&reached), absl::Milliseconds(1))) {
    }
  });
  std::thread writer([&] {
    for (int i = 0; i < kRounds; ++i) {
      absl::MutexLock lock(&mu);
      ++counter;
    }
  });
  writer.join();
  waiter.join();
  return counter == kRounds ? 0 : 1;
}

// An object holding a mutex, handed to another thread the way gRPC hands its objects over:
// through atomics TSan does not see (here: plain stores in a function it does not instrument).
// The mutex word's own read on lock must not be reported as racing with the object's
// allocation. Nothing guarded is touched: that would be a real unsafe publication.
struct Box {
  absl::Mutex mu;
};

// Volatile, not atomic: TSan instruments atomics even in a function it does not instrument.
// (x86 orders these stores and loads; the compiler is kept from reordering by volatile.)
__attribute__((no_sanitize("thread"))) void PublishUnseen(Box* volatile* slot, Box* box) {
  *slot = box;
}

__attribute__((no_sanitize("thread"))) Box* LoadUnseen(Box* volatile* slot) { return *slot; }

int LibraryPublishedMutexCase() {
  Box* volatile slot = nullptr;
  std::thread maker([&] { PublishUnseen(&slot, new Box); });
  Box* box = nullptr;
  while ((box = LoadUnseen(&slot)) == nullptr) std::this_thread::yield();
  {
    absl::MutexLock lock(&box->mu);
  }
  maker.join();
  delete box;
  return 0;
}

int NotificationCase() {
  absl::Notification published, waited;
  int first = 0, second = 0;
  std::thread producer([&] {
    first = 1;
    published.Notify();
    second = 2;
    waited.Notify();
  });
  // The inline fast path (HasBeenNotified) and the out-of-line one (WaitForNotification).
  while (!published.HasBeenNotified()) std::this_thread::yield();
  const int a = first;
  waited.WaitForNotification();
  const int b = second;
  producer.join();
  return a == 1 && b == 2 ? 0 : 1;
}

int BlockingCounterCase() {
  constexpr int kThreads = 4;
  std::vector<int> slots(kThreads, 0);
  absl::BlockingCounter done(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] {
      slots[i] = i + 1;
      done.DecrementCount();
    });
  }
  done.Wait();
  int sum = 0;
  for (int s : slots) sum += s;
  for (auto& t : threads) t.join();
  return sum == 10 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const char* name = argc > 1 ? argv[1] : "";
  struct Case {
    const char* name;
    int (*run)();
  } cases[] = {
      {"mutex", MutexCase},       {"reader_lock", ReaderLockCase},
      {"try_lock", TryLockCase},  {"condvar", CondVarCase},
      {"await", AwaitCase},       {"await_condition", AwaitConditionCase},
      {"notification", NotificationCase},
      {"library_published_mutex", LibraryPublishedMutexCase},
      {"blocking_counter", BlockingCounterCase},
  };
  for (const Case& c : cases) {
    if (std::strcmp(c.name, name) == 0) return c.run();
  }
  std::fprintf(stderr, "usage: guarded_handoffs CASE\n");
  return 2;
}
