#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/layer.h"
#include "server/observability/model_summary.h"
#include "server/serving/call_reporter.h"
#include "server/serving/compute_executor.h"
#include "server/serving/decode_queue.h"
#include "server/serving/model_config.h"
#include "server/serving/model_version.h"
#include "server/serving/repository.h"
#include "server/serving/scheduler.h"

namespace attnserve::server {

// What `layer`, served as `name` from `source`, is (ModelVersion::summary).
ModelSummary Summarize(absl::string_view name, absl::string_view source, const core::Layer& layer);

// Where the models come from and how they change (the server's flags).
struct RegistryOptions {
  std::vector<ModelConfig> models;  // --model: version 1 each, loaded at start, never unloaded
  std::string repository;           // --model-repository; "" for none
  ControlMode control_mode = ControlMode::kNone;
  std::chrono::milliseconds poll_interval = std::chrono::seconds(15);  // kPoll
  std::vector<std::string> load_models;  // kExplicit, at start: names, or "*" for every one
  SchedulerOptions scheduler;
  int64_t decode_chunk_tokens = SessionOptions{}.chunk_tokens;  // tokens of a step a run takes
  int compute_threads = 0;                                      // 0: every core
};

// One version as the repository index and ListModels report it.
struct VersionStatus {
  std::string model;
  int64_t version = 0;  // 0: the model has no version yet
  VersionState state = VersionState::kUnavailable;
  std::string reason;    // why UNAVAILABLE (a load failure, "unloaded", ...)
  VersionHandle handle;  // READY and UNLOADING versions
};

// A model name as the server serves it: one scheduler for every version (scheduler.h says why)
// and its versions' states. The registry's lock guards everything but the scheduler.
struct ServedModel {
  // A version number's life beyond the READY handle (ServedModel::ready).
  struct Record {
    bool loading = false;
    std::string reason;    // of the last failure or unload
    std::string stamp;     // FileStamp of the file loaded or last tried
    std::string load_key;  // RepositoryModelConfig::LoadKey it was loaded or tried with
    bool failed = false;   // the last try with this stamp and key failed
    std::vector<std::weak_ptr<const ModelVersion>> draining;  // retired, still held by calls
  };

  std::string name;
  bool from_flag = false;  // --model: version 1, always loaded
  std::unique_ptr<Scheduler> scheduler;
  // Its decode sessions' steps, every version's (a run holds one version's steps).
  std::unique_ptr<DecodeQueue> decode;
  std::vector<VersionHandle> ready;  // ascending version; the newest serves version 0
  std::map<int64_t, Record> records;
  std::string config_stamp;  // of the config.json last applied or refused
  std::string config_error;  // why the model's config.json was refused, if it was
  bool unloaded = false;     // by RepositoryModelUnload or a removed directory
};

// The models of one server and their versions: loaded at start from --model flags and the
// repository, then (poll, explicit) changed live. Files are read on the registry's own thread
// (never the compute thread, never under the lock); a version becomes visible atomically once
// it loaded and checked; the versions it replaces retire only then (load before unload), and
// each is freed, off the compute thread, when the last call holding it lets go.
class ModelRegistry {
 public:
  // Loads the start-up models (the demo layer, named "demo", when there is neither --model nor
  // a repository), each model with its scheduler on one compute executor; answers go through
  // `reporter`, which outlives the registry. A --model that fails stops the start with the
  // loader's message; a repository model that fails is reported (index, log, metric) instead.
  static absl::StatusOr<std::unique_ptr<ModelRegistry>> Load(const RegistryOptions& options,
                                                             CallReporter* reporter);
  ~ModelRegistry();

  // A model version a call may be admitted with.
  struct Found {
    ServedModel* model;
    VersionHandle version;
  };

  // The model a call names, at `version` (0: its newest ready one). An empty name means the only
  // model with a ready version (InvalidArgument when there are several); an unknown name, or a
  // version that is not ready, is NotFound naming what is ready.
  absl::StatusOr<Found> Find(absl::string_view name, uint64_t version = 0) const;

