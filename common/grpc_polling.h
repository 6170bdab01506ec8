#pragma once

// How often gRPC's backup poller drives connections that no call is waiting on.
//
// gRPC's synchronous client API reads a connection's sockets only from a thread blocked in a
// call on it, or from the process's backup poller, which runs every
// GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS (default 5000 ms). A fail-fast call on a channel
// that is still connecting fails at once without waiting, so nobody reads the server's half of
// the HTTP/2 handshake until the poller comes: a reconnect took up to 5 s. Seen as a sharded
// job's groups answering 5 s after they listened, a server taking 5 s to stop (its own calls to
// the range groups), and the test harness waiting 5 s for every (re)started group. With a short
// interval the handshake completes within it.
//
// Call first thing in main(), before any gRPC object exists (gRPC reads the variable once, at
// its initialisation). A value already in the environment is kept: an operator's choice wins.

namespace rebound {

// Interval set when the environment has none: short enough that a reconnect costs no more than
// a retry's backoff, long enough to cost nothing measurable (one empty poll per interval).
inline constexpr int kGrpcBackupPollIntervalMs = 50;

void ShortenGrpcBackupPolling();

}  // namespace rebound
