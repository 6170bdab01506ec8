// Runs the real rebound_train binary on a slice of Fashion-MNIST.

#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "testing/cluster/processes.h"

namespace rebound::testing {
namespace {

// The test accuracy (percent) printed on the line of `epoch`, or -1.
double AccuracyOfEpoch(const std::string& output, int epoch) {
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    int e = 0;
    double train_loss = 0, test_loss = 0, accuracy = -1;
    if (std::sscanf(std::string(line).c_str(),
                    "epoch %d train_loss %lf test_loss %lf test_accuracy %lf%%", &e, &train_loss,
                    &test_loss, &accuracy) == 4 &&
        e == epoch) {
      return accuracy;
    }
  }
  return -1;
}

TEST_CASE("rebound_train learns Fashion-MNIST well above chance in two epochs") {
  const std::string dir = MakeTempDir("train");
  const std::string config = dir + "/train.pbtxt";
  WriteFileOrDie(config,
                 "model {\n"
                 "  layers { width: 64 activation: RELU }\n"
                 "  layers { width: 10 activation: IDENTITY }\n"
                 "}\n"
                 "data { batch_size: 32 micro_batches: 4 train_limit: 4000 test_limit: 1000 }\n"
                 "adahessian { lr: 0.01 }\n");
  std::string output;
  const int code = RunCommand({Runfile("worker/rebound_train"), "--config", config, "--epochs", "2"},
                              &output, absl::Seconds(240));
  INFO(output);
  REQUIRE(code == 0);
  const double first = AccuracyOfEpoch(output, 1);
  const double second = AccuracyOfEpoch(output, 2);
  // Ten classes: chance is 10%. A working optimizer reaches well over 70% on this slice.
  CHECK(first > 60.0);
  CHECK(second > 70.0);
}

TEST_CASE("rebound_train names the missing data set file and exits 1") {
  const std::string dir = MakeTempDir("train-missing");
  const std::string config = dir + "/train.pbtxt";
  WriteFileOrDie(config,
                 "model { layers { width: 10 activation: IDENTITY } }\n"
                 "data { dataset_dir: \"/nonexistent/fmnist\" }\n");
  std::string output;
  const int code = RunCommand({Runfile("worker/rebound_train"), "--config", config}, &output,
                              absl::Seconds(60));
  CHECK(code == 1);
  CHECK(output.find("/nonexistent/fmnist/train-images-idx3-ubyte.gz") != std::string::npos);
}

TEST_CASE("rebound_train rejects a bad config with file, line and field, exit 2") {
  const std::string dir = MakeTempDir("train-bad");
  const std::string config = dir + "/train.pbtxt";
  WriteFileOrDie(config, "model { layers { width: 10 activation: IDENTITY } }\nadahessian { lr: 0 }\n");
  std::string output;
  const int code = RunCommand({Runfile("worker/rebound_train"), "--config", config}, &output,
                              absl::Seconds(60));
  CHECK(code == 2);
  CHECK(output.find(config + ":2: adahessian.lr must be > 0, got 0") != std::string::npos);
}

}  // namespace
}  // namespace rebound::testing
