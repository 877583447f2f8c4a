#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "core/layer_spec.h"
#include "core/weights.h"

namespace attnserve::server {

// The path that names the built-in demo layer instead of a file (`--model demo=built-in`).
inline constexpr absl::string_view kBuiltInSource = "built-in";

// One model to serve: a name clients use, where its weights come from and how to read them.
struct ModelConfig {
  std::string name;
  std::string path = std::string(kBuiltInSource);  // a safetensors file, or kBuiltInSource
  core::LoadOptions load;
  core::Precision precision = core::Precision::kF32;
};

}  // namespace attnserve::server
