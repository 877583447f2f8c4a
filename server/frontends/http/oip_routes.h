#pragma once

// The Open Inference Protocol's REST endpoints (KServe v2, Triton's binary tensor extension)
// as routes: health, server and model metadata, inference. Each handler converts and
// delegates: inference goes through admission exactly as ModelInfer does, metadata is
// DescribeInferModel's, statuses are HttpStatus's.

#include "server/frontends/http/http_infer_call.h"
#include "server/frontends/http/http_router.h"
#include "server/serving/admission.h"
#include "server/serving/sequence_table.h"

namespace attnserve::server {

// The header that carries a call's deadline: milliseconds from its arrival (the REST protocol
// has none; gRPC's is grpc-timeout).
inline constexpr char kRequestTimeoutHeader[] = "Request-Timeout-Ms";

// Adds the protocol's endpoints to `router`. `admission` and `sequences` (the sessions keyed by
// sequence_id, shared with the gRPC form) outlive the router.
void AddOipRoutes(Admission* admission, SequenceTable* sequences, HttpBodyLimits limits,
                  HttpRouter* router);

// The reply to a refused or failed call: HttpStatus(status) and the error JSON.
void ReplyError(HttpExchange& exchange, const absl::Status& status, bool close = false);

}  // namespace attnserve::server
