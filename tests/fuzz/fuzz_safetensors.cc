// libFuzzer harness: bytes as a safetensors file, through everything that reads a weights file
// (ReadSafetensors, LoadLayerWeights with and without a prefix) and, for a file that loads, as
// far as is cheap: Layer::Create and one small Forward call of each kind the layer serves. Any
// input must give a status, never a crash, a sanitizer report, or a runaway allocation.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "core/layer.h"
#include "core/runtime_info.h"
#include "core/safetensors.h"
#include "core/weights.h"

namespace attnserve::core {
namespace {

// The reader takes a path: an in-memory file (memfd) stands in for one, rewritten per input,
// so the fuzzer does no disk I/O.
class MemoryFile {
 public:
  MemoryFile() : fd_(memfd_create("fuzz.safetensors", 0)) {
    if (fd_ < 0) std::abort();
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }

  const std::string& Write(const uint8_t* data, size_t size) {
    if (ftruncate(fd_, 0) != 0 || pwrite(fd_, data, size, 0) != static_cast<ssize_t>(size)) {
      std::abort();
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

// One call of `kind` with a batch of two sequences (lengths 2 and 1, padded to 2).
void ForwardOnce(const Layer& layer, AttentionKind kind) {
  const LayerSpec& spec = layer.spec();
  const std::vector<float> input(2 * 2 * spec.d_model, 0.25f);
  const std::vector<float> context(2 * 2 * spec.d_context, -0.5f);
  ForwardArgs args;
  args.kind = kind;
  args.input = RaggedBatch{
      .data = input.data(), .width = spec.d_model, .lengths = {2, 1}, .padded_length = 2};
  if (IsCross(kind)) {
    args.context = RaggedBatch{
        .data = context.data(), .width = spec.d_context, .lengths = {1, 2}, .padded_length = 2};
  }
  args.return_attention = true;
  if (!layer.Validate(args).ok()) return;  // e.g. a self kind on a cross-only layer
  const ForwardShapes shapes = layer.Shapes(args);
  std::vector<float> output(shapes.output_size()), attention(shapes.attention_size());
  if (!layer.Forward(args, output, attention).ok()) std::abort();  // valid calls must succeed
}

// The fixture with a prefix (w_prefixed) nests its layer under this one.
constexpr char kPrefix[] = "encoder.layers.0.self_attn.";
// Weights above this many floats are not worth a Forward per input.
constexpr int64_t kMaxForwardWeights = 1 << 14;

}  // namespace
}  // namespace attnserve::core

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace attnserve::core;
  static MemoryFile* file = [] {
    SetComputeThreads(1);  // the fuzzer runs one input at a time: no OpenMP team needed
    return new MemoryFile();
  }();
  const std::string& path = file->Write(data, size);
  // Each read parses the whole header, so only the reads that can differ run: the loader
  // without a prefix reads what ReadSafetensors does, and one with a prefix needs it in the file.
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  if (bytes.find(kPrefix) != std::string_view::npos) {
    (void)LoadLayerWeights(path, LoadOptions{.num_heads = 2, .prefix = kPrefix});
  }
  if (!ReadSafetensors(path).ok()) return 0;
  absl::StatusOr<LayerWeights> weights = LoadLayerWeights(path, LoadOptions{});
  if (!weights.ok()) return 0;
  const LayerSpec spec = weights->spec;
  if (spec.inner() * (spec.d_model + 2 * spec.d_context) > kMaxForwardWeights) return 0;
  absl::StatusOr<std::shared_ptr<const Layer>> layer = Layer::Create(*std::move(weights));
  if (!layer.ok()) std::abort();  // weights that load must make a layer
  for (AttentionKind kind : {AttentionKind::kBidirectional, AttentionKind::kCausal,
                             AttentionKind::kCross, AttentionKind::kCausalCross}) {
    ForwardOnce(**layer, kind);
  }
  return 0;
}
