#include "server/center_export.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "compute/model_layout.h"
#include "compute/shard_ranges.h"
#include "compute/tensor_bundle.h"

namespace rebound::server {

namespace {

// The answer's header, before any stage; FAILED_PRECONDITION while there is no model.
absl::StatusOr<ExportCenterResponse> EmptyExport(const JobConfig& job, const CenterTable& centers,
                                                 const std::string& server_version) {
  if (centers.num_stages() == 0) {
    return absl::FailedPreconditionError(
        "no model yet: a declared model exists once its first worker registered and declared "
        "it (docs/python.md)");
  }
  ExportCenterResponse response;
  response.set_job_id(job.job_id());
  response.set_server_version(server_version);
  return response;
}

// The first pause between reads of a stage whose ranges differ, and the longest: a sync in
// flight between ranges lands within a round trip or two.
constexpr absl::Duration kFirstPause = absl::Milliseconds(5);
constexpr absl::Duration kLongestPause = absl::Milliseconds(200);

}  // namespace

absl::StatusOr<compute::StageLayout> WholeStageLayout(const JobConfig& job,
                                                      const CenterTable& centers, int stage) {
  if (job.model().declared_by_worker()) {
    ASSIGN_OR_RETURN(const TensorBundle declaration, centers.Declaration());
    return compute::StageLayout::FromDeclared(declaration);
  }
  const std::vector<int> starts = StageLayerStarts(job);
  return compute::StageLayout::Create(job.model(), starts[stage], starts[stage + 1]);
}

absl::StatusOr<ExportCenterResponse> ReadCenterExport(const JobConfig& job,
                                                      const CenterTable& centers,
                                                      const std::string& server_version) {
  ASSIGN_OR_RETURN(ExportCenterResponse response, EmptyExport(job, centers, server_version));
  for (int stage = 0; stage < centers.num_stages(); ++stage) {
    auto read = centers.Read(stage);
    if (!read.ok()) return read.status();
    const auto& [center, version] = *read;
    ExportedStage* exported = response.add_stages();
    exported->set_stage(stage);
    exported->set_center_version(version);
    *exported->mutable_center() = centers.Bundle(stage, center);
  }
  return response;
}

absl::Status SameUpdatesInEveryRange(const JobConfig& job, int stage,
                                     const std::vector<ExportRangeResponse>& ranges) {
  const int replicas = job.topology().replicas();
  // What range k had applied of slot (r, stage); a range that does not know the declared model
  // has applied nothing.
  auto step = [&](size_t k, int r) -> int64_t {
    return r < ranges[k].applied_steps_size() ? ranges[k].applied_steps(r) : 0;
  };
  auto sequence = [&](size_t k, int r) -> uint64_t {
    return r < ranges[k].applied_sequences_size() ? ranges[k].applied_sequences(r) : 0;
  };
  for (size_t k = 1; k < ranges.size(); ++k) {
    for (int r = 0; r < replicas; ++r) {
      if (step(k, r) == step(0, r) && sequence(k, r) == sequence(0, r)) continue;
      SlotId slot;
      slot.set_replica(r);
      slot.set_stage(stage);
      return absl::UnavailableError(absl::StrCat(
          "stage ", stage, "'s ranges hold different updates of slot ", SlotName(slot),
          ": range 0 its sync of step ", step(0, r), " (push ", sequence(0, r), "), range ", k,
          " its sync of step ", step(k, r), " (push ", sequence(k, r),
          ") (an update in flight between the ranges, or one a lost trainer left half done "
          "until its successor syncs it again)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ExportedStage> JoinRanges(const JobConfig& job, const CenterTable& centers,
                                         int stage,
                                         const std::vector<ExportRangeResponse>& ranges) {
  ASSIGN_OR_RETURN(const compute::StageLayout layout, WholeStageLayout(job, centers, stage));
  const int64_t n = layout.packed_size();
  const int groups = job.sharding().groups();
  if (static_cast<int>(ranges.size()) != groups) {
    return absl::InternalError(
        absl::StrCat("stage ", stage, ": ", ranges.size(), " range reads for ", groups, " ranges"));
  }
  const std::vector<int64_t> begins = compute::RangeBegins(n, groups);
  std::vector<float> packed(n);
  std::vector<float> declared;  // the declaration's values, for a range that does not know it
  ExportedStage exported;
  exported.set_stage(stage);
  for (int k = 0; k < groups; ++k) {
    const ExportRangeResponse& range = ranges[k];
    const int64_t size = begins[k + 1] - begins[k];
    exported.add_range_versions(range.model_unknown() ? 0 : range.center_version());
    if (range.model_unknown()) {
      if (declared.empty()) {
        ASSIGN_OR_RETURN(const TensorBundle declaration, centers.Declaration());
        declared = compute::PackedFromBundle(layout, declaration);
      }
      std::copy(declared.begin() + begins[k], declared.begin() + begins[k + 1],
                packed.begin() + begins[k]);
      continue;
    }
    if (range.center().tensors_size() != 1 ||
        range.center().tensors(0).data().size() != static_cast<size_t>(size) * sizeof(float)) {
      return absl::DataLossError(absl::StrCat(
          "range ", k, " of stage ", stage, " holds elements [", begins[k], ", ", begins[k + 1],
          ") of ", n, " (", size * sizeof(float), " bytes); its server answered ",
          range.center().tensors_size(), " tensors of ",
          range.center().tensors_size() > 0 ? range.center().tensors(0).data().size() : 0,
          " bytes"));
    }
    std::memcpy(packed.data() + begins[k], range.center().tensors(0).data().data(),
                static_cast<size_t>(size) * sizeof(float));
  }
  exported.set_center_version(exported.range_versions(0));
  *exported.mutable_center() = compute::BundleFromPacked(layout, packed);
  return exported;
}

absl::StatusOr<ExportCenterResponse> ReadShardedCenterExport(const JobConfig& job,
                                                             const CenterTable& centers,
                                                             const StageRangesRead& read_ranges,
                                                             absl::Time deadline,
                                                             const Clock& clock,
                                                             const std::string& server_version) {
  ASSIGN_OR_RETURN(ExportCenterResponse response, EmptyExport(job, centers, server_version));
  for (int stage = 0; stage < centers.num_stages(); ++stage) {
    absl::Duration pause = kFirstPause;
    int reads = 0;
    while (true) {
      ++reads;
      std::vector<absl::StatusOr<ExportRangeResponse>> answers = read_ranges(stage, deadline);
      std::vector<ExportRangeResponse> ranges;
      absl::Status why;  // why this read cannot be answered, if it cannot
      for (absl::StatusOr<ExportRangeResponse>& answer : answers) {
        if (!answer.ok()) {
          // A range group that is down or failing over may answer on a later read; any other
          // refusal (the operator token, a bad configuration) will not change.
          const absl::StatusCode code = answer.status().code();
          if (code != absl::StatusCode::kUnavailable &&
              code != absl::StatusCode::kDeadlineExceeded) {
            return answer.status();
          }
          why = answer.status();
          break;
        }
        ranges.push_back(*std::move(answer));
      }
      if (why.ok()) why = SameUpdatesInEveryRange(job, stage, ranges);
      if (why.ok()) {
        ASSIGN_OR_RETURN(*response.add_stages(), JoinRanges(job, centers, stage, ranges));
        break;
      }
      if (clock.Now() + pause >= deadline) {
        // Out of time: the ranges that differed say DEADLINE_EXCEEDED; a range that did not
        // answer keeps its own code (UNAVAILABLE, retry later).
        const absl::StatusCode code = answers.size() == ranges.size()
                                          ? absl::StatusCode::kDeadlineExceeded
                                          : absl::StatusCode::kUnavailable;
        return absl::Status(code, absl::StrCat("after ", reads, " reads of stage ", stage,
                                               " until the deadline: ", why.message()));
      }
      clock.WaitFor(pause, nullptr);
      pause = std::min(2 * pause, kLongestPause);
    }
  }
  return response;
}

}  // namespace rebound::server
