// libFuzzer harness: bytes as a REST inference request body, through what the REST port does
// with one: DecodeHttpInfer (server/frontends/http/infer_json.h: JSON, or JSON then binary
// tensors), Layer::Validate on the demo layer and, for a small valid call, the reply's outputs,
// Forward into them and EncodeHttpInfer. The first byte chooses the form: bit 0 a binary body
// whose JSON part is the next two bytes' length (little-endian), bit 1 a body with no spare
// capacity (the parser's padded copy instead of the in-place parse). Any input must give a
// status, never a crash, a hang or a sanitizer report.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "core/layer.h"
#include "core/runtime_info.h"
#include "core/weights.h"
#include "server/frontends/http/infer_json.h"

namespace {

constexpr int64_t kMaxForwardRows = 16;

const attnserve::core::Layer& DemoLayer() {
  static const std::shared_ptr<const attnserve::core::Layer> layer = [] {
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
  if (size < 3) return 0;
  const bool binary = (data[0] & 1) != 0;
  const bool padded = (data[0] & 2) == 0;
  const int64_t json_length = binary ? (data[1] | (data[2] << 8)) : -1;
  std::string body(reinterpret_cast<const char*>(data + 3), size - 3);
  if (padded) body.reserve(body.size() + server::kJsonPadding);
  const size_t capacity = padded ? body.capacity() : body.size();
  server::DecodedHttpInfer decoded;
  if (!server::DecodeHttpInfer(body, capacity, json_length, &decoded).ok()) return 0;
  const core::Layer& layer = DemoLayer();
  const core::ForwardArgs& args = decoded.args;
  if (!layer.Validate(args).ok()) return 0;
  const int64_t rows = args.input.rows() + (args.context ? args.context->rows() : 0);
  if (rows > kMaxForwardRows) return 0;
  absl::StatusOr<server::ForwardBuffers> buffers =
      server::PrepareHttpOutputs(layer.Shapes(args), &decoded);
  if (!buffers.ok()) std::abort();  // a small valid call always fits a reply
  if (!layer.Forward(args, buffers->output, buffers->attention).ok()) std::abort();
  const server::HttpInferReply reply = server::EncodeHttpInfer("demo", 1, decoded);
  if (reply.json.empty()) std::abort();
  return 0;
}
