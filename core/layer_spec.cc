#include "core/layer_spec.h"

namespace attnserve::core {

// The names match the proto's enum spellings, lower-cased, so logs and errors read the same
// on both sides of the wire.
std::string_view KindName(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kBidirectional:
      return "bidirectional";
    case AttentionKind::kCausal:
      return "causal";
    case AttentionKind::kCross:
      return "cross";
    case AttentionKind::kCausalCross:
      return "causal_cross";
  }
  return "unknown";
}

// The names say which tensors the file held, as a user would recognise them.
std::string_view LayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kSeparate:
      return "separate (W_q, W_k, W_v)";
    case WeightLayout::kQueryKeyValue:
      return "query_key_value (w_query, w_key, w_value)";
    case WeightLayout::kFusedQkv:
      return "fused (Wqkv, Wo)";
    case WeightLayout::kQueryKv:
      return "query_kv (Wq, Wkv, Wo)";
    case WeightLayout::kTorchMha:
      return "torch (in_proj_weight, out_proj)";
    case WeightLayout::kBuiltIn:
      return "built-in";
  }
  return "unknown";
}

std::string_view PrecisionName(Precision precision) {
  switch (precision) {
    case Precision::kF32:
      return "f32";
    case Precision::kBF16:
      return "bf16";
  }
  return "unknown";
}

}  // namespace attnserve::core
