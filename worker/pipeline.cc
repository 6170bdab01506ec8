#include "worker/pipeline.h"

#include <glog/logging.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config.h"
#include "common/grpc_status.h"
#include "common/retry.h"
#include "common/security.h"
#include "common/slot.h"
#include "common/status_macros.h"
#include "common/tensor_codec.h"
#include "compute/adahessian.h"
#include "compute/model_layout.h"
#include "grpcpp/grpcpp.h"
#include "worker/peer_service.h"
#include "worker/retry.h"
#include "worker/worker_metrics.h"

namespace rebound::worker {
namespace {

const char* PairName(BoundaryDirection direction) {
  return direction == FORWARD ? "forward pair" : "backward pair";
}

std::string OwnerText(const std::optional<Neighbour>& n) {
  if (!n.has_value() || n->incarnation() == 0) return "no owner now: it is being rebuilt";
  return absl::StrCat("incarnation ", n->incarnation(), " at ", n->peer_address());
}

}  // namespace

absl::StatusOr<std::unique_ptr<PipelineExchange>> PipelineExchange::Create(
    const WorkerConfig& config, const Registration& registration, WorkerAgent* agent,
    PipelinePort* port, const absl::Notification& stop, const Clock* clock, LogFn log) {
  if (port == nullptr) {
    return absl::FailedPreconditionError("a pipeline stage needs the worker's WorkerPeer port");
  }
  std::unique_ptr<PipelineExchange> exchange(
      new PipelineExchange(config, registration, agent, port, stop, clock, std::move(log)));
  const JobConfig& job = registration.job;
  const int s = registration.slot.stage();
  const int stages = job.topology().stages();
  const std::vector<bool> logged = LoggedBoundaries(job);
  if (s + 1 < stages) {
    Link link;
    link.to = registration.slot;
    link.to.set_stage(s + 1);
    link.direction = FORWARD;
    link.logged = logged[s + 1] && exchange->log_ != nullptr;
    exchange->up_ = std::move(link);
  }
  if (s > 0) {
    Link link;
    link.to = registration.slot;
    link.to.set_stage(s - 1);
    link.direction = BACKWARD;
    link.logged = logged[s] && exchange->log_ != nullptr;
    exchange->down_ = std::move(link);
  }
  const std::vector<int> starts = StageLayerStarts(job);
  ASSIGN_OR_RETURN(const compute::StageLayout layout,
                   compute::StageLayout::Create(job.model(), starts[s], starts[s + 1]));
  PipelinePort::Shape shape;
  shape.slot = registration.slot;
  shape.incarnation = registration.incarnation;
  shape.stages = stages;
  shape.micro_batches = job.data().micro_batches();
  shape.rows = job.data().batch_size() / job.data().micro_batches();
  shape.forward_width = s > 0 ? layout.input_dim() : 0;
  shape.backward_width = s + 1 < stages ? layout.output_dim() : 0;
  // Two pairs per micro-batch and direction for kAheadSteps + 1 steps, with room to spare.
  shape.max_bytes = std::max<int64_t>(
      64 << 20, 4 * (PipelinePort::kAheadSteps + 1) * shape.micro_batches * shape.rows *
                    (shape.forward_width + shape.backward_width) * int64_t{sizeof(float)});
  port->Open(
      shape, registration.start_step,
      [agent](const SlotId& from) -> uint64_t {
        const std::optional<Neighbour> n = agent->neighbour(from);
        return n.has_value() ? n->incarnation() : 0;
      },
      [agent]() { agent->RequestHeartbeat(); });
  return exchange;
}

PipelineExchange::PipelineExchange(const WorkerConfig& config, const Registration& registration,
                                   WorkerAgent* agent, PipelinePort* port,
                                   const absl::Notification& stop, const Clock* clock,
                                   LogFn log)
    : config_(config),
      job_(registration.job),
      slot_(registration.slot),
      incarnation_(registration.incarnation),
      agent_(agent),
      port_(port),
      stop_(stop),
      clock_(clock),
      log_(std::move(log)),
      neighbour_timeout_(
          absl::Milliseconds(registration.job.fault_tolerance().neighbour_timeout_ms())),
      give_up_(absl::Milliseconds(config.give_up_after_ms())) {}

PipelineExchange::~PipelineExchange() {
  port_->Close();
  if (blocked_) {
    Metrics().blocked->Set(0);
    agent_->set_blocked("");
  }
}

void PipelineExchange::Complete(int64_t t) {
  port_->Complete(t);
  for (std::optional<Link>* link : {&up_, &down_}) {
    if (!link->has_value()) continue;
    std::deque<BoundaryMessage>& window = (*link)->window;
    while (!window.empty() && window.front().step() <= t - kWindowSteps) window.pop_front();
  }
}

void PipelineExchange::Linger(const absl::Notification& done) {
  const absl::Time give_up = clock_->Now() + give_up_;
  while (!clock_->WaitFor(absl::Milliseconds(100), &done) && clock_->Now() < give_up) {
    if (up_.has_value()) ResendIfReplaced(*up_);
    if (down_.has_value()) ResendIfReplaced(*down_);
  }
}

absl::Status PipelineExchange::CheckWait(absl::Duration waited, const std::string& what,
                                         const SlotId& from) {
  if (waited > give_up_) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": nothing from slot ", SlotName(from), " for ", absl::ToInt64Milliseconds(waited),
        " ms (give_up_after_ms); the neighbour is gone and no spare rebuilt it"));
  }
  if (waited > neighbour_timeout_) {
    blocked_ = true;
    Metrics().blocked->Set(1);
    agent_->set_blocked(absl::StrCat("BLOCKED ", absl::ToInt64Milliseconds(waited), " ms ", what,
                                     " (slot ", SlotName(from), ": ",
                                     OwnerText(agent_->neighbour(from)), ")"));
  }
  return absl::OkStatus();
}