  // Every model and version with its state, models in name order; with `whole_repository`,
  // also the repository's models never loaded (UNAVAILABLE, "not loaded"), as Triton's index.
  std::vector<VersionStatus> Statuses(bool whole_repository = false) const;

  // The READY versions of every model.
  std::vector<VersionHandle> ReadyVersions() const;

  // Loads or reloads `name` from the repository on the registry's thread (`config`: JSON used
  // instead of its config.json) and calls `done` with the result there. FailedPrecondition
  // unless the control mode is explicit.
  void RequestLoad(std::string name, std::optional<std::string> config,
                   std::function<void(absl::Status)> done);

  // Unloads every version of `name` (queued calls are answered; new ones NotFound), the same way.
  void RequestUnload(std::string name, std::function<void(absl::Status)> done);

  ControlMode control_mode() const { return options_.control_mode; }
  const std::string& repository() const { return options_.repository; }

  // Calls accepted and not yet answered, over every model.
  int pending() const;

  // Stops loading (a load under way finishes; no other starts), then drains every scheduler: queued
  // and running calls finish (those still queued at `deadline` are refused), new ones are refused.
  void Drain(Clock::time_point deadline = Clock::time_point::max());

 private:
  struct Work;  // the registry thread's queue (loads, unloads, polls, versions to free)
  struct LoadPlan;

  ModelRegistry(const RegistryOptions& options, CallReporter* reporter);
  absl::Status LoadFlagModel(const ModelConfig& config);
  absl::Status LoadAtStart();
  // Brings `name` to what its directory and config (or `override`) say: the registry thread's
  // one way to load, reload and retire repository versions.
  absl::Status Reconcile(const std::string& name, const std::optional<std::string>& override,
                         bool retry_failed);
  absl::Status PlanLocked(ServedModel& model, const ModelDir& dir,
                          const RepositoryModelConfig& config, bool retry_failed, LoadPlan* plan);
  absl::Status Publish(ServedModel& model, const RepositoryModelConfig& config, LoadPlan& plan);
  absl::Status Unload(const std::string& name);
  void RetireLocked(ServedModel& model, const VersionHandle& version, const std::string& why);
  // A config refused (counted, logged): a config.json, by its `stamp`, is kept as the model's
  // config error in the index until it changes, and reported once; a load request's `config`
  // parameter (no stamp) is answered to its caller and not kept, since its load changed nothing.
  void ConfigFailed(const std::string& name, const std::optional<std::string>& stamp,
                    const absl::Status& why);
  void ConfigFailedLocked(ServedModel& model, const std::optional<std::string>& stamp,
                          const absl::Status& why);
  // NotFound: `name` has no version file in the repository.
  absl::Status NoVersions(const std::string& name) const;
  void Poll();
  void Loop();
  // Drain has begun: the registry thread starts no further load.
  bool Stopping() const;
  // Marks versions whose last holder let go as UNAVAILABLE.
  void SweepReleased();
  ServedModel& ModelLocked(const std::string& name);
  ServedModel* FindLocked(absl::string_view name) const;
  absl::StatusOr<VersionHandle> MakeVersion(const std::string& name, int64_t version,
                                            const std::string& path, const ModelConfig& config);
  void PublishStateLocked(const ServedModel& model) const;
  VersionState StateLocked(const ServedModel& model, int64_t version,
                           const ServedModel::Record& record) const;
  std::string ReadyNamesLocked() const;
  void Post(std::function<void(bool run)> task);

  const RegistryOptions options_;
  CallReporter* const reporter_;
  std::unique_ptr<ComputeExecutor> executor_;  // declared first: outlives the schedulers
  std::shared_ptr<Work> work_;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<ServedModel>> models_;  // guarded by mu_; never removed
  std::set<std::string> logged_ignored_;              // registry thread only
  std::thread thread_;
};

}  // namespace attnserve::server
