#include "worker/partial_sum_exchange.h"

#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/retry.h"
#include "common/security.h"
#include "common/status_macros.h"
#include "worker/peer_service.h"
#include "worker/retry.h"

namespace rebound::worker {

absl::Status PackSums(compute::Backend* backend, absl::Span<const compute::ConstDSpan> sums,
                      absl::Span<const int64_t> active, TensorBundle* out) {
  out->Clear();
  for (size_t s = 0; s < sums.size(); ++s) {
    Tensor* tensor = out->add_tensors();
    tensor->set_id(static_cast<uint32_t>(s));
    tensor->set_name(absl::StrCat("stage", s, ".sums"));
    tensor->set_dtype(FLOAT32);
    tensor->add_shape(active[s]);
    std::string* data = tensor->mutable_data();
    data->resize(static_cast<size_t>(active[s]) * sizeof(float));
    // operator new's storage is aligned for float.
    RETURN_IF_ERROR(backend->CopyToHost(
        sums[s].sub(0, active[s]),
        absl::MakeSpan(reinterpret_cast<float*>(data->data()), static_cast<size_t>(active[s]))));
  }
  return absl::OkStatus();
}

absl::Status CheckSums(const TensorBundle& sums, absl::Span<const int64_t> active,
                       const std::string& what) {
  if (sums.tensors_size() != static_cast<int>(active.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", sums.tensors_size(), " tensors for ", active.size(), " stages"));
  }
  for (size_t s = 0; s < active.size(); ++s) {
    const Tensor& tensor = sums.tensors(static_cast<int>(s));
    if (tensor.dtype() != FLOAT32 ||
        tensor.data().size() != static_cast<size_t>(active[s]) * sizeof(float)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": stage ", s, " has ",
                                                     tensor.data().size(), " bytes, expected ",
                                                     active[s] * sizeof(float)));
    }
  }
  return absl::OkStatus();
}

absl::Status UnpackSums(compute::Backend* backend, const Tensor& tensor,
                        std::vector<float>* scratch, compute::DSpan dst) {
  const size_t n = tensor.data().size() / sizeof(float);
  const void* bytes = tensor.data().data();
  if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) == 0) {
    // Aligned (as the heap gives large strings): straight from the message.
    return backend->CopyToDevice(absl::MakeConstSpan(static_cast<const float*>(bytes), n),
                                 dst.sub(0, static_cast<int64_t>(n)));
  }
  scratch->resize(n);
  std::memcpy(scratch->data(), tensor.data().data(), scratch->size() * sizeof(float));
  return backend->CopyToDevice(*scratch, dst.sub(0, static_cast<int64_t>(scratch->size())));
}

PartialSumExchange::PartialSumExchange(const WorkerConfig& config, const RecoveryTask& task,
                                       ReplayMailbox* mailbox, const absl::Notification& stop,
                                       const Clock* clock, int64_t max_floats)
    : config_(config), task_(task), mailbox_(mailbox), stop_(stop), clock_(clock) {
  if (config.replay_shared_memory()) {
    auto region = SharedSumsWriter::Create(task.task_id(), task.rank(), max_floats);
    if (region.ok()) {
      region_ = *std::move(region);
    } else {
      LOG(WARNING) << "partial sums go inline to every spare: " << region.status();
    }
  }
  by_reference_.assign(task.spares_size(), false);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(kMaxPeerMessageBytes);
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, kPeerWindowBytes);
  args.SetInt(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, kPeerFrameBytes);
  args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, kPeerReadChunkBytes);
  for (int r = 0; r < task.spares_size(); ++r) {
    const bool needed = r != task.rank();
    std::shared_ptr<grpc::Channel> channel;
    if (needed) {
      // The same credentials and token as the job's other workers
      // (common/security.h); MakeChannel reads files the config loader has checked.
      auto made = MakeChannel(task.spares(r).peer_address(), config.security(), args);
      if (!made.ok()) LOG(ERROR) << "cannot set up the channel to a spare: " << made.status();
      channel = made.ok() ? *std::move(made)
                          : grpc::CreateCustomChannel(task.spares(r).peer_address(),
                                                      grpc::InsecureChannelCredentials(), args);
    }
    channels_.push_back(channel);
    stubs_.push_back(needed ? WorkerPeer::NewStub(channels_.back()) : nullptr);
  }
}

absl::Duration PartialSumExchange::Bound(bool first) const {
  return absl::Milliseconds(config_.rpc_deadline_ms()) * (first ? 2 : 1);
}

template <typename Call>
absl::Status PartialSumExchange::SendToPeer(const char* what, absl::Time deadline, int r,
                                            Call call) {
  // The peer's own deadline ends the loop (DEADLINE_EXCEEDED); the policy only paces it.
  RetryLoop retry(PacingPolicy(absl::Milliseconds(2), absl::Milliseconds(100)), clock_, &stop_,
                  what);
  while (true) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(deadline));
    absl::Status status = FromGrpcStatus(call(&context));
    if (status.ok() || status.code() != absl::StatusCode::kUnavailable) return status;
    if (clock_->Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": ", status.message()));
    }
    // UNAVAILABLE from a peer that answers means "not ready yet"; from one that
    // refuses connections, that it is gone.
    if (channels_[r]->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      return absl::UnavailableError(
          absl::StrCat(what, ": it cannot be reached any more (", status.message(), ")"));
    }
    if (!retry.ShouldRetry(&status)) return status;
  }
}

