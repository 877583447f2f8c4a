#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layer_spec.h"

namespace attnserve::core {

// A layer's weights in one canonical form, whatever layout the file used. Every matrix is
// PyTorch's nn.Linear convention, row-major [out, in]; an absent bias is an empty vector.
struct LayerWeights {
  LayerSpec spec;
  std::vector<float> w_q, b_q;  // [inner, d_model], [inner]
  std::vector<float> w_k, b_k;  // [inner, d_context], [inner]
  std::vector<float> w_v, b_v;  // [inner, d_context], [inner]
  std::vector<float> w_o, b_o;  // [d_model, inner], [d_model]; empty without output projection
};

// How to read a weights file.
struct LoadOptions {
  std::optional<int64_t> num_heads;  // wins over the file's __metadata__ "num_heads"
  std::string prefix;  // stripped from every tensor name, e.g. "encoder.layers.0.self_attn."
};

// Loads a layer from a safetensors file, recognising the layout by its tensor names.
// Refuses missing or unexpected tensors, shapes that disagree, a num_heads that does not divide
// the inner width or is missing, with a message naming the file and the tensor; a file too
// large for the memory left is ResourceExhausted. Never throws.
absl::StatusOr<LayerWeights> LoadLayerWeights(const std::string& path, const LoadOptions& options);

// Checks that the matrices of `weights` have the sizes its spec says (used by every source of
// weights: the loader, the demo layer, tests).
absl::Status CheckWeights(const LayerWeights& weights);

// The built-in demo layer: d_model 256, 4 heads, fused QKV with biases and output projection,
// weights from a fixed seed (the same on every machine).
LayerWeights MakeDemoWeights();

}  // namespace attnserve::core
