#pragma once

// Small process-level helpers shared by the daemons' main() functions.

#include <string>

#include "absl/status/status.h"

namespace rebound {

// Installs handlers for SIGTERM and SIGINT that hand the signal to WaitForTerminationSignal()
// through a pipe. Call first in main. Handlers, unlike a blocked signal mask, also work when a
// library started threads of its own before main (OpenBLAS does), which would otherwise receive
// the signal and die of it.
void InstallTerminationHandlers();

// Waits until SIGTERM or SIGINT arrives and returns its number. REQUIRES: the handlers above.
int WaitForTerminationSignal();

// Wakes WaitForTerminationSignal() with `code` from any thread, as if a signal had arrived:
// how a daemon's own threads ask the main thread to stop or change course. Use codes above 64
// (no signal number) to tell them from signals. REQUIRES: InstallTerminationHandlers().
void NotifyMainThread(int code);

// Blocks SIGTERM and SIGINT in the calling thread, for programs that receive them with
// sigtimedwait() and start every thread themselves (the launcher). Call first in main.
void BlockTerminationSignals();

// Writes `content` to `path` atomically (temp file + rename), so a reader never sees half of it.
absl::Status WriteFileAtomically(const std::string& path, const std::string& content);

// Why a TCP listener on `host_port` ("host:port", "[v6]:port") cannot be opened, for the log
// line of a daemon whose gRPC server did not start (gRPC itself only says that it failed):
// binds a socket there as gRPC does (SO_REUSEADDR, no SO_REUSEPORT) and returns "address in
// use", the system's error text, or "the address does not resolve"; if the bind succeeds now,
// says so.
std::string WhyCannotListen(const std::string& host_port);

// Initialises glog to log to stderr, as daemons under a supervisor should.
void InitLogging(const char* argv0);

// For processes that allocate and free buffers of a model shard's size (tens of MiB) per
// request, as the server does per sync: keep such buffers in the heap instead of mmap-ing (and
// page-faulting in) fresh zeroed memory each time, and do not return freed memory to the
// system below 256 MiB; and use at most kMaxMallocArenas malloc arenas (unless MALLOC_ARENA_MAX
// is set), so that the memory kept does not multiply with the threads. Call first thing in
// main(). Only glibc's malloc reads these settings: in a binary linked with tcmalloc (the
// server) they change nothing, and tcmalloc's own page heap keeps and returns memory.
void TuneAllocatorForLargeBuffers();
inline constexpr int kMaxMallocArenas = 4;

// tcmalloc upkeep for a long-running server: returns the free memory tcmalloc's page heap holds
// beyond `keep_bytes` to the system, and returns how many bytes that was (0 under glibc malloc,
// which trims by itself). tcmalloc hands freed pages back only a little at each later free, so
// an idle server would otherwise keep a burst's worth for good (four concurrent 200 MiB
// requests: 886 MB resident after they were refused). Call it every few seconds.
size_t ReleaseFreeHeapAbove(size_t keep_bytes);

}  // namespace rebound
