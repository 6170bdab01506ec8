#pragma once

// Loads Fashion-MNIST (Xiao, Rasul & Vollgraf 2017) from the four gzip'ed IDX files that Debian's
// dataset-fashion-mnist package installs in /usr/share/datasets/fashion-mnist:
//   train-images-idx3-ubyte.gz  train-labels-idx1-ubyte.gz   60000 samples
//   t10k-images-idx3-ubyte.gz   t10k-labels-idx1-ubyte.gz    10000 samples
// of 28 x 28 grey pixels and 10 classes.
//
// Normalisation: pixel p in 0..255 becomes, in float arithmetic,
//   (p / 255.0f - kFashionMnistMean) / kFashionMnistStd
// with the mean and standard deviation of the training pixels, so a feature is bit-identical on
// every machine (replay relies on it).
//
// Errors are those of worker/data/idx_reader.h (NOT_FOUND, DATA_LOSS, INVALID_ARGUMENT, each
// naming the file), plus INVALID_ARGUMENT for: image and label files with different counts, train
// and test images of different shapes, a limit < 0 or above the file's count.
//
// Thread-safety: LoadFashionMnist is stateless and may run on any thread. Ownership: the result
// owns its samples (the worker moves it between roles: worker/slot_compute.h DataSetCache).

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "worker/data/dataset.h"

namespace rebound::worker {

inline constexpr float kFashionMnistMean = 0.2860f;
inline constexpr float kFashionMnistStd = 0.3530f;
inline constexpr int kFashionMnistClasses = 10;

inline constexpr char kFashionMnistTrainImages[] = "train-images-idx3-ubyte.gz";
inline constexpr char kFashionMnistTrainLabels[] = "train-labels-idx1-ubyte.gz";
inline constexpr char kFashionMnistTestImages[] = "t10k-images-idx3-ubyte.gz";
inline constexpr char kFashionMnistTestLabels[] = "t10k-labels-idx1-ubyte.gz";

// The normalised value of pixel byte `pixel` (see the header comment).
float NormalizeFashionMnistPixel(uint8_t pixel);

// The pair of an images file and a labels file read into one data set: its first `limit`
// samples (0 = all), normalised as above, labels in [0, kFashionMnistClasses).
absl::StatusOr<Dataset> LoadIdxDataset(const std::string& images_path,
                                       const std::string& labels_path, int64_t limit);

struct FashionMnist {
  Dataset train;
  Dataset test;
};

// Loads both splits from config.dataset_dir(), honouring config.train_limit() and
// config.test_limit(). The other DataConfig fields are not used here.
absl::StatusOr<FashionMnist> LoadFashionMnist(const DataConfig& config);

}  // namespace rebound::worker
