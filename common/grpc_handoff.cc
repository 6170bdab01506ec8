#include "common/grpc_handoff.h"

#if defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define REBOUND_TSAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define REBOUND_TSAN 1
#endif

#ifdef REBOUND_TSAN
#include <sanitizer/tsan_interface.h>
#endif

namespace rebound {
namespace {

#ifdef REBOUND_TSAN
// The address TSan's release and acquire name; never read or written.
char handoff_token;
#endif

}  // namespace

void MarkHandOffToGrpc() {
#ifdef REBOUND_TSAN
  __tsan_release(&handoff_token);
#endif
}

void MarkTakenFromGrpc() {
#ifdef REBOUND_TSAN
  __tsan_acquire(&handoff_token);
#endif
}

}  // namespace rebound
