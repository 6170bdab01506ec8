#pragma once

// A request body that is not a valid protobuf message: gRPC C++'s generated sync handler gets
// Status(INTERNAL, msg->InitializationErrorString()) from GenericDeserialize
// (grpcpp/impl/codegen/proto_utils.h; the string is empty for messages without required
// fields) and sends it without calling the service. This server interceptor rewrites that
// status, at PRE_SEND_STATUS, to INVALID_ARGUMENT "<method>: the request is not a valid
// <method>'s protobuf message (it does not parse)" (docs/bad_input.md). It touches no other
// status: the service's own INTERNAL errors always carry a message.
//
// Thread-safety: the factory and its interceptors are thread-safe (stateless). Ownership: the
// caller owns the returned factory (gRPC's ServerBuilder takes it).

#include <memory>

#include "grpcpp/support/server_interceptor.h"

namespace rebound::server {

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewParseStatusFactory();

}  // namespace rebound::server
