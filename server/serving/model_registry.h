#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/observability/model_summary.h"
#include "server/serving/call_reporter.h"
#include "server/serving/compute_executor.h"
#include "server/serving/model_config.h"
#include "server/serving/decode_queue.h"
#include "server/serving/scheduler.h"

namespace attnserve::server {

// A loaded model as the server serves it: its layer, how it is described, and the scheduler
// that runs it.
struct ServedModel {
  std::string name;
  std::string source;  // the weights file, or "built-in"
  std::shared_ptr<const core::Layer> layer;
  ModelSummary summary;
  std::unique_ptr<Scheduler> scheduler;
  std::unique_ptr<DecodeQueue> decode;  // its sessions' steps
};

// What `layer`, served as `name` from `source`, is (ServedModel::summary).
ModelSummary Summarize(absl::string_view name, absl::string_view source, const core::Layer& layer);

// The models of one server, loaded once at start-up and fixed after.
class ModelRegistry {
 public:
  // Loads every model (the demo layer, named "demo", when `configs` is empty), each with its
  // scheduler and decode queue (steps of `decode_chunk_tokens` at most) on one compute executor of `compute_threads` (0: every core); answers go through
  // `reporter`, which outlives the registry. The first model that fails stops the loading with
  // the loader's message, prefixed by the model's name.
  static absl::StatusOr<std::unique_ptr<ModelRegistry>> Load(
      const std::vector<ModelConfig>& configs, const SchedulerOptions& scheduler_options,
      int64_t decode_chunk_tokens, int compute_threads, CallReporter* reporter);

  // The model a call names. An empty name means the only model; with several loaded it is
  // InvalidArgument, and an unknown name NotFound, both listing the models there are.
  absl::StatusOr<ServedModel*> Find(absl::string_view name) const;

  // Every model, in the order they were given.
  const std::vector<std::unique_ptr<ServedModel>>& models() const { return models_; }

  // Calls accepted and not yet answered, over every model.
  int pending() const;

  // Drains every scheduler: queued and running calls finish (those still queued at `deadline`
  // are refused), new ones are refused.
  void Drain(Clock::time_point deadline = Clock::time_point::max());

 private:
  ModelRegistry() = default;
  std::string Names() const;

  std::unique_ptr<ComputeExecutor> executor_;  // declared first: outlives the schedulers
  std::vector<std::unique_ptr<ServedModel>> models_;
};

}  // namespace attnserve::server
