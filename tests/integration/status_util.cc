#include "tests/integration/status_util.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace rebound::testing {

bool AllFinished(const GetStatusResponse& s) {
  for (const SlotStatus& slot : s.slots()) {
    if (slot.state() != FINISHED) return false;
  }
  return s.slots_size() > 0;
}

const WorkerStatus* FindWorker(const GetStatusResponse& s, const std::string& name,
                               WorkerRole role) {
  const WorkerStatus* found = nullptr;
  for (const WorkerStatus& w : s.workers()) {
    if (w.name() == name && w.role() == role) found = &w;  // incarnations ascend
  }
  return found;
}

const WorkerStatus* FindIncarnation(const GetStatusResponse& s, uint64_t incarnation) {
  for (const WorkerStatus& w : s.workers()) {
    if (w.incarnation() == incarnation) return &w;
  }
  return nullptr;
}

bool SameBytes(const TensorBundle& a, const TensorBundle& b) {
  if (a.tensors_size() != b.tensors_size()) return false;
  for (int i = 0; i < a.tensors_size(); ++i) {
    if (a.tensors(i).data() != b.tensors(i).data()) return false;
  }
  return true;
}

TensorBundle Mapped(TensorBundle bundle, const std::function<float(size_t, float)>& f) {
  for (Tensor& tensor : *bundle.mutable_tensors()) {
    char* data = tensor.mutable_data()->data();
    for (size_t i = 0; i < tensor.data().size() / sizeof(float); ++i) {
      float value;
      std::memcpy(&value, data + i * sizeof(float), sizeof(float));
      value = f(i, value);
      std::memcpy(data + i * sizeof(float), &value, sizeof(float));
    }
  }
  return bundle;
}

TensorBundle Shifted(TensorBundle bundle, float delta) {
  return Mapped(std::move(bundle), [delta](size_t, float v) { return v + delta; });
}

void CheckStatus(const grpc::Status& status, grpc::StatusCode code, const std::string& part) {
  INFO("got code " << status.error_code() << ": " << status.error_message());
  CHECK(status.error_code() == code);
  CHECK_THAT(status.error_message(), Catch::Contains(part));
}

}  // namespace rebound::testing