grpc::Status PipelineExchange::SendOnce(Link& link, const Neighbour& neighbour,
                                        const BoundaryMessage& message, BoundaryAck* ack) {
  if (link.stub == nullptr || link.address != neighbour.peer_address()) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(kMaxPeerMessageBytes);
    auto made = MakeChannel(neighbour.peer_address(), config_.security(), args);
    if (!made.ok()) return ToGrpcStatus(made.status());
    link.stub = WorkerPeer::NewStub(*made);
    link.address = neighbour.peer_address();
  }
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(config_.rpc_deadline_ms()));
  return link.stub->SendBoundary(&context, message, ack);
}

void PipelineExchange::ResendIfReplaced(Link& link) {
  if (link.window.empty()) return;
  const std::optional<Neighbour> n = agent_->neighbour(link.to);
  if (!n.has_value() || n->incarnation() == 0 || n->incarnation() == link.acked_by) return;
  for (const BoundaryMessage& message : link.window) {
    BoundaryAck ack;
    const grpc::Status status = SendOnce(link, *n, message, &ack);
    if (!status.ok()) return;  // again on the next call
    if (ack.receiver_incarnation() != n->incarnation()) return;
    Metrics().boundary_pairs_sent->Increment();
  }
  LOG(WARNING) << "sent the " << link.window.size() << " " << PairName(link.direction)
               << "s of steps " << link.window.front().step() << ".."
               << link.window.back().step() << " again to slot " << SlotName(link.to)
               << ", now incarnation " << n->incarnation();
  link.acked_by = n->incarnation();
}

