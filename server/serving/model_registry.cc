#include "server/serving/model_registry.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/weights.h"
#include "server/observability/logging.h"

namespace attnserve::server {
namespace {

absl::StatusOr<std::shared_ptr<const core::Layer>> LoadLayer(const ModelConfig& config) {
  core::LayerWeights weights;
  if (config.path == kBuiltInSource) {
    weights = core::MakeDemoWeights();
  } else {
    absl::StatusOr<core::LayerWeights> loaded = core::LoadLayerWeights(config.path, config.load);
    if (!loaded.ok()) return loaded.status();
    weights = *std::move(loaded);
  }
  return core::Layer::Create(std::move(weights), config.precision);
}

}  // namespace

ModelSummary Summarize(absl::string_view name, absl::string_view source, const core::Layer& layer) {
  const core::LayerSpec& spec = layer.spec();
  ModelSummary summary{.name = std::string(name),
                       .layout = std::string(core::LayoutName(spec.layout)),
                       .precision = std::string(core::PrecisionName(layer.precision())),
                       .d_model = spec.d_model,
                       .d_context = spec.d_context,
                       .num_heads = spec.num_heads,
                       .head_dim = spec.head_dim,
                       .d_output = spec.d_output(),
                       .has_bias = spec.has_bias,
                       .has_output_projection = spec.has_output_projection,
                       .kinds = {},
                       .source = std::string(source)};
  for (core::AttentionKind kind : core::kAttentionKinds) {
    if (spec.Serves(kind)) summary.kinds.push_back(kind);
  }
  return summary;
}

absl::StatusOr<std::unique_ptr<ModelRegistry>> ModelRegistry::Load(
    const std::vector<ModelConfig>& configs, const SchedulerOptions& scheduler_options,
    int64_t decode_chunk_tokens, int compute_threads, CallReporter* reporter) {
  std::vector<ModelConfig> wanted = configs;
  if (wanted.empty()) wanted.emplace_back().name = "demo";
  std::unique_ptr<ModelRegistry> registry(new ModelRegistry);
  registry->executor_ = std::make_unique<ComputeExecutor>(compute_threads);
  for (const ModelConfig& config : wanted) {
    absl::StatusOr<std::shared_ptr<const core::Layer>> layer = LoadLayer(config);
    if (!layer.ok()) {
      return absl::Status(layer.status().code(),
                          absl::StrCat("model '", config.name, "': ", layer.status().message()));
    }
    auto model = std::make_unique<ServedModel>();
    model->name = config.name;
    model->source = config.path;
    model->layer = *std::move(layer);
    model->summary = Summarize(model->name, model->source, *model->layer);
    model->scheduler = std::make_unique<Scheduler>(model->name, model->layer, scheduler_options,
                                                   registry->executor_.get(), reporter);
    model->decode =
        std::make_unique<DecodeQueue>(model->name, decode_chunk_tokens, registry->executor_.get(),
                                      &reporter->metrics().ForModel(model->name));
    registry->models_.push_back(std::move(model));
  }
  return registry;
}

absl::StatusOr<ServedModel*> ModelRegistry::Find(absl::string_view name) const {
  if (name.empty()) {
    if (models_.size() == 1) return models_.front().get();
    return absl::InvalidArgumentError(
        absl::StrCat("model is empty but several models are loaded: ", Names()));
  }
  for (const auto& model : models_) {
    if (model->name == name) return model.get();
  }
  return absl::NotFoundError(absl::StrCat("no model '", Clipped(name), "'; loaded: ", Names()));
}

int ModelRegistry::pending() const {
  int total = 0;
  for (const auto& model : models_) total += model->scheduler->pending();
  return total;
}

void ModelRegistry::Drain(Clock::time_point deadline) {
  // Every queue closes first, so all models drain at once rather than one after another.
  for (const auto& model : models_) {
    model->scheduler->Close(deadline);
    model->decode->Close();
  }
  for (const auto& model : models_) {
    model->scheduler->Join();
    model->decode->Join();
  }
}

std::string ModelRegistry::Names() const {
  return absl::StrJoin(models_, ", ", [](std::string* out, const auto& model) {
    absl::StrAppend(out, model->name);
  });
}

}  // namespace attnserve::server
