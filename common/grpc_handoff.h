#pragma once

// What ThreadSanitizer cannot see of gRPC's callback API, stated for it.
//
// gRPC hands a server and its calls between its own threads (the thread that starts a server or a
// batch, its executor, its callback threads) through its libraries, which Debian does not build
// with TSan: TSan sees no order between what Rebound wrote before handing something to gRPC and
// what Rebound's code then reads on a gRPC callback thread, and reports a race that is none. A
// replicated server starts a new gRPC server in each role it takes, and the callback API's
// threads may outlive the role before (docs/thread_safety.md#uninstrumented-libraries-what-tsan-ignores-and-suppressions).
//
// MarkHandOffToGrpc() is called after the writes a callback will read and before the call that
// hands them to gRPC (BuildAndStart, a reactor's Finish or StartWrite); MarkTakenFromGrpc() first
// in every callback gRPC's callback API runs in Rebound's code (an interceptor factory, a
// callback handler, a reactor's OnCancel/OnWriteDone/OnDone). Under TSan they release and acquire
// one synchronization object; otherwise they compile to nothing.
//
// Thread-safety: both may be called from any thread at any time.

namespace rebound {

void MarkHandOffToGrpc();
void MarkTakenFromGrpc();

}  // namespace rebound
