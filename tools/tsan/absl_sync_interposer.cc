// ThreadSanitizer annotations for Debian's prebuilt Abseil synchronization library.
//
// What it does: Debian's libabsl_synchronization.so is compiled without -fsanitize=thread, so
// its ABSL_TSAN_MUTEX_* annotations are compiled out and TSan never sees an absl::Mutex being
// locked or unlocked. Every access guarded by an absl::Mutex would then be reported as a race.
// This translation unit is linked into every binary of --config=tsan (`--custom_malloc`, see
// .bazelrc) and defines the out-of-line members of absl::Mutex, absl::CondVar,
// absl::Notification and absl::BlockingCounter itself. A definition in the executable
// interposes the one in the shared library for every caller: Rebound's code, gRPC (grpc_core::
// Mutex is an absl::Mutex) and libabsl_synchronization's own internal calls (they go through
// the PLT; checked with objdump, docs/thread_safety.md). Each wrapper finds the real function
// with dlsym(RTLD_NEXT, mangled name) and surrounds it with the same __tsan_mutex_pre_lock /
// post_lock / pre_unlock / post_unlock calls that an instrumented Abseil makes.
//
// Not modelled (each only hides accesses, it never invents a race):
//   * a Condition evaluated inside the library (LockWhen, Await, and by the unlocking thread on a
//     waiter's behalf) runs between a pre and a post annotation, where TSan ignores accesses
//     (an instrumented Abseil makes them visible with a dance of extra annotations we cannot
//     insert into the library's code);
//   * Mutex destruction (TSan forgets the mutex when its memory is freed);
//   * the mutex word's own read on lock and unlock (see PostLock below).
//
// Setting REBOUND_TSAN_INTERPOSER=off in the environment makes every wrapper a plain
// forwarder; tools/tsan:interposer_test uses it to show that TSan then reports the accesses
// the annotations make safe.
//
// Thread-safety: every function is as thread-safe as the one it wraps; the lookups of the real
// functions are function-local statics (thread-safe initialization). Ownership: the wrappers
// borrow only their arguments, for the call. Errors: none returned; a real function that
// dlsym cannot find (Abseil no longer in namespace debian3) aborts the process with its name.
//
// Also defines TSan's default options and suppressions for every binary of the build (a race
// in any process, a spawned server or worker included, ends it with exit code 66), so they
// hold whatever environment a test gives its children; TSAN_OPTIONS still overrides them.

#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

// TSan's runtime has them; sanitizer/tsan_interface.h does not declare them.
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();

namespace {

// The real function named `mangled` in the next object after this executable (the library).
template <typename Fn>
Fn Real(const char* mangled) {
  void* symbol = dlsym(RTLD_NEXT, mangled);
  if (symbol == nullptr) {
    std::fprintf(stderr, "tsan interposer: %s not found (%s): is Abseil still debian3?\n",
                 mangled, dlerror());
    std::abort();
  }
  return reinterpret_cast<Fn>(symbol);
}

bool Enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("REBOUND_TSAN_INTERPOSER");
    return v == nullptr || std::strcmp(v, "off") != 0;
  }();
  return enabled;
}

// The library calls its own exported functions through the PLT too (CondVar::WaitWithTimeout
// tail-calls WaitWithDeadline, for one), so a wrapper may run inside another on the same mutex:
// only the outermost Mutex or CondVar wrapper of a thread annotates.
thread_local int mutex_call_depth = 0;

class MutexCall {
 public:
  MutexCall() : annotate_(Enabled() && mutex_call_depth == 0) { ++mutex_call_depth; }
  ~MutexCall() { --mutex_call_depth; }
  bool annotate() const { return annotate_; }

 private:
  const bool annotate_;
};

// absl::Mutex is one word, mu_; kMuWriter (absl/synchronization/mutex.cc) is set while it is
// held exclusively. Await and CondVar::Wait release and reacquire the mutex in the mode the
// caller holds it, so the annotation must name that mode.
constexpr intptr_t kMuWriter = 0x0008L;
static_assert(sizeof(absl::Mutex) == sizeof(intptr_t), "absl::Mutex layout changed");

