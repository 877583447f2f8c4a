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

std::optional<AttentionKind> KindFromName(std::string_view name) {
  for (AttentionKind kind : kAttentionKinds) {
    if (KindName(kind) == name) return kind;
  }
  return std::nullopt;
}

// Short, stable names: they are part of the wire contract (ModelInfo.layout) and of logs.
std::string_view LayoutName(WeightLayout layout) {
  switch (layout) {
    case WeightLayout::kSeparate:
      return "separate";
    case WeightLayout::kQueryKeyValue:
      return "query_key_value";
    case WeightLayout::kFusedQkv:
      return "fused_qkv";
    case WeightLayout::kQueryKv:
      return "query_kv";
    case WeightLayout::kTorchMha:
      return "torch_mha";
    case WeightLayout::kBuiltIn:
      return "built_in";
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
