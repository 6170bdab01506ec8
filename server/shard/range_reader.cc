#include "server/shard/range_reader.h"

#include "absl/strings/str_cat.h"
#include "common/fan_out.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "compute/range_snapshot.h"
#include "server/shard/range_groups.h"

namespace rebound::server {

absl::StatusOr<std::unique_ptr<RangeReader>> RangeReader::Create(const ServerConfig& config,
                                                                 const RangeService* local,
                                                                 std::string operator_token) {
  std::unique_ptr<RangeReader> made(new RangeReader(config, local, std::move(operator_token)));
  ASSIGN_OR_RETURN(made->stubs_, RangeGroupStubs(config));
  return made;
}

std::vector<absl::StatusOr<ExportRangeResponse>> RangeReader::ReadStage(
    int stage, absl::Time deadline) const {
  std::vector<absl::StatusOr<ExportRangeResponse>> answers(stubs_.size() + 1);
  FanOut(answers.size(), [&](size_t k) {
    const int range = static_cast<int>(k);
    absl::StatusOr<ExportRangeResponse> answer;
    if (range == 0) {
      answer = local_->ReadForExport(stage);
    } else {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(deadline));
      if (!operator_token_.empty()) context.AddMetadata(kOperatorTokenKey, operator_token_);
      ExportRangeRequest request;
      request.set_stage(stage);
      request.set_range(range);
      ExportRangeResponse response;
      const absl::Status status =
          FromGrpcStatus(stubs_[k - 1]->ExportRange(&context, request, &response));
      if (status.ok()) {
        answer = std::move(response);
      } else {
        answer = status;
      }
    }
    if (!answer.ok()) {
      answer = absl::Status(answer.status().code(),
                            absl::StrCat("range ", range, " (group ", range, " at ",
                                         addresses_[k], ") did not export stage ", stage, ": ",
                                         answer.status().message()));
    }
    answers[k] = std::move(answer);
    return absl::OkStatus();
  });
  return answers;
}

absl::StatusOr<std::vector<Snapshot>> RangeReader::ReadSnapshot(const SlotId& slot,
                                                                 int64_t step,
                                                                 absl::Time deadline) const {
  std::vector<Snapshot> parts(stubs_.size() + 1);
  RETURN_IF_ERROR(FirstFailure(
      FanOut(parts.size(),
             [&](size_t k) -> absl::Status {
               const int range = static_cast<int>(k);
               absl::Status status;
               if (range == 0) {
                 absl::StatusOr<Snapshot> part = local_->ReadSnapshotPart(slot, step);
                 if (part.ok()) parts[0] = *std::move(part);
                 status = part.status();
               } else {
                 grpc::ClientContext context;
                 context.set_deadline(absl::ToChronoTime(deadline));
                 if (!operator_token_.empty()) {
                   context.AddMetadata(kOperatorTokenKey, operator_token_);
                 }
                 ReadRangeSnapshotRequest request;  // incarnation 0: group 0's read
                 *request.mutable_slot() = slot;
                 request.set_step(step);
                 request.set_range(range);
                 status = FromGrpcStatus(
                     stubs_[k - 1]->ReadRangeSnapshot(&context, request, &parts[k]));
               }
               if (status.ok()) return status;
               return absl::Status(status.code(), absl::StrCat("its group at ", addresses_[k],
                                                               " answered: ", status.message()));
             }),
      "range"));
  return parts;
}

absl::Status RangeReader::FillSnapshot(const compute::StageLayout& layout, Snapshot* header,
                                       absl::Time deadline) const {
  ASSIGN_OR_RETURN(const std::vector<Snapshot> parts,
                   ReadSnapshot(header->slot(), header->step(), deadline));
  return compute::JoinRangeSnapshots(layout, parts, header);
}

}  // namespace rebound::server
