#include "server/slot_books.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/config.h"
#include "common/slot.h"

namespace rebound::server {

WeightRecord WithBook(WeightRecord weights, const SlotId& slot, const SlotBook& book) {
  *weights.mutable_slot() = Normalized(slot);
  weights.set_last_update_step(book.last_update_step);
  weights.set_update_count(book.update_count);
  weights.set_applied_sequence(book.applied_sequence);
  weights.set_next_sync_weight(book.next_weight);
  return weights;
}

SlotBooks::SlotBooks(const JobConfig& job) : job_(job) {}

const SlotBook& SlotBooks::GetLocked(const Key& key) const {
  static const SlotBook kNone;
  auto it = books_.find(key);
  return it == books_.end() ? kNone : it->second;
}

SlotBook SlotBooks::Get(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  return GetLocked(KeyOf(slot));
}

void SlotBooks::Set(const SlotId& slot, const SlotBook& book, double divergence_ratio) {
  SetDecided(slot, book, divergence_ratio);
  MarkDurable(slot, book);
}

void SlotBooks::SetDecided(const SlotId& slot, const SlotBook& book, double divergence_ratio) {
  absl::MutexLock lock(&mu_);
  books_[KeyOf(slot)] = book;
  double& max_ratio = max_divergence_ratio_[slot.stage()];
  max_ratio = std::max(max_ratio, divergence_ratio);
}

void SlotBooks::MarkDurable(const SlotId& slot, const SlotBook& book) {
  absl::MutexLock lock(&mu_);
  SlotBook& durable = durable_[KeyOf(slot)];
  // Writes become durable in the order they were decided; a late report never goes back.
  if (book.update_count < durable.update_count) return;
  durable.last_update_step = book.last_update_step;
  durable.update_count = book.update_count;
  durable.applied_sequence = book.applied_sequence;
}

SlotBook SlotBooks::Durable(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  auto it = durable_.find(KeyOf(slot));
  return it == durable_.end() ? SlotBook() : it->second;
}

void SlotBooks::Restore(const std::vector<WeightRecord>& records) {
  absl::MutexLock lock(&mu_);
  for (const WeightRecord& record : records) {
    SlotBook& book = books_[KeyOf(record.slot())];
    book.last_update_step = record.last_update_step();
    book.update_count = record.update_count();
    book.applied_sequence = record.applied_sequence();
    book.next_weight = record.has_next_sync_weight() ? record.next_sync_weight() : 1.0;
    durable_[KeyOf(record.slot())] = book;
  }
}

void SlotBooks::Clear() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, book] : books_) book = SlotBook();
  durable_.clear();
}

int64_t SlotBooks::StepLogFloor(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  const SlotBook& book = GetLocked(KeyOf(slot));
  // A member of a multi-stage recovery group keeps its log back to its last GC, and so does a
  // slot whose sync windows may be audited (docs/recovery.md#audits): a window's last records
  // may arrive after the sync that closed it, and are kept when the window is.
  const auto [first, end] = RecoveryGroup(job_, slot.stage());
  return end - first > 1 || job_.audit().fraction() > 0 ? book.log_floor : book.last_update_step;
}

int64_t SlotBooks::NewestUpdateStep() const {
  absl::MutexLock lock(&mu_);
  int64_t newest = 0;
  for (const auto& [key, book] : durable_) newest = std::max(newest, book.last_update_step);
  return newest;
}

int64_t SlotBooks::GroupFloor(const SlotId& slot, int64_t own_step) const {
  absl::MutexLock lock(&mu_);
  int64_t floor = own_step >= 0 ? own_step : GetLocked(KeyOf(slot)).last_update_step;
  if (job_.topology().stages() == 1) return floor;
  const auto [first, end] = RecoveryGroup(job_, slot.stage());
  for (int m = first; m < end; ++m) {
    if (m != slot.stage()) floor = std::min(floor, GetLocked({slot.replica(), m}).last_update_step);
  }
  return floor;
}

absl::Status SlotBooks::WaitForTurn(const SlotId& slot, absl::Duration timeout) {
  const int replicas = job_.topology().replicas();
  absl::MutexLock lock(&mu_);
  auto my_turn = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const auto mine = std::make_pair(GetLocked(KeyOf(slot)).update_count, slot.replica());
    for (int r = 0; r < replicas; ++r) {
      if (r == slot.replica()) continue;
      const auto other = std::make_pair(GetLocked({r, slot.stage()}).update_count, r);
      if (other < mine) return false;
    }
    return true;
  };
  if (!mu_.AwaitWithTimeout(absl::Condition(&my_turn), timeout)) {
    return absl::UnavailableError(
        absl::StrCat("DETERMINISTIC scheduling: slot ", SlotName(slot),
                     " waits for the other replicas of its round; retry"));
  }
  return absl::OkStatus();
}

void SlotBooks::CountRefused(const SlotId& slot) {
  absl::MutexLock lock(&mu_);
  ++refused_[KeyOf(slot)];
}

int64_t SlotBooks::Refused(const SlotId& slot) const {
  absl::MutexLock lock(&mu_);
  auto it = refused_.find(KeyOf(slot));
  return it == refused_.end() ? 0 : it->second;
}

double SlotBooks::MaxDivergenceRatio(int stage) const {
  absl::MutexLock lock(&mu_);
  auto it = max_divergence_ratio_.find(stage);
  return it == max_divergence_ratio_.end() ? 0.0 : it->second;
}

}  // namespace rebound::server
