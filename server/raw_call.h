#pragma once

// What the frontends' raw methods (attnserve.v1 Forward, the Open Inference Protocol's
// ModelInfer) share: the caller's deadline, and reading the few fields admission needs before
// the call is parsed.

#include <initializer_list>
#include <string>
#include <utility>

#include "grpcpp/server_context.h"
#include "grpcpp/support/byte_buffer.h"
#include "server/job.h"

namespace attnserve::server {

// The caller's deadline on the steady clock (max() for none).
Clock::time_point SteadyDeadline(const grpc::CallbackServerContext& context);

// Reads the top-level string fields `fields` (number, destination) of the serialized message in
// `bytes`, skipping every other field without copying or parsing it, so a call refused for its
// model, a full queue or shutdown costs next to nothing. False when the bytes are not a
// protobuf message.
bool ScanStringFields(grpc::ByteBuffer* bytes,
                      std::initializer_list<std::pair<int, std::string*>> fields);

}  // namespace attnserve::server
