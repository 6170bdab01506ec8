#pragma once

// What the fuzz targets share: the check of a property, and quiet logging.

#include <glog/logging.h>
#include <google/protobuf/stubs/logging.h>

#include <cstdio>
#include <cstdlib>

// A property every input must keep. Violated, it prints the condition and aborts, so libFuzzer
// saves the input as a crash and the corpus regression tests fail.
#define FUZZ_CHECK(condition)                                                             \
  do {                                                                                    \
    if (!(condition)) {                                                                   \
      std::fprintf(stderr, "%s:%d: fuzz property violated: %s\n", __FILE__, __LINE__, \
                   #condition);                                                           \
      std::abort();                                                                       \
    }                                                                                     \
  } while (false)

namespace rebound::fuzz {

// The product (and libprotobuf) logs every rejected request; at thousands of inputs a second that is noise. With
// REBOUND_FUZZ_LOG=1 (to read what a saved input does) the logs stay on, and the session targets
// print every call's status.
inline bool Verbose() {
  static const bool verbose = [] {
    const char* value = std::getenv("REBOUND_FUZZ_LOG");
    return value != nullptr && value[0] == '1';
  }();
  return verbose;
}

inline void QuietLogging() {
  if (!Verbose()) {
    FLAGS_minloglevel = google::GLOG_FATAL;
    // libprotobuf's own complaints, e.g. about a string field that is not UTF-8.
    google::protobuf::SetLogHandler(nullptr);
  }
  FLAGS_logtostderr = true;
}

}  // namespace rebound::fuzz
