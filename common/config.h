#pragma once

// Loading and validation of the protobuf text configs (docs/design.md §7).
//
// Every error names the file, the line (when the field appears in the file) and the field path,
// and says what was expected and what was found, e.g.
//   job.pbtxt:12: easgd.moving_rate must be in (0, 1], got 1.5
// Syntax errors keep protobuf's own message with line and column:
//   job.pbtxt:3:5: Message type "rebound.EasgdConfig" has no field named "rate".
// All problems of a file are reported, one per line, in a single INVALID_ARGUMENT status.
// A file that cannot be read is NOT_FOUND (missing) or INVALID_ARGUMENT (unreadable).

#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/server_addresses.h"  // ValidateHostPort, ParseServerAddresses
#include "proto/config.pb.h"

namespace rebound {

// Parses and validates a job config file.
absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path);

// Parses and validates a server config file. If it names a `job_file`, that file is loaded
// (relative paths are resolved against the server config's directory) and placed in `job`, so
// the result always has `job` set and `job_file` cleared. Relative `token_file`, TLS files and
// `durability.data_dir` are resolved the same way.
absl::StatusOr<ServerConfig> LoadServerConfig(const std::string& path);

// Parses and validates a worker config file; relative file paths resolved as above.
absl::StatusOr<WorkerConfig> LoadWorkerConfig(const std::string& path);

// The same from text; `display_name` is used as the file name in messages. Relative paths are
// resolved against `base_dir`.
absl::StatusOr<JobConfig> ParseJobConfig(const std::string& text, const std::string& display_name);
absl::StatusOr<ServerConfig> ParseServerConfig(const std::string& text,
                                               const std::string& display_name,
                                               const std::string& base_dir);
absl::StatusOr<WorkerConfig> ParseWorkerConfig(const std::string& text,
                                               const std::string& display_name,
                                               const std::string& base_dir);

// Validation of an already parsed job (e.g. one received from the server), without locations.
absl::Status ValidateJobConfig(const JobConfig& job);

// The EASGD moving rate in effect: easgd.moving_rate, or 0.9 / R when it is 0 (the default).
double EffectiveMovingRate(const JobConfig& job);

// The AdaHessian config in effect: job.adahessian() with adahessian.decay_steps = 0 under
// LR_COSINE or LR_LINEAR resolved to the job's length in the optimizer's own steps:
// training.max_steps for the trainers (mode EASGD), training.max_steps x topology.replicas for
// the server's center in mode ASYNC_ADAHESSIAN (its step counts every replica's push). Every
// user of the job's optimizer (trainers, spares' replay, the server) takes it from here, so all
// evaluate the same schedule (compute::LearningRate).
AdaHessianConfig EffectiveAdaHessianConfig(const JobConfig& job);

// The recovery policy the server applies: fault_tolerance.policy, except that REPLAY means
// RESTART_FROM_CENTER in mode ASYNC_ADAHESSIAN, where the center is the replica and a trainer
// keeps no state to replay (no snapshot, no step log; docs/design.md §4.6).
RecoveryPolicy EffectiveRecoveryPolicy(const JobConfig& job);

// First layer index of each stage s in [0, S], with entry S = number of layers: explicit
// topology.stage_boundaries, or an even split by layer count. REQUIRES: a validated job.
std::vector<int> StageLayerStarts(const JobConfig& job);

// Which stage boundaries the step log persists (docs/design.md §5.2): entry b in [1, S-1] is true if
// boundary b (between stages b-1 and b) is logged; entries 0 and S are false. Every boundary
// unless step_log.logged_boundaries lists some or log_no_boundaries is set; none when the log is
// disabled. REQUIRES: a validated job.
std::vector<bool> LoggedBoundaries(const JobConfig& job);

// The recovery group of stage `stage` (docs/design.md §5.2): the stages [first, end) between the nearest
// logged boundaries around it (the model's ends count as logged). A lost stage is replayed with
// its whole group, from the group's snapshots and the pairs logged at the group's edges.
// REQUIRES: a validated job, 0 <= stage < S.
std::pair<int, int> RecoveryGroup(const JobConfig& job, int stage);

// Files the binaries read whole (configs, job files, token files, TLS material) are at most
// this large.
inline constexpr int64_t kMaxConfigFileBytes = int64_t{16} << 20;

// The most server groups a center is sharded across (sharding.groups).
inline constexpr int kMaxShardGroups = 64;

// The contents of `path`, a regular file of at most kMaxConfigFileBytes: common/file.h's ReadFile
// with that limit. `what` names the file's role in messages ("config file",
// "security.tls.cert_file"). NOT_FOUND if it cannot be opened; INVALID_ARGUMENT naming the path
// if it is a directory, a device or a FIFO, or too large ("... over the limit of 16 MiB").
absl::StatusOr<std::string> ReadBoundedFile(const std::string& path, const std::string& what);

// INVALID_ARGUMENT naming `what` and `path` unless `text` holds a PEM block labelled `label`
// ("CERTIFICATE"; "PRIVATE KEY" also accepts "RSA PRIVATE KEY", "EC PRIVATE KEY") with a
// non-empty base64 body.
absl::Status CheckPem(const std::string& text, const std::string& label, const std::string& what,
                      const std::string& path);

}  // namespace rebound