unsigned HeldModeFlags(const absl::Mutex* mu) {
  const auto* word = reinterpret_cast<const std::atomic<intptr_t>*>(mu);
  return (word->load(std::memory_order_relaxed) & kMuWriter) != 0 ? 0 : __tsan_mutex_read_lock;
}

// Notification is {Mutex mutex_; std::atomic<bool> notified_yet_;}. HasBeenNotified() is inline
// (compiled, instrumented, into Rebound's code) and acquires notified_yet_, which Notify() stores
// inside the library where TSan cannot see it: Notify releases that address on TSan's behalf.
struct NotificationLayout {
  absl::Mutex mutex;
  std::atomic<bool> notified_yet;
};
static_assert(sizeof(NotificationLayout) == sizeof(absl::Notification),
              "absl::Notification layout changed");

void* NotifiedYet(const absl::Notification* n) {
  return const_cast<std::atomic<bool>*>(
      &reinterpret_cast<const NotificationLayout*>(n)->notified_yet);
}

struct Void {};

// post_lock and pre_unlock also read the mutex word, to catch a lock racing with the mutex's
// creation or free. gRPC hands objects that hold an absl::Mutex from thread to thread through
// its own uninstrumented atomics, so TSan reports that read as racing with the allocation of the
// object (integration tests, in rebound_server's gRPC threads). Those two annotations run with
// the thread's accesses ignored; their synchronization still counts. What this hides, a mutex
// locked while its memory is being allocated or freed, shows as well on the guarded fields that
// the holder then reads and writes.
void PostLock(const void* mu, unsigned flags) {
  __tsan_ignore_thread_begin();
  __tsan_mutex_post_lock(const_cast<void*>(mu), flags, 0);
  __tsan_ignore_thread_end();
}

void PreUnlock(const void* mu, unsigned flags) {
  __tsan_ignore_thread_begin();
  __tsan_mutex_pre_unlock(const_cast<void*>(mu), flags);
  __tsan_ignore_thread_end();
}

// The lock-acquiring calls: pre_lock, the real call, post_lock.
template <typename R, typename Call>
R Acquire(absl::Mutex* mu, unsigned flags, Call call) {
  MutexCall nested;
  if (!nested.annotate()) return call();
  __tsan_mutex_pre_lock(mu, flags);
  R r = call();
  PostLock(mu, flags);
  return r;
}

// Calls that release the held mutex, block, and reacquire it (Await, CondVar::Wait). The real
// call runs inside the unlock annotation: pre_unlock releases for TSan and makes it ignore the
// accesses up to post_unlock, among them the Condition that Await evaluates on waking, before
// it holds the mutex again in TSan's eyes (reading guarded state, seen without the ignore as a
// race with the last writer). The lock annotation follows once the real call holds the mutex.
template <typename R, typename Call>
R ReleaseAndReacquire(absl::Mutex* mu, Call call) {
  MutexCall nested;
  if (!nested.annotate()) return call();
  const unsigned flags = HeldModeFlags(mu);
  PreUnlock(mu, flags);
  R r = call();
  __tsan_mutex_post_unlock(mu, flags);
  __tsan_mutex_pre_lock(mu, flags);
  PostLock(mu, flags);
  return r;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

// ---- Mutex ----------------------------------------------------------------------------------

void Mutex::Lock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex4LockEv");
  Acquire<Void>(this, 0, [&] { real(this); return Void{}; });
}

void Mutex::ReaderLock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex10ReaderLockEv");
  Acquire<Void>(this, __tsan_mutex_read_lock, [&] { real(this); return Void{}; });
}

