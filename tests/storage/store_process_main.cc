// A second process for the DurableStore tests.
//
//   store_process open DATA_DIR
//     Opens the store and reports: prints "OK version=V" (as below) and exits 0, or prints the
//     status code name and message and exits 1 (the cross-process lock test). The store's log
//     goes to stderr.
//   store_process commit_forever DATA_DIR
//     Commits batches i = 1, 2, ... until killed. Batch i puts the centers of stages 0 and 1 at
//     version i (64 KiB of parameters each) and the weight of slot (0, 0) with
//     center_version_at_last_sync = i; after each acknowledged Commit it prints "committed i"
//     (the crash test kills it with SIGKILL mid-stream).
//   store_process commit_weights_forever DATA_DIR
//     As commit_forever with batches of the weight record only (no tensor files).
//   store_process commit_large_weights_forever DATA_DIR
//     As commit_weights_forever with a step-log record of slot (0, 0) at step i in each batch,
//     about 70 KiB: each batch's WAL record is split into at least three fragments (FIRST,
//     MIDDLE..., LAST) across 32 KiB blocks.
//   store_process open_accepting_wal_loss DATA_DIR
//     As `open` with accept_wal_loss (the server's --accept_wal_loss); on success prints
//     "OK version=V" with V the center_version_at_last_sync of slot (0, 0)'s weight record (0
//     if none). The store's log goes to stderr.

#include <iostream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "storage/durable_store.h"

namespace {

rebound::CenterRecord Center(int32_t stage, int64_t version) {
  rebound::CenterRecord record;
  record.set_stage(stage);
  record.set_version(version);
  rebound::Tensor* tensor = record.mutable_params()->add_tensors();
  tensor->set_dtype(rebound::FLOAT32);
  tensor->add_shape(16384);
  tensor->set_data(std::string(16384 * 4, static_cast<char>(version)));
  return record;
}

enum class Batches { kCentersAndWeight, kWeight, kLargeLogRecordAndWeight };

int CommitForever(rebound::storage::DurableStore& store, Batches batches) {
  for (int64_t i = 1;; ++i) {
    rebound::storage::WriteBatch batch;
    if (batches == Batches::kCentersAndWeight) {
      batch.PutCenter(Center(0, i));
      batch.PutCenter(Center(1, i));
    }
    if (batches == Batches::kLargeLogRecordAndWeight) {
      rebound::LogRecord record;
      record.mutable_slot()->set_replica(0);
      record.mutable_slot()->set_stage(0);
      record.set_step(i);
      record.set_micro_batch(0);
      // 10000 ids of 6-byte varints plus a tag byte each: 70 KiB, over two blocks.
      for (int64_t id = 0; id < 10000; ++id) record.add_sample_ids((int64_t{1} << 40) + id);
      batch.PutLogRecord(record);
    }
    rebound::WeightRecord weight;
    weight.mutable_slot()->set_replica(0);
    weight.mutable_slot()->set_stage(0);
    weight.set_center_version_at_last_sync(i);
    batch.PutWeight(weight);
    const absl::Status status = store.Commit(batch);
    if (!status.ok()) {
      std::cout << status.ToString() << std::endl;
      return 1;
    }
    std::cout << "committed " << i << std::endl;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[1] : "";
  const bool accepting = mode == "open_accepting_wal_loss";
  if (mode != "open" && mode != "commit_forever" && mode != "commit_weights_forever" &&
      mode != "commit_large_weights_forever" && !accepting) {
    std::cerr << "usage: store_process open|commit_forever|commit_weights_forever|"
                 "commit_large_weights_forever|open_accepting_wal_loss DATA_DIR\n";
    return 64;
  }
  rebound::storage::DurableStoreOptions options;
  options.data_dir = argv[2];
  options.accept_wal_loss = accepting;
  absl::StatusOr<std::unique_ptr<rebound::storage::DurableStore>> store =
      rebound::storage::DurableStore::Open(options);
  if (!store.ok()) {
    std::cout << absl::StatusCodeToString(store.status().code()) << ": " << store.status().message()
              << std::endl;
    return 1;
  }
  if (mode == "commit_forever") return CommitForever(**store, Batches::kCentersAndWeight);
  if (mode == "commit_weights_forever") return CommitForever(**store, Batches::kWeight);
  if (mode == "commit_large_weights_forever") {
    return CommitForever(**store, Batches::kLargeLogRecordAndWeight);
  }
  absl::StatusOr<rebound::storage::LoadedState> state = (*store)->LoadAll();
  if (!state.ok()) {
    std::cout << state.status().ToString() << std::endl;
    return 1;
  }
  const auto weight = state->weights.find({0, 0});
  std::cout << "OK version="
            << (weight == state->weights.end() ? 0 : weight->second.center_version_at_last_sync())
            << std::endl;
  return 0;
}