absl::Status PipelineExchange::Send(Link& link, BoundaryMessage message) {
  const std::string what =
      absl::StrCat("sending the ", PairName(link.direction), " of step ", message.step(),
                   ", micro-batch ", message.micro_batch());
  // Retried until acknowledged: the give-up time is CheckWait's (it also reports BLOCKED).
  RetryLoop retry(PacingPolicy(absl::Milliseconds(20), absl::Milliseconds(500)), clock_, &stop_,
                  what);
  const absl::Time start = clock_->Now();
  while (true) {
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    ResendIfReplaced(link);
    const std::optional<Neighbour> n = agent_->neighbour(link.to);
    grpc::Status status(grpc::StatusCode::UNAVAILABLE, "the slot has no owner now");
    if (n.has_value() && n->incarnation() != 0) {
      BoundaryAck ack;
      status = SendOnce(link, *n, message, &ack);
      if (status.ok()) {
        const bool replaced = link.acked_by != 0 && link.acked_by != ack.receiver_incarnation();
        link.window.push_back(std::move(message));
        if (replaced) {
          // A new owner acknowledged this one first (it took over between the check above and
          // this send): it needs the rest of the window too; until that went through,
          // ResendIfReplaced tries again at every send and wait.
          link.acked_by = 0;
          ResendIfReplaced(link);
        } else {
          link.acked_by = ack.receiver_incarnation();
        }
        Metrics().boundary_pairs_sent->Increment();
        if (blocked_) {
          blocked_ = false;
          Metrics().blocked->Set(0);
          agent_->set_blocked("");
        }
        return absl::OkStatus();
      }
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        return absl::InternalError(absl::StrCat(what, " to slot ", SlotName(link.to),
                                                ": refused as malformed: ",
                                                status.error_message()));
      }
      if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION) {
        agent_->RequestHeartbeat();  // the owner changed: learn the new one
      }
    }
    RETURN_IF_ERROR(CheckWait(clock_->Now() - start, what, link.to));
    VLOG(1) << what << " to slot " << SlotName(link.to) << ": " << status.error_message();
    // Every other refusal (no owner now, an owner that changed, a connection error) is tried
    // again.
    absl::Status again = absl::UnavailableError(status.error_message());
    if (!retry.ShouldRetry(&again)) return again;
  }
}

absl::StatusOr<BoundaryMessage> PipelineExchange::Await(BoundaryDirection direction, int64_t t,
                                                        int mb) {
  SlotId from = slot_;
  from.set_stage(direction == FORWARD ? slot_.stage() - 1 : slot_.stage() + 1);
  const std::string what =
      absl::StrCat("waiting for the ", PairName(direction), " of step ", t, ", micro-batch ", mb);
  const absl::Time start = clock_->Now();
  while (true) {
    absl::StatusOr<BoundaryMessage> message =
        port_->Take(direction, t, mb, absl::Milliseconds(100));
    if (message.ok()) {
      Metrics().boundary_wait_seconds->ObserveDuration(clock_->Now() - start);
      if (blocked_) {
        blocked_ = false;
        Metrics().blocked->Set(0);
        agent_->set_blocked("");
      }
      return message;
    }
    if (message.status().code() != absl::StatusCode::kDeadlineExceeded) return message.status();
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    if (up_.has_value()) ResendIfReplaced(*up_);
    if (down_.has_value()) ResendIfReplaced(*down_);
    RETURN_IF_ERROR(CheckWait(clock_->Now() - start, what, from));
  }
}

BoundaryMessage PipelineExchange::MakeMessage(const Link& link, int64_t t, int mb,
                                              absl::Span<const int64_t> ids,
                                              absl::Span<const float> pair, bool with_rop,
                                              int64_t width) const {
  const int64_t rows = static_cast<int64_t>(ids.size());
  const int64_t half = rows * width;
  BoundaryMessage message;
  message.set_sender_incarnation(incarnation_);
  *message.mutable_from_slot() = slot_;
  *message.mutable_to_slot() = link.to;
  message.set_step(t);
  message.set_micro_batch(mb);
  message.mutable_sample_ids()->Assign(ids.begin(), ids.end());
  BoundaryPayload* payload = message.mutable_payload();
  payload->set_direction(link.direction);
  // compute/mlp.h: forward [h; R{h}], backward [R{e}; e]. The payload's value is h or e.
  absl::Span<const float> value = pair.subspan(0, half);
  absl::Span<const float> r_value;
  if (with_rop) {
    value = link.direction == FORWARD ? pair.subspan(0, half) : pair.subspan(half, half);
    r_value = link.direction == FORWARD ? pair.subspan(half, half) : pair.subspan(0, half);
  }
  *payload->mutable_value() = MakeFloatTensor(0, "value", {rows, width}, value);
  *payload->mutable_r_value() =
      MakeFloatTensor(1, "r_value", {with_rop ? rows : 0, width}, r_value);
  return message;
}

absl::Status PairFromPayload(const BoundaryPayload& payload, std::vector<float>* pair) {
  ASSIGN_OR_RETURN(std::vector<float> value, ReadFloats(payload.value()));
  ASSIGN_OR_RETURN(std::vector<float> r_value, ReadFloats(payload.r_value()));
  pair->clear();
  if (payload.direction() == FORWARD) {
    pair->insert(pair->end(), value.begin(), value.end());
    pair->insert(pair->end(), r_value.begin(), r_value.end());
  } else {
    pair->insert(pair->end(), r_value.begin(), r_value.end());
    pair->insert(pair->end(), value.begin(), value.end());
  }
  return absl::OkStatus();
}

