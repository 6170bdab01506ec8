#pragma once

// RangeAuthority: a sharded job's group 0 deciding whether a worker's call to a range group may
// proceed (docs/design.md §10.2, docs/sharding.md): CenterRange calls carry a worker's
// credential, and the range groups know no membership, so they ask group 0 (AuthorizeRange).
// A read needs a live incarnation; a sync or push its slot's owner, at the slot's next sync
// point or push sequence (UpdateApplier::AuthorizeRangeSync / AuthorizeRangePush: the same
// rules as every update), answered with the weight the range applies it with; a declaration
// fetch the declared model; a refused update in a range (RANGE_FAULT) is charged to its worker
// here, where faults are kept.
//
// Also the topology's two rules of who answers what: an unsharded job's calls are refused on a
// sharded job (UnshardedOnly), and a range group (group > 0) registers nobody
// (CoordinatorOnly).
//
// Thread-safety: thread-safe (immutable; the units it calls are).
// Ownership: `membership`, `centers` and `applier` are borrowed and must outlive it.
// Status codes: FAILED_PRECONDITION on a server that is not a sharded job's group 0, and from
// the units (a fenced or foreign incarnation, a step or sequence out of turn); INVALID_ARGUMENT
// for a range or access out of bounds, a slot outside the topology, a step outside the job;
// ABORTED for an unknown incarnation.

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/config.pb.h"
#include "proto/rebound.pb.h"
#include "server/apply/update_applier.h"
#include "server/center_table.h"
#include "server/membership.h"

namespace rebound::server {

class RangeAuthority {
 public:
  // REQUIRES: the pointers outlive this object.
  RangeAuthority(const ServerConfig& config, Membership* membership, CenterTable* centers,
                 apply::UpdateApplier* applier);

  RangeAuthority(const RangeAuthority&) = delete;
  RangeAuthority& operator=(const RangeAuthority&) = delete;

  // REQUIRES: the caller checked the call's credential for request.incarnation().
  absl::StatusOr<AuthorizeRangeResponse> Authorize(const AuthorizeRangeRequest& request) const;

 private:
  const ServerConfig& config_;
  const JobConfig& job_;
  Membership* const membership_;
  CenterTable* const centers_;
  apply::UpdateApplier* const applier_;
};

// OK for an unsharded job; FAILED_PRECONDITION naming the calls to use instead (`what`: the
// unsharded call refused) for a sharded one.
absl::Status UnshardedOnly(const JobConfig& job, const char* what);

// OK unless this server is a sharded job's range group (group > 0), which registers nobody:
// FAILED_PRECONDITION naming group 0's address.
absl::Status CoordinatorOnly(const ServerConfig& config);

}  // namespace rebound::server
