#include "worker/data/idx_reader.h"

#include <array>
#include <cstring>
#include <string>

#include <catch2/catch.hpp>

#include "tests/worker/test_files.h"

namespace rebound::worker {
namespace {

using ::Catch::Matchers::Contains;
using testing::Gzip;
using testing::IdxBytes;
using testing::kDebianFashionMnistDir;
using testing::PatternBytes;
using testing::TempPath;
using testing::WriteFile;

std::string DebianFile(const std::string& name) {
  return std::string(kDebianFashionMnistDir) + "/" + name;
}

// A valid gzip'ed image file of 3 images of 2 x 4 pixels, and its raw IDX bytes.
std::string SmallImagesIdx() { return IdxBytes(kIdxImagesMagic, {3, 2, 4}, PatternBytes(24, 256)); }

// Checks that reading `path` as images fails with `code` and a message naming `path` and
// containing `what`.
void CheckImagesError(const std::string& path, absl::StatusCode code, const std::string& what) {
  const absl::StatusOr<IdxImages> images = ReadIdxImages(path);
  REQUIRE_FALSE(images.ok());
  INFO(images.status());
  CHECK(images.status().code() == code);
  CHECK_THAT(std::string(images.status().message()), Contains(path) && Contains(what));
}

void CheckLabelsError(const std::string& path, absl::StatusCode code, const std::string& what) {
  const absl::StatusOr<std::vector<uint8_t>> labels = ReadIdxLabels(path, 10);
  REQUIRE_FALSE(labels.ok());
  INFO(labels.status());
  CHECK(labels.status().code() == code);
  CHECK_THAT(std::string(labels.status().message()), Contains(path) && Contains(what));
}

TEST_CASE("the Debian training images decode to 60000 images of 28 x 28 with the file's bytes") {
  const std::string path = DebianFile("train-images-idx3-ubyte.gz");
  const absl::StatusOr<IdxImages> images = ReadIdxImages(path);
  REQUIRE(images.ok());
  CHECK(images->count == 60000);
  CHECK(images->rows == 28);
  CHECK(images->cols == 28);
  REQUIRE(images->pixels.size() == 60000u * 28 * 28);

  const std::string raw = testing::GunzipFile(path);
  REQUIRE(raw.size() == 16 + images->pixels.size());
  CHECK(raw.compare(0, 16, IdxBytes(0x803, {60000, 28, 28}, "")) == 0);
  CHECK(std::memcmp(raw.data() + 16, images->pixels.data(), images->pixels.size()) == 0);
}

TEST_CASE("the Debian training labels are 6000 of each of the 10 classes, starting 9 0 0 3") {
  const absl::StatusOr<std::vector<uint8_t>> labels =
      ReadIdxLabels(DebianFile("train-labels-idx1-ubyte.gz"), 10);
  REQUIRE(labels.ok());
  REQUIRE(labels->size() == 60000);
  const std::vector<uint8_t> first(labels->begin(), labels->begin() + 10);
  CHECK(first == std::vector<uint8_t>{9, 0, 0, 3, 0, 2, 7, 2, 5, 5});
  std::array<int, 10> histogram{};
  for (uint8_t label : *labels) ++histogram[label];
  for (int c = 0; c < 10; ++c) {
    INFO("class " << c);
    CHECK(histogram[c] == 6000);
  }
}

TEST_CASE("the Debian test split has 10000 images and labels, 1000 per class, starting 9 2 1 1") {
  const absl::StatusOr<IdxImages> images = ReadIdxImages(DebianFile("t10k-images-idx3-ubyte.gz"));
  REQUIRE(images.ok());
  CHECK(images->count == 10000);
  CHECK(images->rows == 28);
  CHECK(images->cols == 28);

  const std::string labels_path = DebianFile("t10k-labels-idx1-ubyte.gz");
  const absl::StatusOr<std::vector<uint8_t>> labels = ReadIdxLabels(labels_path, 10);
  REQUIRE(labels.ok());
  REQUIRE(labels->size() == 10000);
  const std::vector<uint8_t> first(labels->begin(), labels->begin() + 10);
  CHECK(first == std::vector<uint8_t>{9, 2, 1, 1, 6, 1, 4, 6, 5, 7});
  std::array<int, 10> histogram{};
  for (uint8_t label : *labels) ++histogram[label];
  for (int c = 0; c < 10; ++c) CHECK(histogram[c] == 1000);
  const std::string raw = testing::GunzipFile(labels_path);
  CHECK(std::memcmp(raw.data() + 8, labels->data(), labels->size()) == 0);
}

TEST_CASE("a small valid file round-trips its shape and pixels") {
  const std::string idx = SmallImagesIdx();
  const std::string path = TempPath("small-images.gz");
  WriteFile(path, Gzip(idx));
  const absl::StatusOr<IdxImages> images = ReadIdxImages(path);
  REQUIRE(images.ok());
  CHECK(images->count == 3);
  CHECK(images->rows == 2);
  CHECK(images->cols == 4);
  CHECK(std::string(images->pixels.begin(), images->pixels.end()) == idx.substr(16));
}

TEST_CASE("a file of several concatenated gzip members reads as their concatenation") {
  const std::string idx = SmallImagesIdx();
  const std::string path = TempPath("two-members.gz");
  WriteFile(path, Gzip(idx.substr(0, 10)) + Gzip(idx.substr(10)));
  const absl::StatusOr<IdxImages> images = ReadIdxImages(path);
  REQUIRE(images.ok());
  CHECK(std::string(images->pixels.begin(), images->pixels.end()) == idx.substr(16));
}

TEST_CASE("a missing file is NOT_FOUND and names the path") {
  CheckImagesError(TempPath("no-such-images.gz"), absl::StatusCode::kNotFound, "cannot open");
  CheckLabelsError(TempPath("no-such-labels.gz"), absl::StatusCode::kNotFound, "cannot open");
}

TEST_CASE("a truncated copy of the Debian labels file is DATA_LOSS") {
  const std::string gz = testing::ReadFile(DebianFile("train-labels-idx1-ubyte.gz"));
  const std::string half = TempPath("labels-half.gz");
  WriteFile(half, gz.substr(0, gz.size() / 2));
  CheckLabelsError(half, absl::StatusCode::kDataLoss, "truncated gzip stream");

  // Only the gzip trailer (CRC-32 and length) is cut short: the data itself is complete.
  const std::string no_trailer = TempPath("labels-no-trailer.gz");
  WriteFile(no_trailer, gz.substr(0, gz.size() - 3));
  CheckLabelsError(no_trailer, absl::StatusCode::kDataLoss, "truncated gzip stream");
}

TEST_CASE("an empty file is DATA_LOSS") {
  const std::string path = TempPath("empty.gz");
  WriteFile(path, "");
  CheckImagesError(path, absl::StatusCode::kDataLoss, "truncated gzip stream");
}

TEST_CASE("corrupt deflate data is DATA_LOSS") {
  std::string gz = Gzip(IdxBytes(kIdxImagesMagic, {50, 28, 28}, PatternBytes(50 * 784, 251)));
  REQUIRE(gz.size() > 100);
  for (size_t i = 20; i < gz.size() - 20; ++i) gz[i] = static_cast<char>(gz[i] ^ 0x5a);
  const std::string path = TempPath("corrupt.gz");
  WriteFile(path, gz);
  CheckImagesError(path, absl::StatusCode::kDataLoss, "corrupt gzip data");
}

TEST_CASE("a gzip member whose CRC does not match its data is DATA_LOSS") {
  std::string gz = Gzip(SmallImagesIdx());
  gz[gz.size() - 8] = static_cast<char>(gz[gz.size() - 8] ^ 0x01);
  const std::string path = TempPath("bad-crc.gz");
  WriteFile(path, gz);
  CheckImagesError(path, absl::StatusCode::kDataLoss, "incorrect data check");
}

TEST_CASE("an uncompressed IDX file is DATA_LOSS: the reader takes gzip only") {
  const std::string path = TempPath("plain.idx");
  WriteFile(path, SmallImagesIdx());
  CheckImagesError(path, absl::StatusCode::kDataLoss, "corrupt gzip data");
}

TEST_CASE("garbage after the last gzip member is DATA_LOSS") {
  const std::string path = TempPath("trailing-garbage.gz");
  WriteFile(path, Gzip(SmallImagesIdx()) + "garbage!");
  CheckImagesError(path, absl::StatusCode::kDataLoss, "trailing garbage");
}

TEST_CASE("a wrong magic is INVALID_ARGUMENT") {
  const std::string labels_path = TempPath("labels-as-images.gz");
  WriteFile(labels_path, Gzip(IdxBytes(kIdxLabelsMagic, {3}, PatternBytes(3, 10))));
  CheckImagesError(labels_path, absl::StatusCode::kInvalidArgument, "wrong IDX magic 0x00000801");

  const std::string images_path = TempPath("images-as-labels.gz");
  WriteFile(images_path, Gzip(SmallImagesIdx()));
  CheckLabelsError(images_path, absl::StatusCode::kInvalidArgument, "wrong IDX magic 0x00000803");

  const std::string float_path = TempPath("float-images.gz");
  WriteFile(float_path, Gzip(IdxBytes(0x00000d03, {1, 1, 1}, std::string(4, '\0'))));
  CheckImagesError(float_path, absl::StatusCode::kInvalidArgument, "wrong IDX magic 0x00000d03");
}

TEST_CASE("a decompressed payload shorter than its header promises is DATA_LOSS") {
  const std::string path = TempPath("short-payload.gz");
  WriteFile(path, Gzip(IdxBytes(kIdxImagesMagic, {3, 2, 4}, PatternBytes(23, 256))));
  CheckImagesError(path, absl::StatusCode::kDataLoss, "truncated IDX payload: 23 bytes");

  const std::string labels = TempPath("short-labels.gz");
  WriteFile(labels, Gzip(IdxBytes(kIdxLabelsMagic, {5}, PatternBytes(4, 10))));
  CheckLabelsError(labels, absl::StatusCode::kDataLoss, "truncated IDX payload: 4 bytes");
}

TEST_CASE("a header cut short is DATA_LOSS") {
  const std::string path = TempPath("short-header.gz");
  WriteFile(path, Gzip(SmallImagesIdx().substr(0, 10)));
  CheckImagesError(path, absl::StatusCode::kDataLoss, "truncated IDX header");

  const std::string tiny = TempPath("tiny.gz");
  WriteFile(tiny, Gzip(std::string(2, '\0')));
  CheckImagesError(tiny, absl::StatusCode::kDataLoss, "truncated IDX header");
}

TEST_CASE("bytes after the IDX payload are DATA_LOSS") {
  const std::string path = TempPath("long-payload.gz");
  WriteFile(path, Gzip(SmallImagesIdx() + "xy"));
  CheckImagesError(path, absl::StatusCode::kDataLoss, "2 trailing bytes");
}

TEST_CASE("zero-sized image dimensions are INVALID_ARGUMENT") {
  const std::string path = TempPath("zero-rows.gz");
  WriteFile(path, Gzip(IdxBytes(kIdxImagesMagic, {3, 0, 4}, "")));
  CheckImagesError(path, absl::StatusCode::kInvalidArgument, "unsupported IDX image shape");
}

TEST_CASE("a huge declared shape is rejected without allocating it") {
  const std::string path = TempPath("huge.gz");
  WriteFile(path, Gzip(IdxBytes(kIdxImagesMagic, {0xffffffffu, 0xffffffffu, 0xffffffffu}, "")));
  CheckImagesError(path, absl::StatusCode::kInvalidArgument, "unsupported IDX image shape");

  const std::string big = TempPath("big.gz");
  WriteFile(big, Gzip(IdxBytes(kIdxImagesMagic, {0x7fffffffu, 64, 64}, PatternBytes(64, 256))));
  CheckImagesError(big, absl::StatusCode::kDataLoss, "truncated IDX payload: 64 bytes");
}

TEST_CASE("a label outside [0, num_classes) is INVALID_ARGUMENT and names the sample") {
  std::string payload = PatternBytes(6, 10);
  payload[4] = 10;
  const std::string path = TempPath("bad-label.gz");
  WriteFile(path, Gzip(IdxBytes(kIdxLabelsMagic, {6}, payload)));
  CheckLabelsError(path, absl::StatusCode::kInvalidArgument, "label 10 of sample 4");

  const absl::StatusOr<std::vector<uint8_t>> wide = ReadIdxLabels(path, 11);
  REQUIRE(wide.ok());
  CHECK((*wide)[4] == 10);
  CHECK(ReadIdxLabels(path, 0).status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(ReadIdxLabels(path, 257).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a directory in place of the file is an error naming it, not a crash") {
  const std::string dir = std::string(kDebianFashionMnistDir);
  const absl::StatusOr<IdxImages> images = ReadIdxImages(dir);
  REQUIRE_FALSE(images.ok());
  CHECK_THAT(std::string(images.status().message()), Contains(dir));
}

}  // namespace
}  // namespace rebound::worker