absl::StatusOr<float> PipelineExchange::Step(int64_t t, absl::Span<const int64_t> ids,
                                             const std::vector<int32_t>& label_map,
                                             SlotCompute* compute) {
  compute::LocalTrainer& trainer = *compute->trainer;
  RETURN_IF_ERROR(compute->LoadBatch(ids, label_map));
  RETURN_IF_ERROR(trainer.LoadBatch(
      trainer.starts_at_input() ? absl::Span<const float>(compute->images)
                                : absl::Span<const float>(),
      compute->labels));
  RETURN_IF_ERROR(trainer.BeginStep(t));
  const int m_count = job_.data().micro_batches();
  const int64_t rows = static_cast<int64_t>(ids.size()) / m_count;
  const bool with_rop = compute::HessianDue(t, job_.adahessian().hessian_every());
  const int64_t in_width = trainer.stage(0).layout().input_dim();
  const int64_t out_width = trainer.stage(0).layout().output_dim();
  std::vector<float> pair;

  // Sends `out` (device) over `link`, logging it first if the boundary is logged.
  auto forward_out = [&](Link& link, int mb, compute::ConstDSpan out, int64_t width) {
    host_.resize(out.size);
    RETURN_IF_ERROR(compute->backend->CopyToHost(out, absl::MakeSpan(host_)));
    const absl::Span<const int64_t> mb_ids = ids.subspan(mb * rows, rows);
    BoundaryMessage message = MakeMessage(link, t, mb, mb_ids, host_, with_rop, width);
    if (link.logged) {
      LogRecord record;
      *record.mutable_slot() = link.to;
      record.set_step(t);
      record.set_micro_batch(mb);
      record.mutable_sample_ids()->Assign(mb_ids.begin(), mb_ids.end());
      *record.add_boundaries() = message.payload();
      RETURN_IF_ERROR(log_({std::move(record)}));
    }
    return Send(link, std::move(message));
  };
  // Checks that a neighbour's pair is for this stage's samples.
  auto check_ids = [&](const BoundaryMessage& message, int mb) -> absl::Status {
    const absl::Span<const int64_t> mine = ids.subspan(mb * rows, rows);
    if (!std::equal(mine.begin(), mine.end(), message.sample_ids().begin(),
                    message.sample_ids().end())) {
      return absl::InternalError(absl::StrCat(
          "slot ", SlotName(message.from_slot()), " sent step ", t, ", micro-batch ", mb,
          " for other samples than this stage drew: the stages disagree on the data order"));
    }
    return absl::OkStatus();
  };

  for (int mb = 0; mb < m_count; ++mb) {
    if (down_.has_value()) {
      ASSIGN_OR_RETURN(const BoundaryMessage message, Await(FORWARD, t, mb));
      RETURN_IF_ERROR(check_ids(message, mb));
      RETURN_IF_ERROR(PairFromPayload(message.payload(), &pair));
      RETURN_IF_ERROR(trainer.SetForwardInput(mb, pair));
    }
    ASSIGN_OR_RETURN(const compute::ConstDSpan out, trainer.ForwardMicroBatch(mb));
    if (up_.has_value()) RETURN_IF_ERROR(forward_out(*up_, mb, out, out_width));
  }
  for (int mb = m_count - 1; mb >= 0; --mb) {
    if (up_.has_value()) {
      ASSIGN_OR_RETURN(const BoundaryMessage message, Await(BACKWARD, t, mb));
      RETURN_IF_ERROR(check_ids(message, mb));
      RETURN_IF_ERROR(PairFromPayload(message.payload(), &pair));
      RETURN_IF_ERROR(trainer.SetBackwardInput(mb, pair));
    }
    ASSIGN_OR_RETURN(const compute::ConstDSpan back, trainer.BackwardMicroBatch(mb));
    if (down_.has_value()) RETURN_IF_ERROR(forward_out(*down_, mb, back, in_width));
  }
  return trainer.FinishStep();
}

}  // namespace rebound::worker
