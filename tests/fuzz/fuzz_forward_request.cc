// libFuzzer harness: bytes as an attnserve.v1.ForwardRequest, through what the server does with
// a call before and after it queues it: DecodeForwardRequest (server/frontends/v1/forward_codec.h),
// then core::Layer::Validate on the demo layer and, for a small valid call, the reply buffers
// (PrepareForwardResponse) and Forward into them. Any input must give a status, never a crash
// or a sanitizer report. Kept small on purpose: the codec's API is the thing most likely to move.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "attnserve/v1/attention.pb.h"
#include "core/layer.h"
#include "core/runtime_info.h"
#include "core/weights.h"
#include "google/protobuf/stubs/logging.h"
#include "server/frontends/v1/forward_codec.h"

namespace {

// Calls up to this many rows (input + context) also run Forward; bigger ones stop at Validate.
constexpr int64_t kMaxForwardRows = 16;

const attnserve::core::Layer& DemoLayer() {
  static const std::shared_ptr<const attnserve::core::Layer> layer = [] {
    // protobuf logs every string field with invalid UTF-8 it parses: most inputs.
    google::protobuf::SetLogHandler(nullptr);
    attnserve::core::SetComputeThreads(1);
    auto made = attnserve::core::Layer::Create(attnserve::core::MakeDemoWeights());
    if (!made.ok()) std::abort();
    return *std::move(made);
  }();
  return *layer;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve;
  const core::Layer& layer = DemoLayer();
  v1::ForwardRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  server::DecodedForward decoded;
  if (!server::DecodeForwardRequest(request, &decoded).ok()) return 0;
  const core::ForwardArgs& args = decoded.args;
  if (!layer.Validate(args).ok()) return 0;
  const int64_t rows = args.input.rows() + (args.context ? args.context->rows() : 0);
  if (rows > kMaxForwardRows) return 0;
  v1::ForwardResponse response;
  absl::StatusOr<server::ForwardBuffers> buffers =
      server::PrepareForwardResponse(decoded, layer.Shapes(args), &response);
  if (!buffers.ok()) std::abort();  // a small valid call always fits a reply
  if (!layer.Forward(args, buffers->output, buffers->attention).ok()) std::abort();
  return 0;
}
