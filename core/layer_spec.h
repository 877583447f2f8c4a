#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace attnserve::core {

// Which positions a query may see; the cross kinds read keys and values from a context.
enum class AttentionKind { kBidirectional, kCausal, kCross, kCausalCross };

// True for the kinds that mask keys after the query's own position (top-left aligned).
constexpr bool IsCausal(AttentionKind kind) {
  return kind == AttentionKind::kCausal || kind == AttentionKind::kCausalCross;
}

// True for the kinds whose keys and values come from a separate context batch.
constexpr bool IsCross(AttentionKind kind) {
  return kind == AttentionKind::kCross || kind == AttentionKind::kCausalCross;
}

// Every kind, in the wire's order.
inline constexpr AttentionKind kAttentionKinds[] = {AttentionKind::kBidirectional,
                                                    AttentionKind::kCausal, AttentionKind::kCross,
                                                    AttentionKind::kCausalCross};

// The widest head decode sessions serve: a head's running state (of every query of a tile)
// lives on the stack of the cache's attention (kv_attention.cc).
inline constexpr int64_t kMaxDecodeHeadDim = 4096;

// The one spelling of each kind everywhere but the proto enum: "bidirectional", "causal",
// "cross", "causal_cross" (the enum's names lower-cased) in logs, metrics, the CLI and the
// Open Inference Protocol's `kind` parameter.
std::string_view KindName(AttentionKind kind);

// The kind spelled `name` by KindName, or nullopt.
std::optional<AttentionKind> KindFromName(std::string_view name);

// How the layer's weights were named in its file (README.md, "Serving your own PyTorch layer").
enum class WeightLayout {
  kSeparate,       // W_q, W_k, W_v
  kQueryKeyValue,  // w_query, w_key, w_value
  kFusedQkv,       // Wqkv, Wo
  kQueryKv,        // Wq, Wkv, Wo
  kTorchMha,       // in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias
  kBuiltIn,        // made in code (the demo layer)
};

std::string_view LayoutName(WeightLayout layout);

// The operands of the matmuls (projections, and the attention's Q K^T and P V where the CPU has
// AVX512-BF16); softmax and accumulation are always f32.
enum class Precision { kF32, kBF16 };

std::string_view PrecisionName(Precision precision);

// The shape of one attention layer.
struct LayerSpec {
  int64_t d_model = 0;    // width of the input and of the output
  int64_t d_context = 0;  // width of the cross-attention context (d_model unless said)
  int64_t num_heads = 0;
  int64_t head_dim = 0;  // d_model / num_heads unless said
  bool has_bias = false;
  bool has_output_projection = false;
  WeightLayout layout = WeightLayout::kBuiltIn;

  // Width of Q, K and V: num_heads * head_dim (may differ from d_model).
  int64_t inner() const { return num_heads * head_dim; }
  // Width of the layer's output: d_model with an output projection, inner without one.
  int64_t d_output() const { return has_output_projection ? d_model : inner(); }
  // Self kinds read keys and values from the input, which needs d_context == d_model.
  bool serves_self_attention() const { return d_context == d_model; }
  // The one decision of which kinds a layer serves: the cross kinds always, the self kinds when
  // keys and values can be read from the input.
  bool Serves(AttentionKind kind) const { return IsCross(kind) || serves_self_attention(); }
  // The one decision of which kinds decode sessions serve: the causal kinds the layer serves,
  // with heads of at most kMaxDecodeHeadDim.
  bool ServesSessions(AttentionKind kind) const {
    return IsCausal(kind) && Serves(kind) && head_dim <= kMaxDecodeHeadDim;
  }
};

}  // namespace attnserve::core