template <typename Message, typename Take>
absl::StatusOr<Message> PartialSumExchange::Await(int r, absl::Duration bound, Take take) {
  const absl::Time deadline = clock_->Now() + bound;
  while (true) {
    const absl::Duration slice = std::min(kProbePeriod, deadline - clock_->Now());
    absl::StatusOr<Message> message = take(std::max(slice, absl::ZeroDuration()));
    if (message.ok() || message.status().code() != absl::StatusCode::kDeadlineExceeded ||
        clock_->Now() >= deadline) {
      return message;
    }
    if (stop_.HasBeenNotified()) return absl::CancelledError("stopped");
    if (channels_[r]->GetState(/*try_to_connect=*/true) == GRPC_CHANNEL_TRANSIENT_FAILURE) {
      return absl::UnavailableError("it cannot be reached any more");
    }
  }
}

absl::Status PartialSumExchange::Publish(compute::Backend* backend,
                                         absl::Span<const compute::ConstDSpan> sums,
                                         absl::Span<const int64_t> active, bool first,
                                         PartialSum* partial) {
  if (region_ != nullptr) {
    int64_t floats = 0;
    for (const int64_t n : active) floats += n;
    absl::Span<float> slot = region_->Begin(partial->step(), floats);
    if (static_cast<int64_t>(slot.size()) != floats) {
      return absl::InternalError(absl::StrCat("step ", partial->step(), "'s sums take ", floats,
                                              " floats, the region's slots ", slot.size()));
    }
    for (size_t s = 0; s < sums.size(); ++s) {
      RETURN_IF_ERROR(backend->CopyToHost(sums[s].sub(0, active[s]), slot.subspan(0, active[s])));
      slot.remove_prefix(active[s]);
    }
    if (first) {
      partial->set_shm_name(region_->name());
      partial->set_shm_offset(region_->SlotOffset(partial->step()));
    }
  }
  bool inline_needed = false;
  for (int r = 0; r < task_.spares_size(); ++r) {
    inline_needed |= r != task_.rank() && !by_reference_[r];
  }
  if (inline_needed) RETURN_IF_ERROR(PackSums(backend, sums, active, partial->mutable_sums()));
  return absl::OkStatus();
}

absl::Status PartialSumExchange::SendToOthers(const PartialSum& partial, bool first) {
  const absl::Time deadline = clock_->Now() + Bound(first);
  PartialSum reference;  // the step's fields and where its sums are, without them
  reference.set_task_id(partial.task_id());
  reference.set_step(partial.step());
  reference.set_rank(partial.rank());
  reference.set_first_micro_batch(partial.first_micro_batch());
  reference.set_micro_batch_count(partial.micro_batch_count());
  reference.set_sender_incarnation(partial.sender_incarnation());
  if (region_ != nullptr) {
    reference.set_shm_name(region_->name());
    reference.set_shm_offset(region_->SlotOffset(partial.step()));
  }
  for (int r = 0; r < task_.spares_size(); ++r) {
    if (r == task_.rank()) continue;
    const PartialSum& message = by_reference_[r] ? reference : partial;
    if (!message.has_sums() && !message.has_shm_name()) {
      return absl::InternalError("the step's sums were not packed for an inline peer");
    }
    PartialSumAck ack;
    absl::Status sent =
        SendToPeer("send the partial sum", deadline, r, [&](grpc::ClientContext* context) {
          return stubs_[r]->SendPartialSum(context, message, &ack);
        });
    if (!sent.ok()) return Name(r, sent);
    if (first && ack.shm_mapped() && partial.has_shm_name()) {
      by_reference_[r] = true;
      LOG(INFO) << "replay task " << task_.task_id() << ": partial sums to spare " << r
                << " go through shared memory " << partial.shm_name();
    }
  }
  // Every peer has answered the offer; those that mapped the region keep it.
  if (first && region_ != nullptr) region_->Unlink();
  return absl::OkStatus();
}

absl::StatusOr<std::vector<absl::Span<const float>>> PartialSumExchange::RegionSums(
    const PartialSum& partial, absl::Span<const int64_t> active) {
  const int r = partial.rank();
  std::shared_ptr<const SharedSumsReader> region = mailbox_->Region(r);
  if (region == nullptr || region->name() != partial.shm_name()) {
    return Name(r, absl::FailedPreconditionError("sent a shared-memory reference to a "
                                                 "region this spare has not mapped"));
  }
  int64_t floats = 0;
  for (const int64_t n : active) floats += n;
  ASSIGN_OR_RETURN(absl::Span<const float> all,
                   region->Read(partial.shm_offset(), task_.task_id(), partial.step(), r, floats));
  regions_in_use_[r] = region;  // the mapping outlives the mailbox's next Open or Close
  std::vector<absl::Span<const float>> out;
  for (const int64_t n : active) {
    out.push_back(all.subspan(0, n));
    all.remove_prefix(n);
  }
  return out;
}

absl::StatusOr<std::vector<PartialSum>> PartialSumExchange::GatherOthers(int64_t t, bool first) {
  std::vector<PartialSum> partials;
  for (int r = 0; r < task_.spares_size(); ++r) {
    if (r == task_.rank()) continue;
    absl::StatusOr<PartialSum> partial = Await<PartialSum>(
        r, Bound(first), [&](absl::Duration d) { return mailbox_->TakePartial(t, r, d); });
    if (!partial.ok()) return Name(r, partial.status());
    partials.push_back(*std::move(partial));
  }
  return partials;
}

absl::Status PartialSumExchange::Name(int r, const absl::Status& status) const {
  return absl::Status(status.code(),
                      absl::StrCat("spare ", r, " (incarnation ", task_.spares(r).incarnation(),
                                   ", ", task_.spares(r).peer_address(), "): ", status.message()));
}

}  // namespace rebound::worker
