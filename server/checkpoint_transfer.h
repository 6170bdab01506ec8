#pragma once

// A store's checkpoint sent over gRPC as a stream of CheckpointChunks, and received into a
// directory: what a standby catches up from (ServerPeer.FetchCheckpoint, docs/design.md §10.1) and
// what an online backup is made of (ParameterServer.Backup, docs/operations.md#backup-and-restore).
//
// The stream: every file of the checkpoint as a run of chunks of one `path` (relative to the
// checkpoint's directory, never absolute, never with ".." or "."), offsets increasing from 0,
// the file's last chunk marked `last_chunk`; then one message with `done`, the position the
// checkpoint holds (epoch, sequence) and the number of files.
//
// Thread-safety: stateless functions; the caller serializes uses of one `dir`.
// Status codes: SendCheckpoint: the store's Checkpoint errors (FAILED_PRECONDITION for a store in
// memory), UNAVAILABLE for a file it cannot read, CANCELLED when the receiver left.
// ReceiveCheckpoint: DATA_LOSS for a malformed stream (a bad path, a gap, a missing end mark or a
// file count that disagrees), UNAVAILABLE / RESOURCE_EXHAUSTED for a file it cannot write, the
// call's own status when it failed.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/support/sync_stream.h"
#include "proto/rebound.pb.h"
#include "storage/durable_store.h"

namespace rebound::server {

// Makes a checkpoint of `store` in `dir` (which must not exist; removed again at the end, sent
// or not) and writes its files to `writer`. `what` prefixes errors and the log line (e.g.
// "FetchCheckpoint for standby 'b'"). On OK, *position (if not null) is the checkpoint's.
// `max_bytes_per_second` > 0 paces the chunks so that the bytes sent never run ahead of that
// rate (the waits end early when the receiver leaves).
grpc::Status SendCheckpoint(const storage::DurableStore& store, const std::string& dir,
                            grpc::ServerContext* context,
                            grpc::ServerWriterInterface<CheckpointChunk>* writer,
                            absl::string_view what,
                            storage::DurableStore::Position* position = nullptr,
                            int64_t max_bytes_per_second = 0);

// Reads the stream of `reader` (whose call `context` is cancelled on a malformed stream) into
// `dir`, which must exist and be empty, and finishes the call. Returns the stream's `done`
// message. `from` names the sender in errors. The files are flushed (sync) before it returns.
absl::StatusOr<CheckpointChunk> ReceiveCheckpoint(grpc::ClientReaderInterface<CheckpointChunk>* reader,
                                                  grpc::ClientContext* context,
                                                  const std::string& dir, absl::string_view from);

}  // namespace rebound::server
