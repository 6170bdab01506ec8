#pragma once

// Keepalive of a server group's peer connections (the ServerPeer.Replicate stream), set on both
// ends: the standby's channel to its leader and the leader's peer server. Each end pings every
// kPeerKeepaliveMs while the connection is open (calls or not); a peer that does not answer a
// ping within kPeerKeepaliveTimeoutMs has its connection closed, which ends the stream. So a
// silent peer (partitioned by a firewall, stopped) is noticed within 1.5 s, not when TCP
// gives up minutes later (docs/coordination.md "When a standby is re-admitted"). The peer
// server also accepts the standby's pings at that rate (server/main.cc AllowClientKeepalive).

#include "grpcpp/grpcpp.h"

namespace rebound::server {

constexpr int kPeerKeepaliveMs = 500;
constexpr int kPeerKeepaliveTimeoutMs = 1000;

inline void AddPeerKeepalive(grpc::ChannelArguments* args) {
  args->SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kPeerKeepaliveMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kPeerKeepaliveTimeoutMs);
  args->SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args->SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

inline void AddPeerKeepalive(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kPeerKeepaliveMs);
  builder->AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kPeerKeepaliveTimeoutMs);
  builder->AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
}

}  // namespace rebound::server
