#include "server/observability/model_summary.h"

#include "absl/strings/str_join.h"

namespace attnserve::server {

std::vector<LogField> SummaryFields(const ModelSummary& model) {
  std::vector<std::string> kinds;
  for (core::AttentionKind kind : model.kinds) kinds.emplace_back(core::KindName(kind));
  return {{"name", model.name},           {"d_model", model.d_model},
          {"d_context", model.d_context}, {"num_heads", model.num_heads},
          {"head_dim", model.head_dim},   {"layout", model.layout},
          {"has_bias", model.has_bias},   {"has_output_projection", model.has_output_projection},
          {"precision", model.precision}, {"kinds", absl::StrJoin(kinds, ",")},
          {"source", model.source}};
}

}  // namespace attnserve::server
