#include "common/process.h"

#include <glog/logging.h>
#include <fcntl.h>
#include <malloc.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include <cstdio>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"

// gperftools' C API, present when tcmalloc is linked (the server); weak, so that binaries on
// glibc's malloc link without it.
extern "C" int MallocExtension_GetNumericProperty(const char* property, size_t* value)
    __attribute__((weak));
extern "C" void MallocExtension_ReleaseToSystem(size_t num_bytes) __attribute__((weak));

namespace rebound {

namespace {

int termination_pipe[2] = {-1, -1};

void OnTerminationSignal(int signal_number) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(signal_number);
  if (write(termination_pipe[1], &byte, 1) < 0) {
    // Nothing safe to do inside a signal handler; the pipe only fills after 64 KiB of signals.
  }
  errno = saved_errno;
}

}  // namespace

void InstallTerminationHandlers() {
  if (pipe2(termination_pipe, O_CLOEXEC) != 0) {
    PLOG(FATAL) << "pipe2";
  }
  struct sigaction action = {};
  action.sa_handler = OnTerminationSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

void NotifyMainThread(int code) { OnTerminationSignal(code); }

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int WaitForTerminationSignal() {
  // poll() with a timeout, not a blocking read(): ThreadSanitizer runs a signal handler at once
  // only when the thread is in a call it knows to block (poll is one, read is not) and otherwise
  // when the thread next returns from an intercepted call; a thread asleep in read() would never
  // see its own SIGTERM (tests/common/process_test).
  pollfd readable = {termination_pipe[0], POLLIN, 0};
  unsigned char byte = 0;
  while (true) {
    const int ready = poll(&readable, 1, /*timeout_ms=*/1000);
    if (ready < 0 && errno != EINTR) PLOG(FATAL) << "polling the termination pipe";
    if (ready <= 0) continue;
    const ssize_t n = read(termination_pipe[0], &byte, 1);
    if (n == 1) return byte;
    if (n < 0 && errno == EINTR) continue;
    PLOG(FATAL) << "reading the termination pipe";
  }
}

absl::Status WriteFileAtomically(const std::string& path, const std::string& content) {
  const std::string temp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out << content;
    out.flush();
    if (!out.good()) {
      return absl::UnavailableError(absl::StrCat("cannot write ", temp));
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::remove(temp.c_str());
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path));
  }
  return absl::OkStatus();
}

std::string WhyCannotListen(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  if (colon == std::string::npos) return "the address has no port";
  std::string host = host_port.substr(0, colon);
  const std::string port = host_port.substr(colon + 1);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* found = nullptr;
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &found) != 0 ||
      found == nullptr) {
    return "the address does not resolve";
  }
  std::string reason;
  for (struct addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      reason = std::strerror(errno);
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    const int bound = bind(fd, a->ai_addr, a->ai_addrlen);
    const int error = errno;
    close(fd);
    if (bound == 0) {
      reason = "gRPC could not bind it, though a plain bind succeeds now";
      break;
    }
    reason = error == EADDRINUSE ? "address in use" : std::strerror(error);
  }
  freeaddrinfo(found);
  return reason;
}

size_t ReleaseFreeHeapAbove(size_t keep_bytes) {
  if (MallocExtension_GetNumericProperty == nullptr || MallocExtension_ReleaseToSystem == nullptr) {
    return 0;
  }
  size_t free_bytes = 0;
  if (!MallocExtension_GetNumericProperty("tcmalloc.pageheap_free_bytes", &free_bytes) ||
      free_bytes <= keep_bytes) {
    return 0;
  }
  MallocExtension_ReleaseToSystem(free_bytes - keep_bytes);
  size_t left = free_bytes;
  MallocExtension_GetNumericProperty("tcmalloc.pageheap_free_bytes", &left);
  return free_bytes > left ? free_bytes - left : 0;
}

void InitLogging(const char* argv0) {
  FLAGS_logtostderr = true;
  FLAGS_colorlogtostderr = false;
  google::InitGoogleLogging(argv0);
}

void TuneAllocatorForLargeBuffers() {
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 256 << 20);
  // glibc gives each thread that allocates concurrently an arena of its own, up to 8 per core,
  // and each keeps the large buffers it has freed: over a long run every gRPC thread's arena
  // grew to a few syncs' worth (//bench:soak: server RSS 70 -> 680 MiB in 8 minutes on 2
  // cores, and more arenas on more cores). A few arenas serve the server's handful of
  // concurrent large requests as well. MALLOC_ARENA_MAX in the environment still decides.
  if (std::getenv("MALLOC_ARENA_MAX") == nullptr) mallopt(M_ARENA_MAX, kMaxMallocArenas);
}

}  // namespace rebound
