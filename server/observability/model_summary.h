#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/layer_spec.h"
#include "server/observability/logging.h"

namespace attnserve::server {

// What a served model is, as everything that describes it reads it: attnserve.v1's ListModels,
// the Open Inference Protocol's metadata, the attnserve_model_info labels and the start-up log.
// Filled once, when the model loads (serving/model_registry.cc's Summarize).
struct ModelSummary {
  std::string name;
  std::string layout;     // core::LayoutName
  std::string precision;  // core::PrecisionName
  int64_t d_model = 0;
  int64_t d_context = 0;
  int64_t num_heads = 0;
  int64_t head_dim = 0;
  int64_t d_output = 0;  // the output's width (d_model, or the inner width without W_o)
  bool has_bias = false;
  bool has_output_projection = false;
  std::vector<core::AttentionKind> kinds;  // the kinds it serves, in kAttentionKinds order
  bool serves_sessions = false;            // decode sessions of a causal kind
  std::string source;                      // the weights file, or "built-in"
};

// The summary as the fields of a log line ("model loaded"), kinds as core spells them.
std::vector<LogField> SummaryFields(const ModelSummary& model);

}  // namespace attnserve::server