void Mutex::Unlock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex6UnlockEv");
  MutexCall nested;
  if (!nested.annotate()) return real(this);
  PreUnlock(this, 0);
  real(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderUnlock() {
  static const auto real = Real<void (*)(Mutex*)>("_ZN4absl7debian35Mutex12ReaderUnlockEv");
  MutexCall nested;
  if (!nested.annotate()) return real(this);
  PreUnlock(this, __tsan_mutex_read_lock);
  real(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

namespace {
bool TryAcquire(Mutex* mu, unsigned flags, bool (*real)(Mutex*)) {
  MutexCall nested;
  if (!nested.annotate()) return real(mu);
  __tsan_mutex_pre_lock(mu, flags | __tsan_mutex_try_lock);
  const bool locked = real(mu);
  PostLock(mu, flags | __tsan_mutex_try_lock | (locked ? 0 : __tsan_mutex_try_lock_failed));
  return locked;
}
}  // namespace

bool Mutex::TryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex7TryLockEv");
  return TryAcquire(this, 0, real);
}

bool Mutex::ReaderTryLock() {
  static const auto real = Real<bool (*)(Mutex*)>("_ZN4absl7debian35Mutex13ReaderTryLockEv");
  return TryAcquire(this, __tsan_mutex_read_lock, real);
}

void Mutex::LockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex8LockWhenERKNS0_9ConditionE");
  Acquire<Void>(this, 0, [&] { real(this, cond); return Void{}; });
}

void Mutex::ReaderLockWhen(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex14ReaderLockWhenERKNS0_9ConditionE");
  Acquire<Void>(this, __tsan_mutex_read_lock, [&] { real(this, cond); return Void{}; });
}

// The *WithTimeout / *WithDeadline variants hold the mutex on return whatever they return.
bool Mutex::LockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "_ZN4absl7debian35Mutex19LockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Acquire<bool>(this, 0, [&] { return real(this, cond, timeout); });
}

bool Mutex::LockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "_ZN4absl7debian35Mutex20LockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Acquire<bool>(this, 0, [&] { return real(this, cond, deadline); });
}

bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "_ZN4absl7debian35Mutex25ReaderLockWhenWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return Acquire<bool>(this, __tsan_mutex_read_lock,
                       [&] { return real(this, cond, timeout); });
}

bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "_ZN4absl7debian35Mutex26ReaderLockWhenWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return Acquire<bool>(this, __tsan_mutex_read_lock,
                       [&] { return real(this, cond, deadline); });
}

void Mutex::Await(const Condition& cond) {
  static const auto real = Real<void (*)(Mutex*, const Condition&)>(
      "_ZN4absl7debian35Mutex5AwaitERKNS0_9ConditionE");
  ReleaseAndReacquire<Void>(this, [&] { real(this, cond); return Void{}; });
}

bool Mutex::AwaitWithTimeout(const Condition& cond, absl::Duration timeout) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Duration)>(
      "_ZN4absl7debian35Mutex16AwaitWithTimeoutERKNS0_9ConditionENS0_8DurationE");
  return ReleaseAndReacquire<bool>(this, [&] { return real(this, cond, timeout); });
}

bool Mutex::AwaitWithDeadline(const Condition& cond, absl::Time deadline) {
  static const auto real = Real<bool (*)(Mutex*, const Condition&, absl::Time)>(
      "_ZN4absl7debian35Mutex17AwaitWithDeadlineERKNS0_9ConditionENS0_4TimeE");
  return ReleaseAndReacquire<bool>(this, [&] { return real(this, cond, deadline); });
}

// ---- CondVar --------------------------------------------------------------------------------

void CondVar::Wait(Mutex* mu) {
  static const auto real =
      Real<void (*)(CondVar*, Mutex*)>("_ZN4absl7debian37CondVar4WaitEPNS0_5MutexE");
  ReleaseAndReacquire<Void>(mu, [&] { real(this, mu); return Void{}; });
}

bool CondVar::WaitWithTimeout(Mutex* mu, absl::Duration timeout) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, absl::Duration)>(
      "_ZN4absl7debian37CondVar15WaitWithTimeoutEPNS0_5MutexENS0_8DurationE");
  return ReleaseAndReacquire<bool>(mu, [&] { return real(this, mu, timeout); });
}

