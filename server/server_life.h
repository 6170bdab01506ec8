#pragma once

// ServerLife: one life of rebound_server, from its config to its end (docs/operations.md): opens
// the store (a group's member: as a standby, until its RoleCycle wins the leadership), builds
// the units and services (a sharded job's range service and group 0's calls to the ranges,
// GLOBAL_CHECKPOINT, metrics, periodic exports), loads the durable state, serves, runs the
// failure detector, and shuts down in order when the cycle ends (server/group/role_cycle.h).
//
// Thread-safety: one life per process at a time (it owns the process's termination signals:
// common/process.h's WaitForTerminationSignal). Ownership: nothing outlives the call.
// Exit codes (RunServerLife's return): 0 after SIGTERM/SIGINT, 1 when it cannot listen or its
// data directory cannot be opened or read, 2 for a config it cannot serve, kRunAgain for a
// leader that lost its leadership.

#include <string>

#include "proto/config.pb.h"

namespace rebound::server {

// RunServerLife's return value that makes main() execute the binary again with the same
// arguments: a leader that lost its leadership comes back as a standby, with nothing of its
// old life.
constexpr int kRunAgain = -1;

// What the command line adds to the config (server/main.cc's flags).
struct LifeOptions {
  std::string port_file;       // the bound port is written here once serving
  std::string restore_from;    // a backup to restore into the data directory first
  std::string name;            // the member's name in its group (overrides replication.name)
  std::string peer_listen;     // the group's peer port (overrides replication.peer_listen_address)
  std::string peer_port_file;  // the bound peer port is written here
  bool accept_wal_loss = false;
};

// REQUIRES: a valid config (common/config.h) and InstallTerminationHandlers() called.
int RunServerLife(const ServerConfig& config, const LifeOptions& options);

}  // namespace rebound::server
