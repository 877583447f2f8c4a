#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/observability/model_summary.h"

namespace attnserve::server {

// One loaded version of a model: immutable once made. Whoever computes with it holds it through
// a VersionHandle (a call from admission until it is answered; a decode session for its life),
// so a version retired by a swap or an unload keeps its weights exactly until the last holder
// lets go (TF Serving's ServableHandle).
struct ModelVersion {
  std::string name;
  int64_t version = 1;
  std::string source;  // the weights file, or "built-in"
  std::shared_ptr<const core::Layer> layer;
  ModelSummary summary;
};

using VersionHandle = std::shared_ptr<const ModelVersion>;

// Where a version is in its life: Triton's states, as the repository API spells them.
enum class VersionState { kLoading, kReady, kUnloading, kUnavailable };

inline constexpr VersionState kVersionStates[] = {VersionState::kLoading, VersionState::kReady,
                                                  VersionState::kUnloading,
                                                  VersionState::kUnavailable};

// "LOADING", "READY", "UNLOADING", "UNAVAILABLE".
inline absl::string_view VersionStateName(VersionState state) {
  switch (state) {
    case VersionState::kLoading:
      return "LOADING";
    case VersionState::kReady:
      return "READY";
    case VersionState::kUnloading:
      return "UNLOADING";
    case VersionState::kUnavailable:
      return "UNAVAILABLE";
  }
  return "UNAVAILABLE";
}

}  // namespace attnserve::server