bool CondVar::WaitWithDeadline(Mutex* mu, absl::Time deadline) {
  static const auto real = Real<bool (*)(CondVar*, Mutex*, absl::Time)>(
      "_ZN4absl7debian37CondVar16WaitWithDeadlineEPNS0_5MutexENS0_4TimeE");
  return ReleaseAndReacquire<bool>(mu, [&] { return real(this, mu, deadline); });
}

// ---- Notification ---------------------------------------------------------------------------
// Notify and WaitForNotification hand off through mutex_ (interposed above) except on the
// fast paths, which read or write notified_yet_ inside the library: release and acquire it.

void Notification::Notify() {
  static const auto real =
      Real<void (*)(Notification*)>("_ZN4absl7debian312Notification6NotifyEv");
  if (Enabled()) __tsan_release(NotifiedYet(this));
  real(this);
}

void Notification::WaitForNotification() const {
  static const auto real = Real<void (*)(const Notification*)>(
      "_ZNK4absl7debian312Notification19WaitForNotificationEv");
  real(this);
  if (Enabled()) __tsan_acquire(NotifiedYet(this));
}

bool Notification::WaitForNotificationWithTimeout(absl::Duration timeout) const {
  static const auto real = Real<bool (*)(const Notification*, absl::Duration)>(
      "_ZNK4absl7debian312Notification30WaitForNotificationWithTimeoutENS0_8DurationE");
  const bool notified = real(this, timeout);
  if (notified && Enabled()) __tsan_acquire(NotifiedYet(this));
  return notified;
}

bool Notification::WaitForNotificationWithDeadline(absl::Time deadline) const {
  static const auto real = Real<bool (*)(const Notification*, absl::Time)>(
      "_ZNK4absl7debian312Notification31WaitForNotificationWithDeadlineENS0_4TimeE");
  const bool notified = real(this, deadline);
  if (notified && Enabled()) __tsan_acquire(NotifiedYet(this));
  return notified;
}

// ---- BlockingCounter ------------------------------------------------------------------------
// DecrementCount only takes the mutex for the last decrement; the others are an atomic
// fetch_sub inside the library. Each decrement releases the counter; Wait acquires it.

bool BlockingCounter::DecrementCount() {
  static const auto real =
      Real<bool (*)(BlockingCounter*)>("_ZN4absl7debian315BlockingCounter14DecrementCountEv");
  if (Enabled()) __tsan_release(this);
  return real(this);
}

void BlockingCounter::Wait() {
  static const auto real =
      Real<void (*)(BlockingCounter*)>("_ZN4absl7debian315BlockingCounter4WaitEv");
  real(this);
  if (Enabled()) __tsan_acquire(this);
}

ABSL_NAMESPACE_END
}  // namespace absl

// ---- TSan's defaults for every binary of the build ------------------------------------------

extern "C" const char* __tsan_default_options() {
  // halt_on_error + exitcode: the first race ends the process with 66, so a race in a spawned
  // server or worker fails its test. second_deadlock_stack: lock-order reports show both stacks.
  // ignore_noninstrumented_modules (the default on macOS, for the same reason): the memory
  // accesses that TSan's interceptors (memcpy, free, sendmsg, malloc's "write", ...) would
  // record for calls made from Debian's uninstrumented libraries are ignored; their
  // synchronization (pthread, and absl through the wrappers above) still counts. Those
  // libraries' own plain loads and stores are invisible to TSan anyway, so without this flag
  // every hand-off inside gRPC, RocksDB and Abseil's status code (through their own atomics)
  // is reported as a race on their buffers (docs/thread_safety.md lists what was reported).
  // Every access compiled from Rebound's code is still checked.
  return "halt_on_error=1:exitcode=66:second_deadlock_stack=1:history_size=4:"
         "ignore_noninstrumented_modules=1";
}

extern "C" const char* __tsan_default_suppressions() {
#include "tools/tsan/suppressions.inc"
}
