#include "server/shard/range_export.h"

#include "absl/strings/str_cat.h"
#include "common/fan_out.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "server/shard/range_groups.h"

namespace rebound::server {

absl::StatusOr<std::unique_ptr<RangeExport>> RangeExport::Create(const ServerConfig& config,
                                                                 const RangeService* local,
                                                                 std::string operator_token) {
  std::unique_ptr<RangeExport> made(new RangeExport(config, local, std::move(operator_token)));
  ASSIGN_OR_RETURN(made->stubs_, RangeGroupStubs(config));
  return made;
}

std::vector<absl::StatusOr<ExportRangeResponse>> RangeExport::ReadStage(
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

}  // namespace rebound::server
