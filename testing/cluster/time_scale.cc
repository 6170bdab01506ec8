#include "testing/cluster/time_scale.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "google/protobuf/text_format.h"

namespace rebound::testing {
namespace {

int ReadTimeScale() {
  const char* text = std::getenv(kTimeScaleVariable);
  if (text == nullptr || *text == '\0') return 1;
  int scale = 0;
  if (!absl::SimpleAtoi(text, &scale) || scale < 1 || scale > 100) {
    std::fprintf(stderr, "%s=\"%s\": want a whole number in [1, 100]\n", kTimeScaleVariable, text);
    std::abort();
  }
  return scale;
}

// `ms` times the scale, at most int32's maximum (the config fields are int32).
int32_t ScaledField(int32_t ms) {
  const int64_t scaled = ScaledMs(ms);
  return scaled > INT32_MAX ? INT32_MAX : static_cast<int32_t>(scaled);
}

// `text` parsed as a Config, changed by `scale`, printed; `text` where it does not parse.
template <typename Config, typename Scale>
std::string Rewrite(const std::string& text, Scale scale) {
  if (TimeScale() == 1) return text;
  Config config;
  if (!google::protobuf::TextFormat::ParseFromString(text, &config)) return text;
  if (!scale(&config)) return text;
  std::string scaled;
  if (!google::protobuf::TextFormat::PrintToString(config, &scaled)) return text;
  return scaled;
}

}  // namespace

int TimeScale() {
  static const int scale = ReadTimeScale();
  return scale;
}

absl::Duration Scaled(absl::Duration d) { return d * TimeScale(); }

int64_t ScaledMs(int64_t ms) { return ms * TimeScale(); }

void ScaleTimingFields(JobConfig* job) {
  if (TimeScale() == 1) return;
  FaultToleranceConfig* ft = job->mutable_fault_tolerance();
  ft->set_heartbeat_interval_ms(ScaledField(ft->heartbeat_interval_ms()));
  ft->set_failure_timeout_ms(ScaledField(ft->failure_timeout_ms()));
  ft->set_crash_confirm_ms(ScaledField(ft->crash_confirm_ms()));
  ft->set_neighbour_timeout_ms(ScaledField(ft->neighbour_timeout_ms()));
  ft->set_reconnect_grace_ms(ScaledField(ft->reconnect_grace_ms()));
  ft->set_recovery_timeout_ms(ScaledField(ft->recovery_timeout_ms()));
}

void ScaleTimingFields(WorkerConfig* worker) {
  if (TimeScale() == 1) return;
  worker->set_rpc_deadline_ms(ScaledField(worker->rpc_deadline_ms()));
  worker->set_give_up_after_ms(ScaledField(worker->give_up_after_ms()));
}

std::string ScaledServerConfig(const std::string& text) {
  return Rewrite<ServerConfig>(text, [](ServerConfig* config) {
    if (!config->has_job()) return false;  // a job_file: not this harness's to rewrite
    ScaleTimingFields(config->mutable_job());
    return true;
  });
}

std::string ScaledWorkerConfig(const std::string& text) {
  return Rewrite<WorkerConfig>(text, [](WorkerConfig* config) {
    ScaleTimingFields(config);
    return true;
  });
}

}  // namespace rebound::testing
